"""Known-answer tests for tilecast.core.stats."""

import math

import numpy as np
import pytest

from tilecast.core import stats


# --- median ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([3.0, 1.0, 2.0], 2.0),
        ([4.0, 1.0, 3.0, 2.0], 2.5),
        ([7.0], 7.0),
        ([1.0, 1.0, 100.0], 1.0),  # one outlier does not move it
        ((5, 2, 9, 1, 3), 3.0),  # ints and tuples are accepted
        (np.array([0.25, 0.75]), 0.5),
        ([1.0, math.inf, 2.0], 2.0),  # infinities are ordered
    ],
)
def test_median_known_answers(values, expected):
    assert stats.median(values) == expected


def test_median_of_huge_values_does_not_overflow():
    assert stats.median([1e308, 1.5e308]) == 1.25e308


def test_median_empty_raises():
    with pytest.raises(ValueError, match="empty"):
        stats.median([])


def test_median_nan_raises_naming_index():
    with pytest.raises(ValueError, match="index 1"):
        stats.median([1.0, math.nan, 2.0])


def test_median_of_opposite_infinities_raises():
    with pytest.raises(ValueError, match="inf"):
        stats.median([-math.inf, math.inf])


def test_median_non_number_raises_type_error():
    with pytest.raises(TypeError, match="'fast'"):
        stats.median([1.0, "fast"])


# --- mad ---------------------------------------------------------------------


def test_mad_known_answer():
    # median 2; deviations 1,1,0,0,2,4,7 -> sorted 0,0,1,1,2,4,7 -> 1
    assert stats.mad([1, 1, 2, 2, 4, 6, 9]) == 1.0


def test_mad_even_count():
    # median 2.5; deviations 1.5, 0.5, 0.5, 1.5 -> median 1.0
    assert stats.mad([1.0, 2.0, 3.0, 4.0]) == 1.0


def test_mad_scale():
    assert stats.mad([1, 1, 2, 2, 4, 6, 9], scale=1.4826) == pytest.approx(1.4826)


def test_mad_constant_is_zero():
    assert stats.mad([3.5, 3.5, 3.5]) == 0.0


def test_mad_ignores_single_outlier():
    assert stats.mad([10.0, 10.0, 11.0, 1e9]) == 0.5


def test_mad_empty_raises():
    with pytest.raises(ValueError, match="empty"):
        stats.mad([])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_mad_non_finite_raises(bad):
    with pytest.raises(ValueError, match="not finite"):
        stats.mad([1.0, bad])


@pytest.mark.parametrize("scale", [-1.0, math.nan, math.inf])
def test_mad_bad_scale_raises(scale):
    with pytest.raises(ValueError, match="scale"):
        stats.mad([1.0, 2.0], scale=scale)


# --- usable ------------------------------------------------------------------


def test_usable_keeps_finite_non_negative_in_order():
    values = [1, -1.0, math.nan, math.inf, 2.5, 0.0, -math.inf, np.float32(0.5)]
    result = stats.usable(values)
    assert result == [1.0, 2.5, 0.0, 0.5]
    assert all(type(v) is float for v in result)


def test_usable_empty():
    assert stats.usable([]) == []


# --- relative_uncertainty ----------------------------------------------------


def test_relative_uncertainty_known_answer():
    # MAD 1 / median 2
    assert stats.relative_uncertainty([1, 1, 2, 2, 4, 6, 9]) == 0.5


def test_relative_uncertainty_uses_only_usable_samples():
    assert stats.relative_uncertainty([2.0, 2.0, 2.2, math.nan, -1.0, math.inf]) == 0.0


@pytest.mark.parametrize(
    "values", [[], [math.nan, -1.0, math.inf], [0.0, 0.0, 1.0]], ids=["empty", "none-usable", "zero-median"]
)
def test_relative_uncertainty_is_inf_when_undefined(values):
    assert stats.relative_uncertainty(values) == math.inf


# --- bootstrap_ci ------------------------------------------------------------


def test_bootstrap_ci_of_constant_is_a_point():
    assert stats.bootstrap_ci([5.0] * 8) == (5.0, 5.0)


def test_bootstrap_ci_is_reproducible_for_a_seed():
    values = [1.0, 1.2, 0.9, 1.1, 3.0, 1.05, 0.95, 1.3]
    assert stats.bootstrap_ci(values, seed=7) == stats.bootstrap_ci(values, seed=7)


def test_bootstrap_ci_matches_direct_resampling():
    values = [1.0, 1.2, 0.9, 1.1, 3.0, 1.05, 0.95, 1.3]
    rng = np.random.default_rng(3)
    data = np.asarray(values)
    medians = [np.median(data[rng.integers(0, 8, size=8)]) for _ in range(200)]
    expected = tuple(np.quantile(medians, [0.05, 0.95]))
    low, high = stats.bootstrap_ci(values, confidence=0.90, n_resamples=200, seed=3)
    assert (low, high) == pytest.approx(expected)


def test_bootstrap_ci_brackets_the_median_and_widens_with_confidence():
    values = [1.0, 1.2, 0.9, 1.1, 3.0, 1.05, 0.95, 1.3, 1.15, 0.98]
    low50, high50 = stats.bootstrap_ci(values, confidence=0.5)
    low99, high99 = stats.bootstrap_ci(values, confidence=0.99)
    assert low99 <= low50 <= stats.median(values) <= high50 <= high99
    assert low99 >= min(values) and high99 <= max(values)


def test_bootstrap_ci_custom_stat():
    low, high = stats.bootstrap_ci([2.0, 4.0], stat=np.max, n_resamples=500)
    assert (low, high) == (2.0, 4.0)  # max of a resample is 2 only if both draws are 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"values": []}, "empty"),
        ({"values": [1.0, math.nan]}, "not finite"),
        ({"values": [1.0], "confidence": 1.0}, "confidence"),
        ({"values": [1.0], "confidence": 0.0}, "confidence"),
        ({"values": [1.0], "n_resamples": 0}, "n_resamples"),
    ],
)
def test_bootstrap_ci_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        stats.bootstrap_ci(**kwargs)


# --- geometric_mean ----------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [([1.0, 4.0, 16.0], 4.0), ([2, 8], 4.0), ([3.0], 3.0), ([0.5, 2.0], 1.0)],
)
def test_geometric_mean_known_answers(values, expected):
    assert stats.geometric_mean(values) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf])
def test_geometric_mean_rejects_naming_bad_value(bad):
    with pytest.raises(ValueError, match=f"value {bad!r} at index 1"):
        stats.geometric_mean([1.0, bad, 2.0])


def test_geometric_mean_empty_raises():
    with pytest.raises(ValueError, match="empty"):
        stats.geometric_mean([])
