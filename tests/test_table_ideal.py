"""Tests for tilecast.table.ideal: the best value of a parameter per device and its trend over
one hardware figure, extrapolated to a device beyond the measured ones."""
from __future__ import annotations

import numpy as np

from tilecast.table import ideal


def test_the_ideal_is_the_soft_argmax_of_the_log_values():
    values = ideal.log_values([[15.0], [31.0], [63.0]])          # log2(v + 1): 4, 5, 6
    efficiency = np.array([[[0.5, 1.0, np.nan]], [[1.0, 0.97, 0.0]]])   # (D=2, P=1, C=3)
    got = ideal.ideals(efficiency, values)
    assert np.isclose(got[0, 0, 0], 5.0, atol=1e-6)   # 0.5 weighs exp(-0.5 / 0.03): ~nothing
    w = np.exp(-0.03 / ideal.TEMPERATURE)         # 0.97 weighs e^-1 against the best's 1
    assert np.isclose(got[1, 0, 0], (4.0 + 5.0 * w) / (1.0 + w))   # a failed cell (0) never
    empty = ideal.ideals(np.full((1, 1, 3), np.nan), values)
    assert np.isnan(empty).all()


def test_a_trend_over_one_figure_is_extrapolated_and_noise_is_not():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(6, 4)) * [1.0, 2.0, 1.0, 1.0]
    scale = np.array([1.0, 2.0, 1.0, 1.0])
    numeric = np.array([True, True, True, True])
    offsets = np.array([3.0, 5.0])                               # two problems
    # parameter 0 follows feature 1 (slope 0.5 per scale unit); parameter 1 is noise
    trend = offsets[None, :] + 0.5 * (vectors[:, 1] / 2.0)[:, None]
    noise = 4.0 + 0.3 * rng.normal(size=(6, 2))
    references = np.stack([trend, noise], axis=-1)               # (R, P, J)
    target = np.array([0.0, 12.0, 0.0, 0.0])                     # far beyond on feature 1
    predicted, choice = ideal.predict(references, vectors, target, scale, numeric)
    assert choice == [1, None]
    np.testing.assert_allclose(predicted[:, 0], offsets + 0.5 * 6.0, atol=1e-9)
    np.testing.assert_allclose(predicted[:, 1], noise.mean(axis=0))


def test_too_few_references_or_a_categorical_figure_fit_no_slope():
    vectors = np.array([[1.0, 0.0], [2.0, 1.0]])
    references = np.array([[[1.0]], [[2.0]]])                    # ideal = feature 0
    scale, target = np.ones(2), np.array([5.0, 1.0])
    predicted, choice = ideal.predict(references, vectors, target, scale, np.array([True, True]))
    assert choice == [None] and predicted[0, 0] == 1.5           # two references: the mean
    vectors = np.array([[1.0], [2.0], [3.0], [4.0]])
    references = vectors[:, :, None] * 1.0                       # a perfect trend ...
    predicted, choice = ideal.predict(references, vectors, np.array([9.0]), np.ones(1),
                                      np.array([False]))          # ... on a category
    assert choice == [None] and predicted[0, 0] == 2.5
