"""Tests for tilecast.table.reference: other devices' measured efficiencies as features, each
device left out of its own, a new problem answered from its nearest measured one."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from tilecast.core.artifact import ModelArtifactError
from tilecast.table.dataset import Column, TableDataError, TableDataset, TableSchema, finish_frame
from tilecast.table.devices import DeviceTable
from tilecast.table.model import TableModel, training_rows
from tilecast.table.reference import NAMES, Reference, new_problem_mask, rows_features

SCHEMA = TableSchema(problem=(Column("m", "numeric"), Column("n", "numeric")),
                     config=(Column("tile", "numeric"),))
DEVICES = ("V100-SXM2", "A100-SXM4-80GB", "H100-SXM5-80GB")
#: seconds per (device, problem m, tile); None: failed there
TIMES = {
    ("V100-SXM2", 64): {16: 1.0, 32: 2.0, 64: 4.0},
    ("V100-SXM2", 4096): {16: 4.0, 32: 2.0, 64: 1.0},
    ("A100-SXM4-80GB", 64): {16: 1.0, 32: 1.25, 64: None},
    ("A100-SXM4-80GB", 4096): {16: 2.0, 32: 1.0, 64: 1.0},
    ("H100-SXM5-80GB", 64): {16: 2.0, 32: 1.0, 64: 4.0},
    ("H100-SXM5-80GB", 4096): {16: 8.0, 32: 2.0, 64: 1.0},
}


def column(name: str) -> int:
    return NAMES.index(name)


@pytest.fixture(scope="module")
def devices() -> DeviceTable:
    return DeviceTable.load()


@pytest.fixture(scope="module")
def dataset() -> TableDataset:
    rows = [{"device": device, "m": m, "n": 128, "tile": tile,
             "status": "ok" if seconds is not None else "build_failed",
             "median_s": seconds if seconds is not None else math.nan}
            for (device, m), times in TIMES.items() for tile, seconds in times.items()]
    return TableDataset(frame=finish_frame(rows, SCHEMA), schema=SCHEMA)


@pytest.fixture(scope="module")
def reference(dataset, devices) -> Reference:
    rows = training_rows(dataset, devices)
    return Reference.build(rows.all_ok, rows.all_efficiency, rows.failed, SCHEMA, devices,
                           rows.candidates)


def grid(reference, devices, device, problems, kernels=("tile=16", "tile=32", "tile=64"),
         new=None):
    frame = pd.DataFrame(problems, columns=["m", "n"])
    return reference.grid(device, devices.features(device), frame, list(kernels), SCHEMA,
                          new_problem=None if new is None else np.array(new))


def test_a_device_sees_the_others_never_itself(reference, devices):
    out = grid(reference, devices, "A100-SXM4-80GB", [(64, 128)])[0]     # (kernels, NAMES)
    # tile=16 on m=64: V100 1.0 (its best), H100 1/2; tile=64: V100 1/4, H100 1/4
    np.testing.assert_allclose(out[:, column("ref:mean")], [0.75, 0.75, 0.25])
    np.testing.assert_allclose(out[:, column("ref:max")], [1.0, 1.0, 0.25])
    np.testing.assert_allclose(out[:, column("ref:min")], [0.5, 0.5, 0.25])
    np.testing.assert_array_equal(out[:, column("ref:devices")], [2, 2, 2])
    nearer = min(("V100-SXM2", "H100-SXM5-80GB"),
                 key=lambda d: devices.distance("A100-SXM4-80GB", d))
    expected_near = {"V100-SXM2": [1.0, 0.5, 0.25], "H100-SXM5-80GB": [0.5, 1.0, 0.25]}[nearer]
    np.testing.assert_allclose(out[:, column("ref:near")], expected_near)
    assert out[0, column("ref:near_distance")] == pytest.approx(
        devices.distance("A100-SXM4-80GB", nearer))
    assert np.all(out[:, column("ref:problem_distance")] == 0.0)
    # weighted mean: 1 / (1 + distance)^2 per device
    wv, wh = (1.0 / (1.0 + devices.distance("A100-SXM4-80GB", d)) ** 2
              for d in ("V100-SXM2", "H100-SXM5-80GB"))
    assert out[0, column("ref:wmean")] == pytest.approx((wv * 1.0 + wh * 0.5) / (wv + wh),
                                                        rel=1e-5)


def test_a_failure_counts_as_zero_and_ranks_are_per_group(reference, devices):
    out = grid(reference, devices, "V100-SXM2", [(64, 128)])[0]
    # tile=64 on m=64 failed on A100 (0.0) and ran at 1/4 on H100
    assert out[2, column("ref:min")] == 0.0
    assert out[2, column("ref:max")] == 0.25
    # ranks: A100 puts 16 best (1), 32 next (0.5), the failure last (0); H100: 32, 16, 64
    np.testing.assert_allclose(out[:, column("ref:rank")], [0.75, 0.75, 0.0])


def test_a_new_device_sees_every_training_device(reference, devices):
    out = grid(reference, devices, "T4", [(4096, 128)])[0]
    np.testing.assert_array_equal(out[:, column("ref:devices")], [3, 3, 3])
    np.testing.assert_allclose(out[:, column("ref:max")], [0.5, 1.0, 1.0])


def test_a_new_problem_is_answered_from_the_nearest_measured_one(reference, devices):
    out = grid(reference, devices, "T4", [(3000, 128), (100, 128)])
    assert np.all(out[:, :, column("ref:problem_distance")] > 0)
    measured = grid(reference, devices, "T4", [(4096, 128), (64, 128)])
    np.testing.assert_array_equal(out[:, :, :column("ref:near_distance")],
                                  measured[:, :, :column("ref:near_distance")])


def test_training_augmentation_moves_a_problem_to_its_neighbour(reference, devices):
    out = grid(reference, devices, "T4", [(64, 128), (64, 128)], new=[False, True])
    assert out[0, 0, column("ref:problem_distance")] == 0.0
    assert out[1, 0, column("ref:problem_distance")] > 0.0
    other = grid(reference, devices, "T4", [(4096, 128)])[0]
    np.testing.assert_array_equal(out[1, :, :column("ref:near_distance")],
                                  other[:, :column("ref:near_distance")])


def test_unknown_kernels_and_lone_devices_are_missing(reference, devices):
    out = grid(reference, devices, "T4", [(64, 128)], kernels=("tile=16", "tile=8"))[0]
    assert np.isfinite(out[0, column("ref:mean")])
    assert np.isnan(out[1, column("ref:mean")]) and out[1, column("ref:devices")] == 0
    lone = Reference(devices=["T4"], device_vectors=devices.features("T4")[None],
                     scale=devices.scale, kernels=["tile=16"],
                     problem_values=np.zeros((1, 2)), problem_labels=np.empty((1, 0), str),
                     efficiency=np.ones((1, 1, 1), np.float32))
    alone = grid(lone, devices, "T4", [(64, 128)], kernels=("tile=16",))[0]
    assert alone[0, column("ref:devices")] == 0 and np.isnan(alone[0, column("ref:mean")])


def test_rows_features_match_the_grid(reference, devices, dataset):
    frame = dataset.frame
    vectors = {d: devices.features(d) for d in DEVICES}
    rows = rows_features(reference, frame, SCHEMA, vectors)
    for position in (0, 4, 11):
        row = frame.iloc[position]
        expected = grid(reference, devices, row["device"], [(row["m"], row["n"])],
                        kernels=(row["kernel"],))[0, 0]
        np.testing.assert_allclose(rows[position], expected, rtol=1e-6)


def test_the_augmentation_mask_is_per_group_and_seeded():
    devices = ["a"] * 40 + ["b"] * 40
    keys = [f"p{i % 20}" for i in range(80)]
    mask = new_problem_mask(devices, keys, seed=3)
    frame = pd.DataFrame({"d": devices, "k": keys, "mask": mask})
    assert frame.groupby(["d", "k"])["mask"].nunique().max() == 1      # whole groups
    assert 0 < mask.mean() < 1
    np.testing.assert_array_equal(mask, new_problem_mask(devices, keys, seed=3))


def test_bytes_round_trip_and_damage(reference):
    again = Reference.from_bytes(reference.to_bytes())
    assert again.devices == reference.devices and again.kernels == reference.kernels
    np.testing.assert_array_equal(again.efficiency, reference.efficiency)
    with pytest.raises(TableDataError, match="is damaged"):
        Reference.from_bytes(reference.to_bytes()[:100])


def test_a_model_keeps_its_reference_and_refuses_without_it(dataset, devices, tmp_path):
    model = TableModel.fit(dataset, devices, rounds=5, threads=1)
    assert model.booster.num_feature() == len(model.features.names) + len(NAMES)
    files = model.save(tmp_path / "m")
    loaded = TableModel.load(tmp_path / "m")
    assert loaded.predict({"m": 64, "n": 128}, "T4") == model.predict({"m": 64, "n": 128}, "T4")
    files["reference.npz"].unlink()
    with pytest.raises(ModelArtifactError, match="has no reference.npz"):
        TableModel.load(tmp_path / "m")


def test_beyond_is_further_from_the_references_than_any_of_them_lies_from_the_rest():
    from tilecast.table.devices import DeviceTable

    names = list(DeviceTable.FEATURE_NAMES)
    bandwidth, vendor = names.index("log2_bandwidth_gbs"), names.index("vendor_code")
    base = np.zeros(len(names))
    vectors = np.stack([base] * 3)
    vectors[:, bandwidth] = [9.0, 10.0, 12.0]   # c lies 2.0 from its nearest: reach 2

    def reference_of(rows):
        return Reference(devices=["a", "b", "c"][:len(rows)], device_vectors=rows,
                         scale=np.ones(len(names)), kernels=["tile=16"],
                         problem_values=np.zeros((1, 2)), problem_labels=np.empty((1, 0), str),
                         efficiency=np.ones((len(rows), 1, 1), np.float32))

    reference = reference_of(vectors)
    assert reference.reach() == 2.0
    probe = base.copy()
    for value, beyond in ((13.9, []), (7.1, []), (11.0, []),
                          (14.1, ["log2_bandwidth_gbs"]), (6.9, ["log2_bandwidth_gbs"])):
        probe[bandwidth] = value
        assert reference.beyond("new", probe) == beyond, value
    # a reference device is judged as if held out: against a and b alone (reach 1.0), c lies
    # 2.0 out; b lies between them, 1.0 from a
    assert reference.beyond("c", vectors[2]) == ["log2_bandwidth_gbs"]
    assert reference.beyond("b", vectors[1]) == []
    probe[bandwidth], probe[vendor] = 10.0, 1.0      # a vendor none of them has
    assert reference.beyond("new", probe) == ["vendor_code"]
    # one other device: nothing was ever held out, every difference is beyond
    probe[vendor], probe[bandwidth] = 0.0, 9.5
    assert reference_of(vectors[:1]).beyond("new", probe) == ["log2_bandwidth_gbs"]
    assert reference_of(vectors[:1]).beyond("new", vectors[0]) == []
