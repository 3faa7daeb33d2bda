"""Tests for tilecast.table.features and tilecast.table.model: a small GEMM-shaped dataset on
devices of the shipped hardware table, timed by a plausible rule plus noise."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from tilecast.table.dataset import (Column, TableDataError, TableDataset, TableSchema,
                                    finish_frame, write_dataset)
from tilecast.table.devices import DeviceTable, UnknownDeviceError
from tilecast.table.features import MAX_FIT_PAIRS, MAX_PROBLEM_PAIRS, TableFeatures
from tilecast.table.model import TableModel, check_problem, efficiencies, sample_rows

SCHEMA = TableSchema(
    problem=(Column("m", "numeric"), Column("n", "numeric"), Column("k", "numeric")),
    config=(Column("tile_m", "numeric"), Column("tile_n", "numeric"), Column("vec", "numeric"),
            Column("layout", "categorical")))
DEVICES = ("A100-PCIE-40GB", "V100-SXM2", "T4", "MI250X", "RTX 3090")
PROBLEMS = [{"m": m, "n": n, "k": k} for m, n, k in
            [(64, 64, 512), (100, 2048, 256), (512, 512, 512), (1000, 300, 64),
             (2048, 2048, 1024), (4096, 96, 128), (333, 777, 2048)]]
CONFIGS = [{"tile_m": tm, "tile_n": tn, "vec": vec, "layout": layout}
           for tm, tn, vec, layout in itertools.product((16, 32, 64, 128), (16, 32, 64, 128),
                                                        (1, 2, 4), ("row", "col"))]
ROUNDS = 60
# one thread: on a busy two-core machine LightGBM's second thread spins waiting for a core
THREADS = 1


def status_of(entry: dict, config: dict) -> str:
    """Big tiles with wide vectors do not fit a small shared memory; AMD rejects column layout
    with 4-wide vectors at compile time."""
    if config["tile_m"] * config["tile_n"] * config["vec"] > 16384 * entry["shared_memory_kib"] / 64:
        return "unsupported"
    if entry["vendor"] == "amd" and config["layout"] == "col" and config["vec"] == 4:
        return "build_failed"
    return "ok"


def time_of(entry: dict, problem: dict, config: dict, noise: float) -> float:
    """Seconds: padded FLOPs at a rate set by tile occupancy of the device's compute units,
    vector width against the warp size and tile reuse, bounded below by DRAM traffic."""
    m, n, k = problem["m"], problem["n"], problem["k"]
    tm, tn, vec = config["tile_m"], config["tile_n"], config["vec"]
    blocks = math.ceil(m / tm) * math.ceil(n / tn)
    units = entry["compute_units"]
    occupancy = blocks / (math.ceil(blocks / units) * units)
    padding = m * n / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn)
    preferred = 4 if entry["warp_size"] == 64 else 2
    vector = 1.0 - 0.2 * abs(math.log2(vec) - math.log2(preferred))
    reuse = min(1.0, tm * tn / 4096) ** 0.35
    layout = 1.0 if config["layout"] == "row" else (0.85 if entry["vendor"] == "nvidia" else 1.1)
    rate = entry["peak_tflops"]["fp32"] * 1e12 * occupancy * padding * vector * reuse * layout
    compute = 2.0 * m * n * k / rate
    traffic = 4.0 * k * (m * math.ceil(n / tn) + n * math.ceil(m / tm))
    memory = traffic / (entry["memory_bandwidth_gbs"] * 1e9)
    return (max(compute, memory) + 2e-6) * noise


def make_rows(devices=DEVICES, problems=PROBLEMS, configs=CONFIGS, seed: int = 0) -> list[dict]:
    table = DeviceTable.load()
    rng = np.random.default_rng(seed)
    rows = []
    for device in devices:
        entry = table.entry(device)
        for problem, config in itertools.product(problems, configs):
            status = status_of(entry, config)
            noise = float(rng.lognormal(0.0, 0.03))
            rows.append({**problem, **config, "device": device, "status": status,
                         "median_s": time_of(entry, problem, config, noise) if status == "ok"
                         else math.nan})
    return rows


def make_dataset(devices=DEVICES, problems=PROBLEMS, seed: int = 0) -> TableDataset:
    return TableDataset(frame=finish_frame(make_rows(devices, problems, seed=seed), SCHEMA),
                        schema=SCHEMA)


def write_test_dataset(path, devices=DEVICES, problems=PROBLEMS):
    frame = finish_frame(make_rows(devices, problems), SCHEMA)
    return write_dataset(path, frame, SCHEMA, [{"file": "synthetic", "format": "test"}])


@pytest.fixture(scope="module")
def devices() -> DeviceTable:
    return DeviceTable.load()


@pytest.fixture(scope="module")
def dataset() -> TableDataset:
    return make_dataset()


@pytest.fixture(scope="module")
def model(dataset, devices) -> TableModel:
    return TableModel.fit(dataset, devices, rounds=ROUNDS, seed=0, threads=THREADS)


@pytest.fixture(scope="module")
def model_without_t4(dataset, devices) -> TableModel:
    return TableModel.fit(dataset, devices, exclude_devices=["T4"], rounds=ROUNDS, seed=0,
                          threads=THREADS)


def pick_efficiency(model: TableModel, dataset: TableDataset, device: str) -> np.ndarray:
    """The measured efficiency of the model's pick on every problem of `device` (0 when the
    pick failed there)."""
    frame = dataset.frame[dataset.frame["device"] == device]
    ok = frame[frame["status"] == "ok"]
    best = ok.groupby("dims_key")["median_s"].min()
    times = ok.set_index(["dims_key", "kernel"])["median_s"]
    values = []
    for problem in PROBLEMS:
        scores = model.predict(problem, device)
        pick = max(scores, key=scores.get)
        key = f"m={problem['m']},n={problem['n']},k={problem['k']}"
        values.append(best[key] / times[(key, pick)] if (key, pick) in times.index else 0.0)
    return np.array(values)


# -- features -------------------------------------------------------------------------------

def test_feature_names_follow_the_schema(devices):
    features = TableFeatures(SCHEMA, devices)
    names = features.names
    for expected in ("m", "log2(m)", "m*n", "m/n", "n*k", "log2(size)", "tile_m",
                     "log2(vec)", "layout", "m/tile_m", "fit(m,tile_m)", "fit(k,vec)",
                     "device:warp_size", "device:log2_fp32_tflops"):
        assert expected in names
    assert len(names) == len(set(names))
    assert [names[i] for i in features.categorical_indices] == ["layout"]
    assert TableFeatures(SCHEMA, devices).names == names   # fixed by the schema


def test_pairs_are_capped_for_wide_schemas(devices):
    wide = TableSchema(problem=tuple(Column(f"p{i}", "numeric") for i in range(10)),
                       config=tuple(Column(f"c{i}", "numeric") for i in range(8)))
    features = TableFeatures(wide, devices)
    assert len(features.blocks.problem_pairs) == MAX_PROBLEM_PAIRS == 15
    assert len(features.blocks.fit_pairs) == MAX_FIT_PAIRS == 48
    assert len(features.names) == (10 * 2 + 15 * 2 + 1) + 8 * 2 + 48 * 2 + \
        len(DeviceTable.FEATURE_NAMES)


def test_feature_values_known_answers(dataset, devices):
    features = TableFeatures(SCHEMA, devices).fit(dataset.frame)
    frame = pd.DataFrame([{"m": 100, "n": 0, "k": 64, "tile_m": 64, "tile_n": 32, "vec": 2,
                           "layout": "diagonal", "device": "T4"}])
    row = dict(zip(features.names, features.rows(frame)[0].tolist()))
    assert row["fit(m,tile_m)"] == pytest.approx(100 / 128)
    assert row["fit(k,tile_m)"] == pytest.approx(1.0)
    assert row["m*n"] == 0 and math.isnan(row["m/n"])          # a ratio over zero is missing
    assert math.isnan(row["fit(n,tile_n)"])                      # a zero size has no fit
    assert row["log2(m)"] == pytest.approx(math.log2(101))
    assert math.isnan(row["layout"])                              # unseen category: missing
    assert row["device:warp_size"] == 32
    assert features.categories_["layout"] == ["col", "row"]


def test_rows_and_grid_build_the_same_matrix(dataset, devices):
    features = TableFeatures(SCHEMA, devices).fit(dataset.frame)
    problems = pd.DataFrame(PROBLEMS[:3])
    configs = pd.DataFrame(CONFIGS[:10])
    grid = features.grid(problems, configs, "MI250X")
    rows = problems.merge(configs, how="cross").assign(device="MI250X")
    np.testing.assert_array_equal(features.rows(rows), grid)


def test_structured_choice_names_give_tile_features(devices):
    """Inductor's choices spell their tiles: BLOCK-M=32 fits m, and two such parts make the
    tiles over the device's compute units."""
    from tilecast.table.features import choice_parts

    assert choice_parts("type=triton_BLOCK-M=16_BLOCK-K=128_numwarps=4") == {
        "BLOCK-M": 16.0, "BLOCK-K": 128.0, "numwarps": 4.0}
    assert choice_parts("extern_mm") == {} and choice_parts("a=1.5") == {"a": 1.5}
    schema = TableSchema(problem=(Column("m", "numeric"), Column("n", "numeric")),
                         config=(Column("choice", "categorical"),))
    choices = ["extern_mm"] + [f"type=triton_BLOCK-M={bm}_BLOCK-N={bn}_numwarps={w}"
                               for bm in (32, 64) for bn in (32, 128) for w in (4, 8)]
    frame = pd.DataFrame([{"m": 100, "n": 1000, "choice": c, "device": "A100-SXM4-80GB"}
                          for c in choices])
    features = TableFeatures(schema, devices).fit(frame)
    assert features.parts_ == [("choice", "BLOCK-M"), ("choice", "BLOCK-N"),
                               ("choice", "numwarps")]
    assert features.part_fits_ == [("m", "choice", "BLOCK-M"), ("n", "choice", "BLOCK-N")]
    assert {"choice.BLOCK-M", "fit(m,choice.BLOCK-M)", "waves(m,n)", "tail(m,n)"} <= \
        set(features.names)
    row = dict(zip(features.names, features.rows(frame.iloc[[0, 3]])[1]))  # 32 x 128, warps 4
    assert row["choice.BLOCK-N"] == 128 and row["choice.numwarps"] == 4
    assert row["fit(m,choice.BLOCK-M)"] == pytest.approx(100 / 128)
    units = devices.entry("A100-SXM4-80GB")["compute_units"]
    assert row["waves(m,n)"] == pytest.approx(4 * 8 / units)
    assert row["tail(m,n)"] == pytest.approx(4 * 8 / units)          # under one wave
    plain = dict(zip(features.names, features.rows(frame.iloc[[0]])[0]))
    assert math.isnan(plain["choice.BLOCK-M"]) and math.isnan(plain["waves(m,n)"])
    # grid and rows agree; a model's engine round-trips its parts
    grid = features.grid(frame[["m", "n"]].iloc[:1], frame[["choice"]], "A100-SXM4-80GB")
    np.testing.assert_array_equal(features.rows(frame), grid)
    again = TableFeatures.from_json(features.to_json(), devices)
    assert again.names == features.names
    assert TableFeatures(schema, devices, parts=False).fit(frame).parts_ == []


# -- the training target --------------------------------------------------------------------

def test_efficiency_is_best_time_over_time_per_device_and_problem():
    ok = pd.DataFrame({"device": ["a", "a", "a", "b", "b"], "dims_key": ["p"] * 5,
                       "median_s": [2.0, 1.0, 4.0, 3.0, 6.0]})
    np.testing.assert_allclose(efficiencies(ok), [0.5, 1.0, 0.25, 1.0, 0.5])


def test_large_groups_keep_their_best_rows_and_a_deterministic_sample():
    rng = np.random.default_rng(1)
    ok = pd.DataFrame({"device": "a", "dims_key": np.repeat(["p", "q"], 1000),
                       "kernel": [f"c={i}" for i in range(1000)] * 2,
                       "median_s": rng.uniform(1, 10, 2000)})
    efficiency = efficiencies(ok)
    kept = sample_rows(ok, efficiency, budget=400)              # 200 rows a group
    assert len(kept) == 400
    assert np.array_equal(kept, sample_rows(ok, efficiency, budget=400))
    for group in ("p", "q"):
        rows = ok.index[ok["dims_key"] == group]
        best = rows[np.argsort(-efficiency[rows])[:50]]         # TOP_SHARE of the cap
        assert set(best) <= set(kept)
    assert len(sample_rows(ok, efficiency, budget=10**6)) == 2000


# -- the model ------------------------------------------------------------------------------

def test_candidates_and_failures_come_from_the_data(model, dataset):
    ok = dataset.frame[dataset.frame["status"] == "ok"]
    assert model.candidates() == sorted(set(ok["kernel"]))
    t4 = dataset.frame[(dataset.frame["device"] == "T4") & (dataset.frame["status"] != "ok")]
    assert model.failed_on("T4") == set(t4["kernel"]) and model.failed_on("T4")
    assert model.failed_on("Tesla T4") == model.failed_on("T4")   # a label of the device
    assert model.failed_on("H200") == set()


def test_predict_covers_the_allowed_candidates_and_never_a_failed_one(model):
    for device in DEVICES:
        predicted = model.predict(PROBLEMS[2], device)
        assert set(predicted) == set(model.candidates()) - model.failed_on(device)
        assert all(np.isfinite(v) and v > 0 for v in predicted.values())


def test_failed_configurations_are_never_picked_though_the_model_likes_them(model,
                                                                          monkeypatch):
    # a model that rates what failed on MI250X best of all: the exclusion keeps it out
    failed = model.failed_on("MI250X")
    assert failed
    liking = lambda problem, device, kernels, table=None: np.array(   # noqa: E731
        [10.0 if k in failed else 0.5 for k in kernels])
    monkeypatch.setattr(model, "scores", liking)
    for problem in PROBLEMS:
        allowed = model.predict(problem, "MI250X")
        assert set(allowed) == set(model.candidates()) - failed
        assert max(allowed.values()) == 0.5


def test_in_sample_picks_are_near_the_best(model, dataset):
    efficiency = np.concatenate([pick_efficiency(model, dataset, d) for d in DEVICES])
    assert efficiency.mean() >= 0.9, efficiency


def test_lambdarank_learns_each_problems_order(dataset, devices):
    """The listwise formulation: (device, problem) groups as queries, grades from efficiency;
    its scores map into (0, 1) and rank in-sample picks near the best."""
    from tilecast.table.model import FORMULATIONS

    grades = FORMULATIONS["lambdarank"].target(np.array([1.0, 0.95, 0.9, 0.8, 0.1]))
    assert list(grades) == [30, 20, 13, 5, 0]
    ranker = TableModel.fit(dataset, devices, rounds=ROUNDS, seed=0, threads=THREADS,
                            formulation="lambdarank")
    predicted = np.array(list(ranker.predict(PROBLEMS[2], "T4").values()))
    assert ((predicted > 0) & (predicted < 1)).all()
    efficiency = np.concatenate([pick_efficiency(ranker, dataset, d) for d in DEVICES])
    assert efficiency.mean() >= 0.9, efficiency


def test_a_device_left_out_is_answered_from_its_features(model_without_t4, dataset):
    assert "T4" not in model_without_t4.training_devices
    assert model_without_t4.failed_on("T4") == set()        # nothing known about it
    predicted = model_without_t4.predict(PROBLEMS[1], "T4")
    assert set(predicted) == set(model_without_t4.candidates())
    other = model_without_t4.predict(PROBLEMS[1], "A100-PCIE-40GB")
    common = sorted(set(predicted) & set(other))
    assert not np.allclose([predicted[k] for k in common], [other[k] for k in common])
    # better than a random candidate on T4 on average (one that fails there scores 0)
    frame = dataset.frame[dataset.frame["device"] == "T4"]
    random_mean = (frame.groupby("dims_key")["median_s"].transform("min") / frame["median_s"]
                   ).fillna(0.0).mean()
    assert pick_efficiency(model_without_t4, dataset, "T4").mean() > random_mean


def test_save_and_load_give_identical_predictions(model, tmp_path):
    files = model.save(tmp_path / "model")
    assert sorted(files) == ["candidates.json", "failures.json", "feature_spec.json",
                             "model.txt", "model_relative.txt", "reference.npz"]
    loaded = TableModel.load(tmp_path / "model")
    assert loaded.candidates() == model.candidates()
    assert loaded.failed_on("T4") == model.failed_on("T4")
    for device in ("T4", "MI250X", "H200"):                  # H200: from the shipped table
        assert loaded.predict(PROBLEMS[3], device) == model.predict(PROBLEMS[3], device)


def test_predict_many_matches_predict(model):
    predicted = model.predict(PROBLEMS[4], "RTX 3090")
    kernels = sorted(predicted)[:25]
    configs = model.candidate_configs().loc[kernels].reset_index(drop=True)
    rows = configs.assign(**PROBLEMS[4], device="NVIDIA GeForce RTX 3090")
    np.testing.assert_allclose(model.predict_many(rows), [predicted[k] for k in kernels],
                               rtol=1e-12)


def test_an_unknown_device_says_how_to_add_it(model):
    with pytest.raises(UnknownDeviceError, match="--devices FILE or set TILECAST_DEVICES"):
        model.predict(PROBLEMS[0], "Voodoo5 6000")


def test_a_dataset_device_missing_from_the_hardware_table_is_named(devices):
    rows = [dict(row, device="Voodoo5 6000") if row["device"] == "T4" else row
            for row in make_rows(devices=("T4", "V100-SXM2"), problems=PROBLEMS[:1])]
    dataset = TableDataset(frame=finish_frame(rows, SCHEMA), schema=SCHEMA)
    with pytest.raises(UnknownDeviceError, match="unknown device 'Voodoo5 6000'.*--devices"):
        TableModel.fit(dataset, devices, rounds=1)


def test_excluding_a_device_the_dataset_lacks_is_an_error(dataset, devices):
    with pytest.raises(TableDataError, match="'H200' is not a device of the dataset"):
        TableModel.fit(dataset, devices, exclude_devices=["H200"], rounds=1)


@pytest.mark.parametrize("problem, message", [
    ({"m": 1, "n": 2}, r"missing \['k'\]"),
    ({"m": 1, "n": 2, "k": 3, "batch": 4}, r"unknown \['batch'\]"),
    ({"m": "big", "n": 2, "k": 3}, "m='big' is not a finite number"),
    ({"m": float("nan"), "n": 2, "k": 3}, "is not a finite number"),
])
def test_bad_problems_are_named(model, problem, message):
    with pytest.raises(TableDataError, match=message):
        model.predict(problem, "T4")


def test_the_prediction_is_the_mean_of_the_members_and_the_prior(model_without_t4):
    from tilecast.table.model import MEMBERS, PRIOR
    from tilecast.table.reference import NAMES

    model = model_without_t4
    kernels = model.allowed("T4")[:40]
    configs = model.candidate_configs().loc[kernels]
    problems = pd.DataFrame([PROBLEMS[2]])
    X = np.hstack([model.features.grid(problems, configs, "T4"),
                   model.reference.grid("T4", model.devices.features("T4"), problems, kernels,
                                        model.schema)[0]])
    prior = X[:, len(model.features.names) + NAMES.index(PRIOR)]
    assert np.isfinite(prior).all()           # T4's neighbours measured every one of these
    members = [model.boosters[m].predict(X, num_threads=1) for m in MEMBERS]
    np.testing.assert_allclose(model.scores(PROBLEMS[2], "T4", kernels),
                               (sum(members) + prior) / (len(members) + 1), rtol=1e-6)
    # where the prior is not defined, the members alone (which read it as missing too)
    X[:, len(model.features.names) + NAMES.index(PRIOR)] = np.nan
    members = [model.boosters[m].predict(X, num_threads=1) for m in MEMBERS]
    np.testing.assert_allclose(model._predict(X), sum(members) / len(members), rtol=1e-6)


def test_the_relative_member_never_splits_on_a_device_feature(model):
    from tilecast.table.features import DEVICE_PREFIX

    names = model.names
    device = [i for i, n in enumerate(names) if n.startswith(DEVICE_PREFIX)]
    assert device
    relative = model.boosters["relative"].feature_importance("split")
    hardware = model.boosters["hardware"].feature_importance("split")
    assert relative[device].sum() == 0
    assert hardware[device].sum() > 0         # the other member does use them
