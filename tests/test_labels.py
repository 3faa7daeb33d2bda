"""Labels pooled over nights (tilecast.store.labels): known answers on small generated nights."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tilecast.core import dataset
from tilecast.store import labels
from tests.test_store import night


def _row(final, m, kernel):
    key = f"m={m},n=64,k=64,dtype=fp32,layout_a=row,layout_b=row"
    return final[(final["dims_key"] == key) & (final["kernel"] == kernel)].iloc[0]


def nights(*specs):
    """Frames of nights n1, n2, ... a day apart; each spec {m: {kernel: seconds}}."""
    return pd.concat([night(f"n{i}", spec, time_=f"2026-12-0{i}T01:00:00")
                      for i, spec in enumerate(specs, 1)], ignore_index=True)


def test_a_label_is_the_median_of_its_nights_relative_speeds():
    records = nights({8: {"a": 1.0e-5, "b": 1.10e-5}},
                     {8: {"a": 1.0e-5, "b": 1.00e-5}},
                     {8: {"a": 1.0e-5, "b": 1.05e-5}})
    final = labels.pooled_final(records)
    b = _row(final, 8, "b")
    assert b["nights"] == 3
    assert b["median_s"] == pytest.approx(1.05e-5)            # the median night's ratio
    # two kernels: each night's level takes half of their difference, the rest is spread
    d = np.log([1.10, 1.0, 1.05]) - np.log(1.05)
    assert b["spread"] == pytest.approx(np.exp(d.max() / 2) - np.exp(d.min() / 2))
    a_spread = np.exp(-d.min() / 2) - np.exp(-d.max() / 2)
    assert _row(final, 8, "a")["spread"] == pytest.approx(a_spread)
    assert _row(final, 8, "a")["median_s"] == pytest.approx(1e-5)
    assert dataset.winners(final, 1.0)[b["dims_key"]].kernel == "a"


def test_a_night_whose_whole_level_moved_moves_no_label():
    steady = nights({8: {"a": 1e-5, "b": 2e-5}}, {8: {"a": 1e-5, "b": 2e-5}})
    moved = nights({8: {"a": 1e-5, "b": 2e-5}}, {8: {"a": 3e-5, "b": 6e-5}})   # 3x slower night
    for records in (steady, moved):
        pooled = labels.pool(labels.night_labels(records)).set_index("kernel")
        assert pooled.loc["b", "rel"] == pytest.approx(0.5)
        assert pooled.loc["b", "spread"] == pytest.approx(0.0, abs=1e-12)


def test_a_kernel_one_night_missed_is_placed_against_its_rivals_by_the_others():
    # night 2 ran 2x slower and did not measure c: c keeps its place relative to a and b
    records = nights({8: {"a": 1e-5, "b": 2e-5, "c": 4e-5}}, {8: {"a": 2e-5, "b": 4e-5}},
                     {8: {"a": 1e-5, "b": 2e-5, "c": 4e-5}})
    final = labels.pooled_final(records)
    assert [_row(final, 8, k)["median_s"] for k in "abc"] == pytest.approx([1e-5, 2e-5, 4e-5])
    assert _row(final, 8, "c")["nights"] == 2


def test_a_new_build_key_starts_fresh():
    old = night("n1", {8: {"a": 1e-5, "b": 2e-5}}, time_="2026-12-01T01:00:00")
    new = night("n2", {8: {"a": 1e-5}}, time_="2026-12-02T01:00:00")
    rebuilt = night("n2", {8: {"b": 0.5e-5}}, time_="2026-12-02T01:00:00", build_key="b2")
    final = labels.pooled_final(pd.concat([old, new, rebuilt], ignore_index=True))
    assert _row(final, 8, "b")["nights"] == 1                  # b's old binary's night dropped
    assert _row(final, 8, "b")["median_s"] == pytest.approx(0.5e-5)
    assert _row(final, 8, "a")["nights"] == 2


def test_a_wrong_result_on_any_night_makes_the_pair_no_choice():
    records = pd.concat([night("n1", {8: {"a": 1e-5, "b": 0.5e-5}}, time_="2026-12-01T01:00:00"),
                         night("n2", {8: {"a": 1e-5}}, time_="2026-12-02T01:00:00"),
                         night("n2", {8: {"b": 0.5e-5}}, time_="2026-12-02T01:00:00",
                               status="wrong_result")], ignore_index=True)
    final = labels.pooled_final(records)
    assert _row(final, 8, "b")["status"] == "wrong_result"
    assert dataset.winners(final, 1.0)[_row(final, 8, "a")["dims_key"]].kernel == "a"


def test_only_the_latest_window_of_nights_counts():
    specs = [{8: {"a": 1e-5, "b": 4e-5}}] * 3 + [{8: {"a": 1e-5, "b": 1e-5}}] * 2
    records = nights(*specs)
    assert _row(labels.pooled_final(records, window=2), 8, "b")["median_s"] == pytest.approx(1e-5)
    assert _row(labels.pooled_final(records, window=5), 8, "b")["median_s"] == pytest.approx(4e-5)
    with pytest.raises(ValueError, match="at least one night"):
        labels.pooled_final(records, window=0)


def test_series_labels_pool_the_named_nights_in_time_order():
    records = nights({8: {"a": 1e-5, "b": 2e-5}}, {8: {"a": 2e-5, "b": 1e-5}})
    assert labels.nights_in_order(records) == ["n1", "n2"]
    first = labels.series_labels(records, ["n1"])
    assert dataset.winners(first, 1.0)[first["dims_key"].iloc[0]].kernel == "a"
    spread = labels.label_spread_summary(labels.pooled_final(records))
    assert spread["pairs"] == 2 and spread["median_nights"] == 2


def test_a_kernel_that_slows_against_its_rivals_for_two_nights_is_a_change_point():
    from tilecast.store import drift

    rng = np.random.default_rng(0)

    def spec(slow):
        return {m: {"a": 1e-5 * m * rng.uniform(0.995, 1.005),
                    "b": 1.2e-5 * m * slow * rng.uniform(0.995, 1.005),
                    "c": 1.5e-5 * m * rng.uniform(0.995, 1.005)} for m in (8, 16, 32)}

    steady = [spec(1.0) for _ in range(4)]
    records = nights(*steady, spec(1.10), spec(1.10))
    [point] = drift.change_points(records)
    assert point.kernel == "b" and point.night == "n5" and point.problems == 3
    assert point.shift == pytest.approx(0.10, abs=0.02)
    assert drift.change_points(nights(*steady, spec(1.0), spec(1.0))) == []
    # one slow night is not a change; a whole night's level moving is none either
    assert drift.change_points(nights(*steady, spec(1.0), spec(1.10))) == []
    level = {m: {k: 3 * v for k, v in kernels.items()} for m, kernels in spec(1.0).items()}
    assert drift.change_points(nights(*steady, level, level)) == []


def test_nights_with_no_valid_measurement_pool_to_their_failures_and_no_change():
    from tilecast.store import drift

    failed = night("n1", {8: {"a": 1e-5, "b": 2e-5}}, status="timeout")
    final = labels.pooled_final(failed)
    assert set(final["status"]) == {"timeout"} and set(final["nights"]) == {0}
    assert dataset.winners(final, 1.0) == {}
    assert drift.change_points(failed) == [] and drift.change_points(failed.iloc[0:0]) == []
