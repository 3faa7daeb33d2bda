"""Kernel families, registered by name: the built-ins in one explicit table (BUILT_IN), and
those other distributions declare under the `tilecast.families` entry-point group.

A plugin's entry point is named after its family and points at a Family instance:

    [project.entry-points."tilecast.families"]
    rowsum = "tilecast_rowsum.family:FAMILY"

FAMILIES merges the two. It reads the entry points the first time something asks for a name
that is not built in, or lists the families (never at import: importing tilecast reads no
package metadata and imports no plugin). A plugin that cannot be used is left out, with one
line that names its entry point and package: its import failed, its object is not a Family
(a protocol member missing), its `name` is not its entry point's, or its name is a built-in's
or another package's (both packages named; neither plugin of a clash is served, a built-in
always is). That line is logged once and is the error of `get_family` for that name, so the
built-ins and every other plugin keep working for the commands that do not use it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from importlib import metadata

from tilecast import __version__
from tilecast.core.family import Family, FamilyError
from tilecast.families.disco import DiscoFamily
from tilecast.families.gemm import FAMILY as GEMM
from tilecast.families.grouped_conv import GroupedConvFamily

log = logging.getLogger("tilecast.families")

ENTRY_POINT_GROUP = "tilecast.families"

BUILT_IN: dict[str, Family] = {
    "gemm": GEMM,
    "grouped_conv_forward": GroupedConvFamily("forward"),
    "grouped_conv_bwd_data": GroupedConvFamily("bwd_data"),
    "grouped_conv_bwd_weight": GroupedConvFamily("bwd_weight"),
    "disco_forward": DiscoFamily("forward"),
    "disco_backward": DiscoFamily("backward"),
}

# What a plugin's object must have: the Family protocol's attributes and methods (read off
# the protocol itself, so a member added there is required here too), and CANDIDATE_OPTIONS,
# the keys a config's `candidates:` may hold (the config schema's, tilecast.config.schema).
PROTOCOL_MEMBERS = tuple(sorted({*Family.__annotations__, "CANDIDATE_OPTIONS",
                                 *(name for name in vars(Family) if not name.startswith("_"))}))


def _package(entry_point: metadata.EntryPoint) -> str:
    """`distribution version` of the package that declares `entry_point`."""
    dist = entry_point.dist
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown package"


def _spelled(entry_point: metadata.EntryPoint) -> str:
    return f"entry point {entry_point.name!r} = {entry_point.value!r} of {_package(entry_point)}"


def _load(entry_point: metadata.EntryPoint) -> Family:
    """The Family an entry point names; FamilyError in one line naming it otherwise."""
    where = f"{ENTRY_POINT_GROUP} {_spelled(entry_point)}"
    try:
        family = entry_point.load()
    except Exception as err:   # a plugin's import may raise anything; it must not stop tilecast
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise FamilyError(f"{where} failed to import: {reason}") from None
    missing = [member for member in PROTOCOL_MEMBERS if not hasattr(family, member)]
    if missing:
        raise FamilyError(f"{where} is not a kernel family: {type(family).__name__} lacks "
                          f"{', '.join(missing)} of the Family protocol (tilecast.core.family)")
    if family.name != entry_point.name:
        raise FamilyError(f"{where} is a family named {family.name!r}; an entry point must "
                          f"bear its family's name")
    return family


def discover(entry_points: list[metadata.EntryPoint]) -> tuple[dict[str, Family], dict[str, str]]:
    """(name -> plugin family, name -> why the plugin of that name is refused) of the given
    entry points (see the module docstring); refusals are logged, one line each."""
    by_name: dict[str, list[metadata.EntryPoint]] = {}
    for entry_point in entry_points:
        by_name.setdefault(entry_point.name, []).append(entry_point)
    plugins, refused = {}, {}
    for name, declared in by_name.items():
        if name in BUILT_IN:
            refused[name] = (f"{ENTRY_POINT_GROUP} {_spelled(declared[0])} clashes with the "
                             f"built-in family {name!r} of tilecast {__version__}; rename the "
                             f"plugin's family")
        elif len(declared) > 1:
            refused[name] = (f"kernel family {name!r} is declared by two packages, "
                             f"{_package(declared[0])} ({declared[0].value}) and "
                             f"{_package(declared[1])} ({declared[1].value}); uninstall one")
        else:
            try:
                plugins[name] = _load(declared[0])
            except FamilyError as err:
                refused[name] = str(err)
    for line in refused.values():
        log.warning("%s", line)
    return plugins, refused


class FamilyTable(Mapping):
    """Family name -> Family: BUILT_IN, then the plugins (read on first need, see the module
    docstring). `refused` holds, after loading, why each unusable plugin was left out."""

    def __init__(self, built_in: Mapping[str, Family]):
        self._built_in = dict(built_in)
        self._plugins: dict[str, Family] | None = None
        self.refused: dict[str, str] = {}
        self._lock = threading.Lock()   # the stages' threads may ask at once: load once

    def _merged(self) -> dict[str, Family]:
        with self._lock:
            if self._plugins is None:
                self._plugins, self.refused = discover(
                    list(metadata.entry_points(group=ENTRY_POINT_GROUP)))
            return {**self._built_in, **self._plugins}

    def reload(self) -> None:
        """Read the entry points again on next use (after installing a plugin in-process)."""
        with self._lock:
            self._plugins, self.refused = None, {}

    def __getitem__(self, name: str) -> Family:
        if name in self._built_in:   # a built-in never waits on (or breaks for) a plugin
            return self._built_in[name]
        return self._merged()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())


FAMILIES = FamilyTable(BUILT_IN)


def get_family(name: str) -> Family:
    """The family registered under `name`; FamilyError lists the valid names otherwise, or
    says why the plugin of that name was refused."""
    try:
        return FAMILIES[name]
    except KeyError:
        if name in FAMILIES.refused:
            raise FamilyError(f"kernel family {name!r} is unusable: "
                              f"{FAMILIES.refused[name]}") from None
        raise FamilyError(f"unknown kernel family {name!r}; valid: {', '.join(FAMILIES)}") from None
