"""Tests for tilecast.core.tune: the tie and selection invariants as properties, plus known answers."""

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilecast.core import tune
from tilecast.core.tune import BuildEvent, Score

PROPERTY = settings(max_examples=150, deadline=None)

# Values chosen so ties, boundary cases and unusable scores are common.
VALUES = st.one_of(
    st.sampled_from([0.0, 1.0, 1.005, 1.01, 1.02, 2.0, math.inf, -math.inf, math.nan, -1.0]),
    st.floats(min_value=0.0, max_value=100.0),
    st.floats(allow_nan=True, allow_infinity=True),
)
SECONDARIES = st.one_of(st.integers(0, 4).map(float), st.floats(0.0, 1e6))
THRESHOLDS = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.floats(0.0, 50.0))


@st.composite
def score_lists(draw, min_size=0, max_size=12):
    ids = draw(st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=min_size,
                        max_size=max_size, unique=True))
    return [Score(i, draw(VALUES), draw(SECONDARIES)) for i in ids]


def within_threshold(value, fastest, threshold_pct):
    """The tie-set condition of the design, written out independently."""
    if fastest == 0.0:
        return value == 0.0
    return (value - fastest) / fastest * 100 <= threshold_pct


# --- select_best / tie_set ---------------------------------------------------


@PROPERTY
@given(scores=score_lists(), threshold=THRESHOLDS)
def test_select_best_is_none_exactly_when_nothing_usable(scores, threshold):
    best = tune.select_best(scores, threshold)
    assert (best is None) == (not any(s.usable for s in scores))


@PROPERTY
@given(scores=score_lists(min_size=1), threshold=THRESHOLDS)
def test_select_best_is_usable_and_within_threshold_of_fastest(scores, threshold):
    best = tune.select_best(scores, threshold)
    usable = [s for s in scores if s.usable]
    if not usable:
        return
    fastest = min(s.value for s in usable)
    assert best.usable
    assert best in scores
    assert within_threshold(best.value, fastest, threshold)
    # and it is the (secondary, id) minimum of everything within the threshold
    tied = [s for s in usable if within_threshold(s.value, fastest, threshold)]
    assert (best.secondary, best.id) == min((s.secondary, s.id) for s in tied)


@PROPERTY
@given(data=st.data(), scores=score_lists(), threshold=THRESHOLDS)
def test_select_best_is_order_independent(data, scores, threshold):
    shuffled = data.draw(st.permutations(scores))
    first, second = tune.select_best(scores, threshold), tune.select_best(shuffled, threshold)
    assert (first and first.id) == (second and second.id)
    assert tune.tie_set(scores, threshold) == tune.tie_set(shuffled, threshold)


@PROPERTY
@given(scores=score_lists(), threshold=THRESHOLDS)
def test_tie_set_is_sorted_usable_and_exact(scores, threshold):
    tied = tune.tie_set(scores, threshold)
    keys = [(s.value, s.secondary, s.id) for s in tied]
    assert keys == sorted(keys)
    usable = [s for s in scores if s.usable]
    fastest = min((s.value for s in usable), default=None)
    expected = {s.id for s in usable if within_threshold(s.value, fastest, threshold)}
    assert {s.id for s in tied} == expected


def test_select_best_known_table_ties_by_secondary_then_id():
    table = [
        Score("k_a", 1.000, secondary=300),
        Score("k_c", 1.005, secondary=100),  # 0.5 % slower
        Score("k_b", 1.005, secondary=100),  # same as k_c: the smaller id wins
        Score("k_d", 1.020, secondary=50),  # 2 % slower
        Score("k_nan", math.nan, secondary=0),
        Score("k_inf", math.inf, secondary=0),
        Score("k_neg", -1.0, secondary=0),  # a broken timer must not win
    ]
    assert tune.select_best(table).id == "k_a"
    assert tune.select_best(table, threshold_pct=1.0).id == "k_b"
    assert tune.select_best(table, threshold_pct=5.0).id == "k_d"
    assert [s.id for s in tune.tie_set(table, 1.0)] == ["k_a", "k_b", "k_c"]


def test_select_best_with_zero_fastest_ties_only_zeros():
    table = [Score("z2", 0.0, 5), Score("z1", 0.0, 5), Score("tiny", 1e-12, 0)]
    assert tune.select_best(table, threshold_pct=50.0).id == "z1"


def test_select_best_rejects_duplicate_ids_and_bad_threshold():
    with pytest.raises(ValueError, match="'x'"):
        tune.select_best([Score("x", 1.0), Score("x", 2.0)])
    with pytest.raises(ValueError, match="-1"):
        tune.select_best([Score("x", 1.0)], threshold_pct=-1)
    with pytest.raises(ValueError, match="nan"):
        tune.select_best([Score("x", 1.0)], threshold_pct=math.nan)


def test_select_best_without_usable_score_is_none():
    assert tune.select_best([Score("a", math.nan), Score("b", math.inf)]) is None
    assert tune.tie_set([Score("a", math.nan), Score("b", -1.0)], 1.0) == []


# --- fnv1a64 / seeded_order --------------------------------------------------


def reference_fnv1a64(data: bytes) -> int:
    """Plain 64-bit FNV-1a with no seed, checked against published vectors below."""
    digest = 0xCBF29CE484222325
    for byte in data:
        digest = ((digest ^ byte) * 0x100000001B3) % 2**64
    return digest


def test_reference_fnv1a64_matches_published_vectors():
    assert reference_fnv1a64(b"") == 0xCBF29CE484222325  # the offset basis
    assert reference_fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert reference_fnv1a64(b"foobar") == 0x85944171F73967E8


def test_fnv1a64_empty_input_hashes_the_seed_bytes():
    # The seed is always hashed first as 8 little-endian bytes, so even seed 0
    # does not give the bare offset basis: fnv1a64(b"", 0) is FNV-1a of 8 zero bytes.
    assert tune.fnv1a64(b"", 0) == 0xA8C7F832281A39C5
    assert tune.fnv1a64(b"", 0) == reference_fnv1a64(bytes(8))
    assert tune.fnv1a64(b"", 0) != 0xCBF29CE484222325
    assert tune.fnv1a64(b"", 1) == reference_fnv1a64(b"\x01" + bytes(7))


@PROPERTY
@given(data=st.binary(max_size=40), seed=st.integers(0, 2**64 - 1))
def test_fnv1a64_is_fnv1a_of_seed_bytes_then_data(data, seed):
    assert tune.fnv1a64(data, seed) == reference_fnv1a64(seed.to_bytes(8, "little") + data)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_fnv1a64_rejects_bad_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        tune.fnv1a64(b"x", seed)


IDS = st.lists(st.text(min_size=1, max_size=6), max_size=15, unique=True)


@dataclass(frozen=True)
class Candidate:
    """An object with a str ``.id``, as seeded_order accepts beside bare ids."""

    id: str
    config: dict


@PROPERTY
@given(data=st.data(), ids=IDS, seed=st.integers(0, 2**32))
def test_seeded_order_is_a_permutation_depending_only_on_ids_and_seed(data, ids, seed):
    ordered = tune.seeded_order(ids, seed)
    assert sorted(ordered) == sorted(ids)
    assert tune.seeded_order(data.draw(st.permutations(ids)), seed) == ordered
    # objects are ordered by their ids alone
    candidates = [Candidate(i, {"n": n}) for n, i in enumerate(ids)]
    shuffled = data.draw(st.permutations(candidates))
    assert [c.id for c in tune.seeded_order(shuffled, seed)] == ordered
    # and the order is the hash order of the utf-8 ids
    hashes = [tune.fnv1a64(i.encode("utf-8"), seed) for i in ordered]
    assert hashes == sorted(hashes)


def test_seeded_order_known_answer_and_seed_dependence():
    ids = ["a", "b", "c", "d", "e"]
    assert tune.seeded_order(ids, 0) == ["e", "d", "a", "c", "b"]
    assert tune.seeded_order(ids, 1) == ["d", "e", "a", "b", "c"]


@PROPERTY
@given(ids=IDS, seed=st.integers(0, 2**32), strata=st.integers(1, 4))
def test_stratified_order_deals_each_prefix_evenly_across_strata(ids, seed, strata):
    stratum = lambda i: tune.fnv1a64(i.encode("utf-8"), 99) % strata   # noqa: E731
    ordered = tune.stratified_order(ids, seed, stratum)
    assert sorted(ordered) == sorted(ids)
    # within a stratum, the seeded order
    seeded = tune.seeded_order(ids, seed)
    for s in range(strata):
        assert [i for i in ordered if stratum(i) == s] == [i for i in seeded if stratum(i) == s]
    # any prefix: a stratum with items left never trails another by more than one
    sizes = {s: sum(stratum(i) == s for i in ids) for s in range(strata)}
    for cut in range(len(ordered) + 1):
        taken = {s: sum(stratum(i) == s for i in ordered[:cut]) for s in range(strata)}
        open_counts = [taken[s] for s in taken if taken[s] < sizes[s]]
        assert not open_counts or max(taken.values()) - min(open_counts) <= 1


def test_stratified_order_known_answer():
    ids = ["a1", "a2", "a3", "b1", "c1", "c2"]
    dealt = tune.stratified_order(ids, 0, lambda i: i[0])
    # one of each stratum, then one of each that has more (a and c), then a's last
    assert [i[0] for i in dealt[:3]] == list(dict.fromkeys(i[0] for i in tune.seeded_order(ids, 0)))
    assert {i[0] for i in dealt[3:5]} == {"a", "c"} and dealt[5][0] == "a"


def test_seeded_order_rejects_items_without_id():
    with pytest.raises(TypeError, match="42"):
        tune.seeded_order(["a", 42], 0)


# --- confirmation_count ------------------------------------------------------


@PROPERTY
@given(
    base=st.integers(0, 50),
    uncertainty=st.one_of(st.floats(min_value=0.0), st.just(math.nan)),
    budget=st.integers(0, 100),
)
def test_confirmation_count_lies_in_zero_to_budget(base, uncertainty, budget):
    count = tune.confirmation_count(base, uncertainty, budget)
    assert 0 <= count <= budget
    assert count in (min(base * k, budget) for k in (1, 2, 3))


@PROPERTY
@given(base=st.integers(0, 20), low=st.floats(0.0, 1.0), high=st.floats(0.0, 1.0))
def test_confirmation_count_is_monotone_in_uncertainty(base, low, high):
    low, high = sorted((low, high))
    assert tune.confirmation_count(base, low, 1000) <= tune.confirmation_count(base, high, 1000)


@pytest.mark.parametrize(
    ("uncertainty", "expected"),
    [(0.0, 3), (0.04, 3), (0.05, 3), (0.1, 6), (0.20, 6), (0.5, 9), (math.inf, 9), (math.nan, 9)],
)
def test_confirmation_count_known_answers(uncertainty, expected):
    assert tune.confirmation_count(3, uncertainty, budget=100) == expected


def test_confirmation_count_clamps_to_budget_and_rejects_negatives():
    assert tune.confirmation_count(3, 0.5, budget=5) == 5
    assert tune.confirmation_count(3, 0.04, budget=0) == 0
    for args in [(-1, 0.1, 5), (3, -0.1, 5), (3, 0.1, -5)]:
        with pytest.raises(ValueError, match="-"):
            tune.confirmation_count(*args)


# --- score_samples -----------------------------------------------------------


def test_score_samples_median_of_usable_samples():
    score = tune.score_samples("k1", [1.0, 3.0, math.nan, 2.0, -1.0, math.inf, 10.0], secondary=7)
    assert score == Score("k1", 2.5, 7.0, score.samples)
    assert score.usable
    assert len(score.samples) == 7  # every sample is kept


@pytest.mark.parametrize("samples", [[], [math.nan], [-1.0, math.inf]])
def test_score_samples_without_usable_sample_is_invalid_inf(samples):
    score = tune.score_samples("k1", samples)
    assert score.value == math.inf and not score.usable


def test_score_usable_property():
    assert Score("a", 0.0).usable and Score("a", 1.5).usable
    assert not any(Score("a", v).usable for v in (math.nan, math.inf, -math.inf, -0.5))


# --- value objects -----------------------------------------------------------


def test_every_status_vocabulary_comes_from_the_one_table():
    from tilecast.core import dataset
    from tilecast.table import dataset as table_dataset

    names = [s.name for s in dataset.STATUS_TABLE]
    assert len(set(names)) == len(names) and all(s.meaning for s in dataset.STATUS_TABLE)
    assert dataset.STATUSES == ("ok", "build_failed", "unsupported", "wrong_result", "timeout",
                                "crashed")
    assert table_dataset.STATUSES == dataset.TABLE_STATUSES == dataset.STATUSES + ("failed",)
    assert set(dataset.LEGACY_STATUSES.values()) <= set(dataset.TABLE_STATUSES)
    assert not set(dataset.LEGACY_STATUSES) & set(names)
    assert tune.BUILD_STATUSES is dataset.BUILD_STATUSES


def test_build_event_status_comes_from_the_table():
    assert tune.BUILD_STATUSES == ("ok", "failed", "rejected")
    for status in tune.BUILD_STATUSES:
        assert BuildEvent("k1", status).status == status
    with pytest.raises(ValueError, match="'crashed'.*ok, failed, rejected"):
        BuildEvent("k1", "crashed")


@pytest.mark.parametrize(("field", "value"), [("seconds", -0.5), ("seconds", math.inf),
                                              ("binary_bytes", -1), ("binary_bytes", 1.5)])
def test_build_event_refuses_a_bad_cost(field, value):
    with pytest.raises(ValueError, match=f"{field}.*{value!r}"):
        BuildEvent("k1", "ok", **{field: value})


def test_value_objects_are_frozen():
    score = Score("a", 1.0)
    with pytest.raises(AttributeError):
        score.value = 0.0
