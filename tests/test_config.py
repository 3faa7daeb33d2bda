"""Run configs: the shipped ones load; malformed ones are rejected naming file and key."""
from __future__ import annotations

import pytest

from tilecast.core.config import ConfigError, load_config


@pytest.mark.parametrize("name", ["quick", "nightly"])
def test_shipped_configs_load(name):
    cfg = load_config(name)
    gemm = cfg.families["gemm"]
    assert gemm.problems["train"] and gemm.problems["holdout"]


def test_nightly_holdout_is_large_skinny_and_non_power_of_two():
    holdout = load_config("nightly").families["gemm"].problems["holdout"]
    assert len(holdout) >= 40
    assert any(min(p["m"], p["n"]) <= 16 for p in holdout)
    assert any(any(p[f] & (p[f] - 1) for f in ("m", "n", "k")) for p in holdout)


@pytest.mark.parametrize("text, fragment", [
    ("name: x\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\nprotcol: {}\n",
     "unknown key.*protcol"),
    ("name: x\nfamilies: {conv9: {}}\n", "unknown family 'conv9'"),
    ("name: x\nfamilies: {gemm: {candidates: {}, problems: {train: []}}}\n", "missing key.*holdout"),
    ("name: x\nprotocol: {samples: 0}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     "samples=0"),
    ("name: x\nbench: {rounds: 0}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     r"bench.rounds: expected a whole number >= 1, got 0"),
    ("name: x\nbench: {retry_disturbed: two}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     r"bench.retry_disturbed: expected a whole number >= 0, got 'two'"),
    ("name: x\nbench: {interleave: 'no'}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     r"bench.interleave: expected true or false, got 'no'"),
    ("name: [unclosed\n", "not valid YAML"),
    ("name: x\nfamilies: {gemm: {candidates: {}, problems: {train: [{grid: {m: [1]}, list: []}], holdout: []}}}\n",
     "exactly one of grid / list / random"),
])
def test_malformed_configs_are_named(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment) as err:
        load_config(path)
    assert "bad.yaml" in str(err.value)


def test_missing_config_lists_the_available_ones():
    with pytest.raises(ConfigError, match="available: .*quick"):
        load_config("no-such-config")
