"""Robust statistics for timing samples: median, MAD, bootstrap intervals, and the tests that
compare two runs' samples (Mann-Whitney U, Wilcoxon signed-rank, Benjamini-Hochberg).

This is the one statistics module of tilecast. Timing samples are noisy and
occasionally broken (a preempted run, a NaN from a failed timer), so scores use
the median of the *usable* samples and spread is measured with the median
absolute deviation rather than the standard deviation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = [
    "benjamini_hochberg",
    "bootstrap_ci",
    "geometric_mean",
    "mad",
    "mann_whitney_p",
    "median",
    "relative_uncertainty",
    "stratified_welch_log_p",
    "usable",
    "wilcoxon_p",
]


def _as_floats(values: Iterable, what: str) -> list[float]:
    """Convert every value to float, naming the first one that is not a number."""
    floats = []
    for index, value in enumerate(values):
        try:
            floats.append(float(value))
        except (TypeError, ValueError):
            raise TypeError(
                f"{what}: value {value!r} at index {index} is not a number"
            ) from None
    return floats


def _require_nonempty(floats: Sequence[float], what: str) -> None:
    if not floats:
        raise ValueError(f"{what} of an empty sequence is undefined; pass at least one value")


def usable(values: Iterable) -> list[float]:
    """Return the usable samples as floats: finite and non-negative, in input order.

    A sample that is NaN, infinite or negative comes from a broken measurement
    and is dropped. Values that are not numbers raise TypeError.
    """
    return [v for v in _as_floats(values, "usable") if math.isfinite(v) and v >= 0.0]


def scored_samples(undisturbed: Iterable, disturbed: Iterable = ()) -> list[float]:
    """The samples a measurement is scored on: its usable undisturbed samples, or, when it has
    none (every one was kept apart by the contention or synchronization guard), its usable
    disturbed ones."""
    return usable(undisturbed) or usable(disturbed)


def median(values: Iterable) -> float:
    """Return the median of ``values`` (mean of the two middle values for even counts).

    Raises ValueError for an empty input or one containing NaN (NaN has no rank).
    Infinite values are ordered normally; middle values -inf and inf raise.
    """
    floats = _as_floats(values, "median")
    _require_nonempty(floats, "median")
    for index, value in enumerate(floats):
        if math.isnan(value):
            raise ValueError(
                f"median: value nan at index {index} has no rank; filter with usable() first"
            )
    ordered = sorted(floats)
    upper = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[upper]
    low, high = ordered[upper - 1], ordered[upper]
    middle = (low + high) / 2.0
    if math.isinf(middle) and math.isfinite(low) and math.isfinite(high):
        middle = low / 2.0 + high / 2.0  # the sum overflowed; halve first
    if math.isnan(middle):
        raise ValueError(f"median: the middle values {low!r} and {high!r} have no mean")
    return middle


def mad(values: Iterable, scale: float = 1.0) -> float:
    """Return ``scale * median(|x - median(x)|)``, the median absolute deviation.

    Unscaled by default; pass ``scale=1.4826`` for a consistent estimate of the
    standard deviation under normal noise. Raises ValueError for an empty input,
    a non-finite value, or a negative or non-finite ``scale``.
    """
    if not (math.isfinite(scale) and scale >= 0.0):
        raise ValueError(f"mad: scale must be finite and >= 0, got {scale!r}")
    floats = _finite_array(values, "mad").tolist()
    _require_nonempty(floats, "mad")
    center = median(floats)
    return scale * median(abs(v - center) for v in floats)


def relative_uncertainty(values: Iterable) -> float:
    """Return MAD / median of the usable samples.

    Returns ``inf`` when there is no usable sample or the median is 0, so a
    broken measurement never looks certain.
    """
    samples = usable(values)
    if not samples:
        return math.inf
    center = median(samples)
    if center == 0.0:
        return math.inf
    return mad(samples) / center


def bootstrap_ci(
    values: Iterable,
    stat: Callable[[np.ndarray], float] = median,
    confidence: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """Return a percentile-bootstrap confidence interval ``(low, high)`` for ``stat``.

    Resamples ``values`` with replacement ``n_resamples`` times using
    ``numpy.random.default_rng(seed)``, so the interval is reproducible for a
    given seed. ``stat`` receives a 1-D float array. Raises ValueError for an
    empty or non-finite input, ``confidence`` outside (0, 1) or ``n_resamples`` < 1.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence!r}")
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 1:
        raise ValueError(f"bootstrap_ci: n_resamples must be an int >= 1, got {n_resamples!r}")
    floats = _finite_array(values, "bootstrap_ci").tolist()
    _require_nonempty(floats, "bootstrap_ci")
    data = np.asarray(floats, dtype=np.float64)
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, data.size, size=(n_resamples, data.size))
    statistics = np.array([stat(data[row]) for row in indices], dtype=np.float64)
    alpha = 1.0 - confidence
    low, high = np.quantile(statistics, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(low), float(high)


def geometric_mean(values: Iterable) -> float:
    """Return the geometric mean of strictly positive, finite values.

    Used to average ratios (speedups, efficiencies). Raises ValueError for an
    empty input or naming the first value that is <= 0 or not finite.
    """
    floats = _as_floats(values, "geometric_mean")
    _require_nonempty(floats, "geometric_mean")
    for index, value in enumerate(floats):
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(
                f"geometric_mean: value {value!r} at index {index} must be finite and > 0"
            )
    return float(math.exp(math.fsum(math.log(v) for v in floats) / len(floats)))


# Up to this many samples in all (and without ties) the Mann-Whitney p-value is computed
# exactly: the normal approximation overstates small p-values, e.g. 1.8e-4 instead of 1.1e-5
# for ten fully separated samples a side, which a multiple-test correction then cannot forgive.
EXACT_MANN_WHITNEY_MAX = 60


def _finite_array(values: Iterable, what: str) -> np.ndarray:
    floats = _as_floats(values, what)
    for index, value in enumerate(floats):
        if not math.isfinite(value):
            raise ValueError(f"{what}: value {value!r} at index {index} is not finite; "
                             "filter with usable() first")
    return np.asarray(floats, dtype=np.float64)


def mann_whitney_p(first: Iterable, second: Iterable) -> float:
    """Two-sided Mann-Whitney U p-value that the two samples come from the same distribution.

    Exact for small samples without ties, the normal approximation (tie-corrected) otherwise.
    Raises ValueError when either sample has fewer than 2 values or a non-finite value.
    """
    from scipy.stats import mannwhitneyu  # slow to import; only the significance tests use it

    a, b = _finite_array(first, "mann_whitney_p"), _finite_array(second, "mann_whitney_p")
    if a.size < 2 or b.size < 2:
        raise ValueError(f"mann_whitney_p: needs at least 2 values a side, got {a.size} and {b.size}")
    ties = np.unique(np.concatenate([a, b])).size < a.size + b.size
    method = "exact" if not ties and a.size + b.size <= EXACT_MANN_WHITNEY_MAX else "asymptotic"
    return float(mannwhitneyu(a, b, alternative="two-sided", method=method).pvalue)


def welch_log_p(first: Iterable, second: Iterable) -> float:
    """Two-sided Welch t-test p-value that two sets of positive times have the same mean log.

    Meant for replicate medians (one per process run), whose logs are close to normal; equal
    sets give 1. Raises ValueError when either set has fewer than 2 values or a non-positive one.
    """
    from scipy.stats import ttest_ind  # slow to import; only the significance tests use it

    a, b = _finite_array(first, "welch_log_p"), _finite_array(second, "welch_log_p")
    if a.size < 2 or b.size < 2:
        raise ValueError(f"welch_log_p: needs at least 2 values a side, got {a.size} and {b.size}")
    if (a <= 0).any() or (b <= 0).any():
        raise ValueError("welch_log_p: times must be positive")
    la, lb = np.log(a), np.log(b)
    if np.ptp(la) == 0 and np.ptp(lb) == 0:
        return 1.0 if la[0] == lb[0] else 0.0
    return float(ttest_ind(la, lb, equal_var=False).pvalue)


def stratified_welch_log_p(strata: Sequence[tuple[Iterable, Iterable]]) -> float | None:
    """Two-sided p-value that the mean over strata of (mean log first - mean log second) is 0.

    Each stratum (a problem) holds two sets of replicate times (one per process run): its
    difference of mean logs has the Welch variance s1^2 / n1 + s2^2 / n2; the strata's
    differences are averaged with equal weight, their variances summed, and the degrees of
    freedom taken by Welch-Satterthwaite. A shift common to the strata is tested on every
    stratum's replicates at once (three problems of four rounds a side give about 18 degrees
    of freedom, where a rank test across three problems can never reach 0.01). None when no
    stratum has 2 values a side; strata with fewer are left out. Raises ValueError for a
    non-positive time.
    """
    from scipy.stats import t as student_t  # slow to import; only the significance tests use it

    shift, variance, df_denominator, used = 0.0, 0.0, 0.0, 0
    for first, second in strata:
        a = _finite_array(first, "stratified_welch_log_p")
        b = _finite_array(second, "stratified_welch_log_p")
        if a.size < 2 or b.size < 2:
            continue
        if (a <= 0).any() or (b <= 0).any():
            raise ValueError("stratified_welch_log_p: times must be positive")
        la, lb = np.log(a), np.log(b)
        shift += float(la.mean() - lb.mean())
        for logs in (la, lb):
            term = float(logs.var(ddof=1)) / logs.size
            variance += term
            df_denominator += term * term / (logs.size - 1)
        used += 1
    if not used:
        return None
    if variance == 0.0:
        return 1.0 if shift == 0.0 else 0.0
    # the 1 / used^2 of averaging cancels in the statistic and in the degrees of freedom
    statistic = abs(shift) / math.sqrt(variance)
    df = variance * variance / df_denominator
    return float(min(1.0, 2.0 * student_t.sf(statistic, df)))


def wilcoxon_p(differences: Iterable) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value that paired differences are centred on 0.

    None when the test has nothing to say: fewer than 2 non-zero differences.
    """
    from scipy.stats import wilcoxon  # slow to import; only the significance tests use it

    d = _finite_array(differences, "wilcoxon_p")
    if np.count_nonzero(d) < 2:
        return None
    return float(wilcoxon(d, alternative="two-sided", zero_method="wilcox").pvalue)


def benjamini_hochberg(p_values: Sequence[float | None]) -> list[float | None]:
    """Benjamini-Hochberg adjusted p-values (q-values), in the input order.

    Controls the false discovery rate over all the given tests: reject where q <= alpha.
    None entries (no test) stay None and do not count as tests. Raises ValueError for a
    p-value outside [0, 1] or NaN.
    """
    indexed = []
    for index, p in enumerate(p_values):
        if p is None:
            continue
        p = float(p)
        if not 0.0 <= p <= 1.0:  # also rejects NaN
            raise ValueError(f"benjamini_hochberg: p-value {p!r} at index {index} is not in [0, 1]")
        indexed.append((p, index))
    adjusted: list[float | None] = [None] * len(p_values)
    count = len(indexed)
    running = 1.0
    # from the largest p down: q_(i) = min over j >= i of p_(j) * m / j
    for rank, (p, index) in zip(range(count, 0, -1), sorted(indexed, reverse=True)):
        running = min(running, p * count / rank)
        adjusted[index] = running
    return adjusted
