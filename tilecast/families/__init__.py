"""Kernel families, registered by name in one explicit table."""
from __future__ import annotations

from tilecast.core.family import Family, FamilyError
from tilecast.families.disco import DiscoFamily
from tilecast.families.gemm import FAMILY as GEMM
from tilecast.families.grouped_conv import GroupedConvFamily

FAMILIES: dict[str, Family] = {
    "gemm": GEMM,
    "grouped_conv_forward": GroupedConvFamily("forward"),
    "grouped_conv_bwd_data": GroupedConvFamily("bwd_data"),
    "grouped_conv_bwd_weight": GroupedConvFamily("bwd_weight"),
    "disco_forward": DiscoFamily("forward"),
    "disco_backward": DiscoFamily("backward"),
}


def get_family(name: str) -> Family:
    """The family registered under `name`; FamilyError lists the valid names otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise FamilyError(f"unknown kernel family {name!r}; valid: {', '.join(FAMILIES)}") from None
