"""`tilecast export` of table models: a model trained on real PyTorch AutoHeuristic
measurements (/work/shared/data: H100 mm and part of A100 mm, 2 devices, categorical problem
columns, structured choice names) and one on the synthetic 5-device dataset of
test_table_model (numeric configuration columns: fit features and ideal gaps), exported per
device, compiled with gcc alone and checked against TableDispatcher.select."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from test_table_model import SCHEMA, make_dataset, make_rows, write_test_dataset
from tilecast.cli import main
from tilecast.runtime import export
from tilecast.runtime.export import table, table_c, table_forest
from tilecast.table.confidence import Calibration, Calibrations
from tilecast.table.dataset import (Column, TableDataset, TableSchema, finish_frame,
                                    read_dataset)
from tilecast.table.devices import DeviceTable
from tilecast.table.dispatch import TableDispatcher, TableRanking
from tilecast.table.importing import import_files
from tilecast.table.model import TableModel

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "autoheuristic"
#: the files and how many of their lines the model learns from (all of H100's 322 problems,
#: A100's first 334: training stays ~15 s on 2 cores)
FILES = {"H100-SXM5-80GB": ("h100_mm.zip", "h100/h100_mm.txt", None),
         "A100-SXM4-80GB": ("a100_mm.zip", "a100/a100_mm.txt", 30_000)}
PROBLEMS = 10_000
DIRECT = 50          # problems also answered one by one by TableDispatcher.select
DRIVER = r"""#include <stdio.h>
#include <stdlib.h>
#include "HEADER"

/* problems (the selector's ARGS arguments; codes as numbers) on stdin -> one index a line */
int main(void) {
  double v[ARGS];
  char word[64];
  int i;
  for (;;) {
    for (i = 0; i < ARGS; ++i) {
      if (scanf("%63s", word) != 1) return 0;
      v[i] = strtod(word, NULL);
    }
    printf("%d\n", PREFIX_select(CALL));
  }
}
"""


def calibrations(margin: float) -> Calibrations:
    """A calibration for both cases with the incumbent guard's `margin` (0: no guard)."""
    one = Calibration(slacks=(0.0,), probabilities=(0.5,), threshold=math.inf, margin=margin)
    return Calibrations(new_device=one, known_device=one)


@pytest.fixture(scope="module")
def autoheuristic(tmp_path_factory):
    """The dataset imported by `tilecast import` and a model fitted on it (30 rounds)."""
    if not DATA.is_dir():
        pytest.skip(f"needs the AutoHeuristic data in {DATA}")
    root = tmp_path_factory.mktemp("autoheuristic")
    for device, (archive, member, lines) in FILES.items():
        with zipfile.ZipFile(DATA / archive) as z:
            text = z.read(member).decode()
        if lines is not None:
            text = "\n".join(text.split("\n")[:lines]) + "\n"
        path = root / "raw" / Path(member).name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        import_files("autoheuristic", [path], root / "dataset", device=device)
    dataset = read_dataset(root / "dataset")
    model = TableModel.fit(dataset, DeviceTable.load(), rounds=30, threads=2)
    return dataset, model


@pytest.fixture(scope="module")
def synthetic():
    return TableModel.fit(make_dataset(), DeviceTable.load(), rounds=40, threads=1)


def compile_driver(selector, directory: Path) -> Path:
    export.write(selector, directory, "c")
    stem = table_c.file_stem(selector)
    call = ", ".join(f"v[{i}]" if item["kind"] == "numeric" else f"(int)v[{i}]"
                     for i, item in enumerate(selector.inputs))
    (directory / "driver.c").write_text(
        DRIVER.replace("HEADER", f"{stem}.h").replace("ARGS", str(len(selector.inputs)))
        .replace("PREFIX_", f"{stem}_").replace("CALL", call))
    binary = directory / "driver"
    subprocess.run(["gcc", "-std=c99", "-O2", "-I", str(directory), str(directory / "driver.c"),
                    str(directory / f"{stem}.c"), "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)
    return binary


def run_driver(binary: Path, selector, problems: list[dict]) -> list[int]:
    lines = []
    for problem in problems:
        words = []
        for item in selector.inputs:
            value = problem.get(item["name"])
            if item["kind"] == "numeric":
                words.append(repr(math.nan if value is None else float(value)))
            else:
                known = item["categories"]
                value = "" if value is None and item["partial"] else value
                words.append(str(known.index(value) if value in known else -1))
        lines.append(" ".join(words))
    proc = subprocess.run([str(binary)], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, check=True)
    return [int(word) for word in proc.stdout.split()]


def expected(dispatcher: TableDispatcher, problems: list[dict], device: str) -> list[str]:
    """TableDispatcher.ranking(problem, device).best for many problems at once: the same
    feature matrix, reference features, scores and TableRanking, built per 500 problems
    (the tests check it against select itself on a sample)."""
    model = dispatcher.table_model
    name, device_table = dispatcher.device(device)
    kernels = model.allowed(name)
    configs = model.candidate_configs().loc[kernels]
    trained = name in model.training_devices
    calibration = dispatcher.calibrations.for_device(trained)
    frame = pd.DataFrame([dispatcher.problem(p) for p in problems],
                         columns=list(model.schema.problem_names))
    vector = device_table.features(name)
    answers = []
    for start in range(0, len(frame), 500):
        chunk = frame.iloc[start:start + 500].reset_index(drop=True)
        features = model.features.grid(chunk, configs, name, device_table)
        reference = model.reference.grid(name, vector, chunk, kernels, model.schema)
        scores = model._predict(np.hstack([features, reference.reshape(len(features), -1)]))
        measured = model.reference.measured(name, chunk, model.schema)
        for row, was_measured in zip(scores.reshape(len(chunk), len(kernels)), measured):
            incumbent = model.incumbent
            if (incumbent is not None and trained and calibration is not None
                    and calibration.margin > 0 and was_measured):
                incumbent = None
            answers.append(TableRanking(name, kernels, row, calibration, (), incumbent).best)
    return answers


def sample_problems(dataset, model, count: int, seed: int) -> list[dict]:
    """The measured problems, then perturbed ones: numeric columns scaled within the measured
    range (x0.5..x2), far outside it (2**-12..2**12), some zero or negative; each categorical
    column any of the model's values or one it never saw."""
    rng = np.random.default_rng(seed)
    schema = model.schema
    measured = dataset.frame.drop_duplicates("dims_key")[list(schema.problem_names)]
    problems = measured.to_dict("records")
    base = list(problems)
    while len(problems) < count:
        problem = dict(base[rng.integers(len(base))])
        for column in schema.problem:
            if column.kind == "numeric":
                draw = rng.random()
                scale = (rng.uniform(0.5, 2.0) if draw < 0.5 else
                         2.0 ** rng.uniform(-12, 12) if draw < 0.8 else 1.0)
                value = float(round(problem[column.name] * scale))
                problem[column.name] = (value if rng.random() > 0.02 else
                                        float(rng.choice([0.0, -value, -1.0])))
            elif rng.random() < 0.3:
                values = model.features.categories_[column.name] + ["never-seen"]
                problem[column.name] = values[rng.integers(len(values))]
        problems.append(problem)
    return problems[:count]


def agreement(model, dataset_or_problems, device: str, margin: float, tmp_path: Path,
              count: int = PROBLEMS):
    """(C answers, expected answers, the dispatcher, problems) on `count` problems."""
    dispatcher = TableDispatcher(model, calibrations(margin), model="mm", version=1)
    selector = table.build(dispatcher, device)
    binary = compile_driver(selector, tmp_path)
    problems = (dataset_or_problems if isinstance(dataset_or_problems, list)
                else sample_problems(dataset_or_problems, model, count,
                                     seed=sum(map(ord, device))))
    got = run_driver(binary, selector, problems)
    want = [selector.kernels.index(k) for k in expected(dispatcher, problems, device)]
    return got, want, dispatcher, problems, selector


@pytest.mark.parametrize("device,margin", [("H100-SXM5-80GB", 0.0), ("A100-SXM4-80GB", 0.02),
                                           ("A100-PCIE-40GB", 0.0)])
def test_the_compiled_selector_picks_what_select_picks_on_10000_problems(
        autoheuristic, tmp_path, device, margin):
    """Both training devices (one without the guard, one with it, measured problems exempt)
    and a device the model never saw, answered from its features."""
    dataset, model = autoheuristic
    got, want, dispatcher, problems, selector = agreement(model, dataset, device, margin,
                                                          tmp_path)
    direct = [selector.kernels.index(dispatcher.select(p, device=device))
              for p in problems[::len(problems) // DIRECT]]
    assert direct == want[::len(problems) // DIRECT]
    wrong = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not wrong, (f"{len(wrong)} of {len(problems)} differ, e.g. {problems[wrong[0]]}: "
                       f"C {got[wrong[0]]}, select {want[wrong[0]]}")
    assert len(set(want)) >= 5        # the forests decide, not only the incumbent


def test_the_synthetic_model_with_ideal_gaps_and_fit_features_agrees(synthetic, tmp_path):
    """Numeric configuration columns (fit features, ref:gap), four reference devices."""
    rng = np.random.default_rng(3)
    problems = [{"m": float(m), "n": float(n), "k": float(k)}
                for m, n, k in rng.integers(1, 5000, size=(2000, 3))]
    problems += [{"m": 64.0, "n": 64.0, "k": 512.0}, {"m": 0.0, "n": -3.0, "k": 7.0}]
    for device, margin in (("T4", 0.0), ("MI250X", 0.05), ("H100-SXM5-80GB", 0.0)):
        got, want, dispatcher, _, selector = agreement(synthetic, problems, device, margin,
                                                       tmp_path / device)
        assert selector.reference.get("ideal_values"), "the gaps are live"
        assert got == want, device
        assert [selector.kernels.index(dispatcher.select(p, device=device))
                for p in problems[:50]] == want[:50]


def test_partial_columns_left_out_agree(tmp_path):
    """Columns some devices' data lack (AutoHeuristic files that log one more feature):
    missing in training and in queries (NaN, "" when categorical), with measured values of
    the others. Their names are the C source's own ("c", "code"): the arguments are renamed."""
    schema = TableSchema(problem=SCHEMA.problem + (Column("c", "numeric", partial=True),
                                                   Column("code", "categorical", partial=True)),
                         config=SCHEMA.config)
    rows = make_rows(devices=("A100-PCIE-40GB", "T4", "MI250X"))
    for number, row in enumerate(rows):
        if row["device"] != "T4":
            row.update(c=float(1 + number % 3), code=("fwd", "bwd")[number % 2])
    model = TableModel.fit(TableDataset(frame=finish_frame(rows, schema), schema=schema),
                           DeviceTable.load(), rounds=30, threads=1)
    rng = np.random.default_rng(5)
    problems = []
    for m, n, k in rng.integers(1, 4000, size=(1500, 3)):
        problem = {"m": float(m), "n": float(n), "k": float(k)}
        if rng.random() < 0.6:
            problem["c"] = float(rng.choice([1.0, 2.0, 3.0, 7.0]))
        if rng.random() < 0.6:
            problem["code"] = str(rng.choice(["fwd", "bwd", "other"]))
        problems.append(problem)
    problems.append({"m": 64.0, "n": 64.0, "k": 512.0})
    for device in ("T4", "MI250X"):
        got, want, dispatcher, _, selector = agreement(model, problems, device, 0.0,
                                                       tmp_path / device)
        assert [item["partial"] for item in selector.inputs] == [False] * 3 + [True] * 2
        assert table_c.argument_names(selector) == ["m", "n", "k", "c_arg", "code_arg"]
        assert got == want, device
        assert [selector.kernels.index(dispatcher.select(p, device=device))
                for p in problems[:40]] == want[:40]


def test_refusals_and_bad_input_are_one_line(autoheuristic, synthetic, tmp_path):
    dataset, model = autoheuristic
    dispatcher = TableDispatcher(model, calibrations(0.0), model="mm", version=1)
    with pytest.raises(export.ExportError) as info:
        table.build(dispatcher, "no-such-gpu")
    assert str(info.value) == (
        "version 1 of table model 'mm' knows no device 'no-such-gpu': name one of its training "
        "devices (A100-SXM4-80GB, H100-SXM5-80GB) or another device of its stored entries "
        f"({len(model.devices.names())}) or the hardware tables (tilecast.table.devices)")
    with pytest.raises(export.ExportError, match=r"trained on 2 devices \(A100-SXM4-80GB, "
                                                 r"H100-SXM5-80GB\); name the one"):
        table.build(dispatcher, None)
    selector = table.build(dispatcher, "H100-SXM5-80GB")
    binary = compile_driver(selector, tmp_path)
    good = dataset.frame.iloc[0][list(model.schema.problem_names)].to_dict()
    numeric = next(i["name"] for i in selector.inputs if i["kind"] == "numeric")
    bad = [{**good, numeric: math.inf}, {**good, numeric: math.nan}]
    assert run_driver(binary, selector, bad) == [table.INVALID_PROBLEM] * 2
    assert run_driver(binary, selector, [good])[0] in selector.allowed


def test_the_json_form_round_trips_to_the_same_c(autoheuristic):
    _, model = autoheuristic
    dispatcher = TableDispatcher(model, calibrations(0.02), model="mm", version=1)
    selector = table.build(dispatcher, "A100-SXM4-80GB")
    files = export.render(selector, "json")
    document = json.loads(files[f"{table_c.file_stem(selector)}.json"])
    assert document["format"] == table.FORMAT and document["device"] == "A100-SXM4-80GB"
    # the real data's categorical columns make categorical splits, which the C must decide
    assert any(flags & table_forest.CATEGORICAL for forest in selector.forests
               for flags in forest.flags)
    again = export.TableSelector.from_json(document)
    assert export.render(again, "c") == export.render(selector, "c")


def test_the_source_is_c99_and_warning_free(synthetic, tmp_path):
    dispatcher = TableDispatcher(synthetic, calibrations(0.05), model="mm", version=1)
    paths = export.write(table.build(dispatcher, "T4"), tmp_path, "c")
    source = [str(p) for p in paths if p.suffix == ".c"][0]
    subprocess.run(["gcc", "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-c", source,
                    "-o", str(tmp_path / "t4.o")], check=True, capture_output=True, text=True)


def test_export_command_writes_a_device_selector(tmp_path, capsys):
    """Trained and published by the commands; --device picks the device, and a model of
    several devices without it is one line naming them."""
    dataset = write_test_dataset(tmp_path / "dataset")
    assert main(["train", "--dataset", str(dataset), "--workdir", str(tmp_path / "work"),
                 "--rounds", "10", "--threads", "1"]) == 0
    assert main(["publish", "--workdir", str(tmp_path / "work"), "--registry",
                 str(tmp_path / "registry"), "--model", "mm"]) == 0
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["export", "--registry", str(tmp_path / "registry"), "--model", "mm",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tilecast export: error: version 1 of table model 'mm' was trained "
                          "on 5 devices (") and "--device" in err and "\n" not in err
    assert not out.exists() or not list(out.iterdir())
    assert main(["export", "--registry", str(tmp_path / "registry"), "--model", "mm",
                 "--out", str(out), "--device", "t4"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tilecast_mm_t4.c", "tilecast_mm_t4.h"]
    assert main(["export", "--registry", str(tmp_path / "registry"), "--model", "mm",
                 "--out", str(out), "--device", "T4", "--shortlist", "3"]) == 2
    assert "has no shortlist" in capsys.readouterr().err
