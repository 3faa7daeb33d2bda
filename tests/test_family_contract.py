"""The contract every kernel family keeps, written once and checked for every family of
tilecast.families.FAMILIES (the built-ins, and the plugins installed here, such as
tests/plugin_family's rowsum: tests/test_plugin_family.py runs this file on it where it is not
installed): kernel names round-trip over the family's space and bad names are
refused naming the bad value; problems round-trip through their dict, bad problems are refused
naming the field and value; dims_key is stable and tells distinct problems apart; the
applicability key never merges problems whose candidate masks differ."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tilecast.config import expand_problems
from tilecast.families import FAMILIES, FamilyError

# where a family's problems are read: the first of these configs that has the family (the
# plugin's config lives in its package, tests/plugin_family)
PROBLEM_SETS = (Path(__file__).resolve().parents[1] / "configs" / "quick.yaml",
                *sorted((Path(__file__).parent / "configs").glob("*.yaml")),
                *sorted((Path(__file__).parent / "plugin_family").glob("*.yaml")))
# wider than the defaults where a family has more to cover; every other family: its defaults
GROUPED_CONV_TILES = {"tiles": ["8x16x1", "16x32x64", "64x64x32", "128x16x256"]}
SPACE_OPTIONS = {
    "gemm": {"dtype": ["fp32", "bf16"], "isa": ["avx512", "avx2"], "mc": [48, 96, 192, 384],
             "nc": [256, 512, 2048], "kc": [64, 128, 256, 512], "parallel": ["m", "n", "k"],
             "pack_a": [True, False], "prefetch": [True, False]},
    "grouped_conv_forward": GROUPED_CONV_TILES,
    "grouped_conv_bwd_data": GROUPED_CONV_TILES,
    "grouped_conv_bwd_weight": GROUPED_CONV_TILES,
}
BAD = "bogus"

family_names = pytest.mark.parametrize("family_name", list(FAMILIES))


def space(family_name: str) -> list:
    """Every variant of the family's space, whatever the CPU (no flags: nothing filtered)."""
    return FAMILIES[family_name].candidate_space(SPACE_OPTIONS.get(family_name, {}), {"flags": []})


def problems(family_name: str) -> list:
    """The family's train and holdout problems of configs/quick.yaml (else of the first test
    or plugin config that runs it), validated."""
    family = FAMILIES[family_name]
    found = [document["families"][family_name]["problems"] for document in
             (yaml.safe_load(path.read_text()) for path in PROBLEM_SETS)
             if family_name in document.get("families", {})]
    assert found, f"no config of {[str(p) for p in PROBLEM_SETS]} runs family {family_name!r}"
    body = found[0]
    return [family.problem(values) for split in ("train", "holdout")
            for values in expand_problems(f"{family_name}.{split}", body[split])]


def test_every_family_is_registered_under_its_name():
    assert FAMILIES and all(family.name == name for name, family in FAMILIES.items())


# -- kernel names --------------------------------------------------------------------------

@family_names
def test_names_round_trip_over_the_space(family_name):
    family = FAMILIES[family_name]
    configs = space(family_name)
    assert len(configs) >= 10
    names = [family.kernel_name(cfg) for cfg in configs]
    assert len(set(names)) == len(configs), "two variants share a name"
    for cfg, name in zip(configs, names):
        assert family.parse_name(name) == cfg
        assert set(family.config_dict(cfg)) == set(family.config_fields)


def test_no_two_families_share_a_kernel_name():
    names = {name: {FAMILIES[name].kernel_name(cfg) for cfg in space(name)} for name in FAMILIES}
    for first, second in ((a, b) for a in names for b in names if a < b):
        assert not names[first] & names[second], (first, second)


@family_names
def test_names_of_other_families_and_garbage_are_refused(family_name):
    family = FAMILIES[family_name]
    others = [FAMILIES[other].kernel_name(space(other)[0]) for other in FAMILIES
              if other != family_name]
    for name in [*others, "", "x", family.kernel_name(space(family_name)[0]) + "_zz"]:
        with pytest.raises(FamilyError) as refused:
            family.parse_name(name)
        assert repr(name)[1:-1] in str(refused.value)


@family_names
def test_an_unknown_name_part_is_named(family_name):
    """Each text field of a config spelled as its own name part (dtype, isa, pipeline...),
    replaced by an unknown word: the error names that word."""
    family = FAMILIES[family_name]
    checked = 0
    for cfg in space(family_name)[:40]:
        parts = family.kernel_name(cfg).split("_")
        for field, value in family.config_dict(cfg).items():
            if not isinstance(value, str) or parts.count(value) != 1:
                continue
            bad = "_".join(BAD if part == value else part for part in parts)
            with pytest.raises(FamilyError, match=BAD):
                family.parse_name(bad)
            checked += 1
    assert checked >= 40


# -- problems ------------------------------------------------------------------------------

@family_names
def test_problems_round_trip_through_their_dict(family_name):
    family = FAMILIES[family_name]
    for problem in problems(family_name):
        values = family.problem_dict(problem)
        assert tuple(values) == family.problem_fields
        assert family.problem(values) == problem
        assert family.problem({k: str(v) for k, v in values.items()}) == problem   # CLI k=v


@family_names
def test_bad_problems_are_refused_naming_field_and_value(family_name):
    family = FAMILIES[family_name]
    values = family.problem_dict(problems(family_name)[0])
    with pytest.raises(FamilyError, match="missing"):
        family.problem({})
    with pytest.raises(FamilyError, match="extra_field"):
        family.problem({**values, "extra_field": 1})
    for field, value in values.items():
        with pytest.raises(FamilyError) as refused:
            family.problem({**values, field: BAD})
        assert field in str(refused.value) and BAD in str(refused.value)
        if isinstance(value, int) and not isinstance(value, bool):
            for bad in (-5, 2.5):
                with pytest.raises(FamilyError) as refused:
                    family.problem({**values, field: bad})
                assert field in str(refused.value) and str(bad) in str(refused.value)


@family_names
def test_dims_key_is_stable_and_tells_problems_apart(family_name):
    family = FAMILIES[family_name]
    found = problems(family_name)
    assert len(found) >= 10
    keys = {family.dims_key(p) for p in found}
    assert len(keys) == len(set(found))
    for problem in found:
        again = family.problem(family.problem_dict(problem))
        assert family.dims_key(again) == family.dims_key(problem)


@family_names
def test_dims_key_changes_with_every_field_it_can(family_name):
    """Each integer field of a problem moved by one, where the result is still a valid
    problem: a different key."""
    family = FAMILIES[family_name]
    checked = set()
    for problem in problems(family_name)[:10]:
        values = family.problem_dict(problem)
        for field, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            try:
                other = family.problem({**values, field: value + 1})
            except FamilyError:
                continue
            assert family.dims_key(other) != family.dims_key(problem), field
            checked.add(field)
    assert len(checked) >= 3


# -- applicability -------------------------------------------------------------------------

@family_names
def test_equal_applicability_keys_mean_equal_masks(family_name):
    family = FAMILIES[family_name]
    configs = space(family_name)
    masks = {}
    for problem in problems(family_name):
        mask = tuple(family.applicable(cfg, problem) for cfg in configs)
        key = family.applicability_key(problem)
        if key is not None:
            assert masks.setdefault(key, mask) == mask, (key, problem)
        assert any(mask), f"no candidate applies to {family.dims_key(problem)}"
