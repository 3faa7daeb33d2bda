"""The CLI's error boundary, through the real console script (tests/faults.py's `cli`): every
mistake a user can make on the command line (a malformed problem, a missing, unreadable,
binary or empty file, a directory given as a file, an unknown model or alias, a read-only
registry, a config the schema refuses) ends in one line `tilecast <command>: error: ...`
naming what was wrong, and exit status 2; each case is counted in the fault ledger.

Nothing here compiles or measures a kernel: one tiny model is trained on synthetic targets
and published once for the module, and every command fails before any build."""
from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import lightgbm
import numpy as np
import pytest

from faults import REPO_ROOT, cli, expect_clear, run_cli
from tilecast.families import get_family
from tilecast.registry import api as registry

GEMM = get_family("gemm")
TINY = REPO_ROOT / "tests" / "configs" / "tiny.yaml"
HARDWARE = {"threads": 2, "simd_bits": 256, "l1d_bytes": 32 << 10, "l2_bytes": 1 << 20,
            "l3_bytes": 16 << 20, "clock_mhz": 3000.0, "flags": ["avx2", "fma"]}
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8,
           "min_efficiency": 0.7, "static_best": {"kernel": "?", "mean_efficiency": 0.8}}
BINARY = bytes(range(256)) * 4          # NUL bytes and invalid UTF-8
LATIN1 = "m: 64  # größe\n".encode("latin-1")   # text, but not UTF-8


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """A registry holding model 'gemm' (fp32 AVX2 candidates only, alias production -> 1)."""
    root = tmp_path_factory.mktemp("registry")
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space({"dtype": ["fp32"], "isa": ["avx2"], "tiles": ["6x16", "8x8"],
                                    "parallel": ["m", "n"]}, HARDWARE)
    names = [GEMM.kernel_name(c) for c in configs]
    features = np.vstack([engine.matrix(GEMM.problem({"m": m, "n": n, "k": k}), configs)
                          for m, n, k in itertools.product((8, 96, 1024), repeat=3)])
    target = np.log1p(features[:, engine.feature_names().index("mr")] / 8.0)
    booster = lightgbm.train({"objective": "regression", "min_data_in_leaf": 2, "verbose": -1,
                              "num_threads": 1, "seed": 0},
                             lightgbm.Dataset(features, target), num_boost_round=3)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": engine.name,
            "engine_version": engine.version, "target_transform": "log1p_tflops",
            "hardware": HARDWARE}
    registry.publish(root, "gemm", {
        "model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
        "candidates.json": json.dumps({"family": "gemm", "kernels": names,
                                       "static_best": names[0]}),
        "train_manifest.json": "{}"}, metrics=METRICS)
    assert registry.read_alias(root, "gemm", "production") == 1
    return root


def _copy(published: Path, tmp_path: Path) -> Path:
    """A registry of the test's own, to damage."""
    return Path(shutil.copytree(published, tmp_path / "registry"))


def _file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _unprivileged(*args: str) -> subprocess.CompletedProcess:
    """`tilecast ARGS` as a process that file permissions apply to: as root, without the
    capabilities that override them (capsh); the results read as run_cli's."""
    code = "import sys; from tilecast.flows.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", code, *map(str, args)]
    if os.geteuid() == 0:
        if shutil.which("capsh") is None:
            pytest.skip("running as root without capsh: file permissions cannot be enforced")
        command = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c",
                   shlex.join(command)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DO_NOT_TRACK": "1"}
    return subprocess.run(command, env=env, capture_output=True, timeout=120)


# -- select: the problem string ----------------------------------------------------------------

@pytest.mark.parametrize(("problem", "needles"), [
    ("m", ("malformed pair 'm'", "m=512,n=512,k=512")),
    ("", ("empty problem string ''",)),
    (",", ("empty problem string ','",)),
    ("m=1,n=2,k=3,m=4", ("field 'm' given twice", "m=1 and m=4")),
    (f"m={2**63},n=8,k=8", (f"m={2**63}", "too large")),
    (f"m=8,n=8,k={10**40}", (f"k={10**40}", "too large")),
    ("m=127.9,n=8,k=8", ("m='127.9'", "not an integer")),
    ("m=1e3,n=8,k=8", ("m='1e3'", "digits", "m=1000")),
    ("m=-5,n=8,k=8", ("m=-5", ">= 1")),
])
def test_a_malformed_problem_is_named(published, problem, needles):
    cli("select", "--registry", published, "--model", "gemm", "--problem", problem,
        needles=needles)


def test_a_problem_no_kernel_of_the_model_runs_is_an_error_not_a_kernel(published):
    message = cli("select", "--registry", published, "--model", "gemm", "--json",
                  "--problem", "m=64,n=64,k=64,dtype=bf16",
                  needles=("dtype=bf16", "nor its static best", "kernel dtype fp32 != problem "
                                                                "dtype bf16"))
    assert message.startswith("tilecast select: error: no kernel of model 'gemm' version 1")
    chosen = run_cli("select", "--registry", published, "--model", "gemm",
                     "--problem", "m=64,n=64,k=64")
    assert chosen.returncode == 0 and chosen.stdout.decode().startswith("gemm_fp32_avx2_")


# -- select and registry: models, aliases, registries -------------------------------------------

@pytest.mark.parametrize(("args", "needles"), [
    (("select", "--model", "nosuch", "--problem", "m=8,n=8,k=8"), ("nosuch",)),
    (("select", "--model", "gemm", "--alias", "staging", "--problem", "m=8,n=8,k=8"),
     ("no alias 'staging'",)),
    (("select", "--model", "gemm", "--alias", "../gemm", "--problem", "m=8,n=8,k=8"),
     ("'../gemm'",)),
    (("select", "--model", "gemm", "--alias", "7", "--problem", "m=8,n=8,k=8"),
     ("no version 7",)),
    (("registry", "show", "nosuch"), ("nosuch",)),
    (("registry", "promote", "gemm"), ("registry promote needs VERSION",)),
    (("registry", "promote", "gemm", "abc"), ("'abc'",)),
    (("registry", "promote", "gemm", "9"), ("no version 9",)),
    (("registry", "rollback", "gemm", "--alias", "staging"), ("staging",)),
])
def test_unknown_models_aliases_and_versions_are_named(published, args, needles):
    cli(*args, "--registry", published, needles=needles)


def test_a_registry_that_is_missing_or_a_file_is_named(tmp_path):
    missing, afile = tmp_path / "nowhere", _file(tmp_path / "registry.txt", b"not a registry\n")
    cli("select", "--registry", missing, "--model", "gemm", "--problem", "m=8,n=8,k=8",
        needles=(f"registry {missing} does not exist",))
    cli("registry", "list", "--registry", afile, needles=(f"registry {afile} is a file",))
    cli("registry", "list", "--registry", "nosuch://bucket/reg", needles=("nosuch://bucket/reg",))


def test_a_non_utf8_alias_file_is_named(published, tmp_path):
    root = _copy(published, tmp_path)
    alias = root / "gemm" / "aliases" / "production"
    assert alias.is_file(), "the registry's alias layout changed; update this test"
    alias.write_bytes(b"\xff\xfe1\n")
    cli("select", "--registry", root, "--model", "gemm", "--problem", "m=8,n=8,k=8",
        needles=("production",))
    cli("registry", "show", "gemm", "--registry", root, needles=("production",))


def test_a_read_only_registry_is_named_and_left_as_it_was(published, tmp_path):
    root = _copy(published, tmp_path)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for path in [root, *root.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        expect_clear(_unprivileged("registry", "promote", "gemm", "1", "--registry", root),
                     str(root), "Permission denied")
        expect_clear(_unprivileged("registry", "rollback", "gemm", "--registry", root))
    finally:
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


# -- convert: the input files -------------------------------------------------------------------

def test_convert_names_a_bad_input_file(tmp_path):
    out = tmp_path / "out.parquet"
    cases = [(tmp_path / "missing.jsonl", ("does not exist",)),
             (tmp_path, ("is a directory",)),
             (_file(tmp_path / "garbage.jsonl", BINARY), ("garbage.jsonl", "binary file")),
             (_file(tmp_path / "latin1.jsonl", LATIN1), ("latin1.jsonl", "not UTF-8",
                                                         "byte 0xf6")),
             (_file(tmp_path / "empty.jsonl", b""), ("empty.jsonl",))]
    for path, needles in cases:
        cli("convert", path, "--out", out, needles=needles)
    cli("convert", "--from", "ck-csv", tmp_path / "garbage.jsonl", "--out", out,
        needles=("garbage.jsonl", "binary file"))
    cli("convert", _file(tmp_path / "ok.jsonl", b"{}\n"), "--out", tmp_path,
        needles=("--out", "is a directory"))
    assert not out.exists()


def test_convert_names_an_unreadable_input(tmp_path):
    path = _file(tmp_path / "secret.jsonl", b"{}\n")
    path.chmod(0o000)
    try:
        expect_clear(_unprivileged("convert", path, "--out", tmp_path / "out.parquet"),
                     "secret.jsonl", "permission denied")
    finally:
        path.chmod(0o644)


# -- evaluate, rebench, repeatability, run: configs, problems files, workdirs --------------------

def test_evaluate_names_a_bad_problems_file_or_config(published, tmp_path):
    base = ("evaluate", "--registry", published, "--model", "gemm", "--workdir", tmp_path / "w")
    for path, needles in [(tmp_path / "missing.yaml", ("problems file", "does not exist")),
                          (tmp_path, ("problems file", "is a directory")),
                          (_file(tmp_path / "bin.yaml", BINARY), ("bin.yaml", "binary file")),
                          (_file(tmp_path / "empty.yaml", b""), ("empty.yaml", "'problems'")),
                          (_file(tmp_path / "bad.yaml",
                                 b"problems: [{list: [{m: 8, n: x, k: 8}]}]\n"),
                           ("bad.yaml", "problems[0].list[0].n", "got 'x'"))]:
        cli(*base, "--problems", path, needles=needles)
    problems = _file(tmp_path / "ok.yaml", b"problems: [{list: [{m: 8, n: 8, k: 8}]}]\n")
    cli(*base, "--problems", problems, "--config", _file(tmp_path / "l1.yaml", LATIN1),
        needles=("config", "l1.yaml", "not UTF-8"))
    cli(*base[:-1], _file(tmp_path / "wfile", b"x"), "--problems", problems,
        needles=("workdir", "is a file"))
    assert not (tmp_path / "w").exists()


def test_read_problems_names_a_file_it_cannot_read(tmp_path):
    """The library function behind `evaluate --problems`, for callers without the CLI's checks."""
    from tilecast.config import ConfigError
    from tilecast.workflows.user_eval import read_problems

    for path, message in [(tmp_path / "missing.yaml", "problems file {path} does not exist"),
                          (tmp_path, "problems file {path} is a directory, expected a YAML file"),
                          (_file(tmp_path / "l1.yaml", LATIN1), r"{path}: not UTF-8 text \(byte "
                                                                r"0xf6 at offset 11\)")]:
        with pytest.raises(ConfigError, match=message.format(path=path)):
            read_problems(path, GEMM)


def test_rebench_names_bad_inputs_before_building_anything(tmp_path):
    base = ("rebench", "--workdir", tmp_path / "w", "--history", tmp_path / "h")
    cli(*base, "--config", "qiuck", needles=("'qiuck' not found", "quick"))
    cli(*base, "--config", _file(tmp_path / "bin.yaml", BINARY), needles=("bin.yaml", "binary"))
    cli(*base, "--config", TINY, "--alpha", "2", needles=("alpha=2",))
    cli(*base, "--config", TINY, "--problems", "m", needles=("'m'", "malformed pair"))
    cli(*base, "--config", TINY, "--problems", "m=64,n=64,k=6.4e1", needles=("k='6.4e1'",))
    cli("rebench", "--workdir", tmp_path / "w", "--history", _file(tmp_path / "hist", b"x"),
        "--config", TINY, needles=("history", "is a file"))
    assert not (tmp_path / "w").exists()


def test_repeatability_names_a_run_that_is_not_a_dataset(tmp_path):
    parquetless = _file(tmp_path / "run.parquet", b"id,value\n1,2\n")
    cli("repeatability", tmp_path / "a", tmp_path / "b", needles=("does not exist",))
    cli("repeatability", parquetless, parquetless, needles=("run.parquet", "parquet dataset"))
    cli("repeatability", tmp_path, tmp_path, "--tie-threshold-pct", "-1",
        needles=("--tie-threshold-pct -1",))


def test_run_names_a_bad_config_workdir_or_registry(tmp_path):
    latin1 = _file(tmp_path / "l1.yaml", LATIN1)
    workdir = tmp_path / "w"
    cli("run", "--plain", "--config", latin1, "--workdir", workdir, needles=("l1.yaml",
                                                                              "not UTF-8"))
    cli("run", "--plain", "--config", tmp_path / "nowhere", "--workdir", workdir,
        needles=("nowhere", "does not exist"))
    cli("run", "--plain", "--config", TINY, "--workdir", _file(tmp_path / "wfile", b"x"),
        needles=("workdir", "is a file"))
    cli("run", "--plain", "--config", TINY, "--workdir", workdir, "--registry",
        "nosuch://bucket/reg", needles=("nosuch://bucket/reg",))


def test_a_user_error_inside_the_prefect_flow_is_one_line(tmp_path):
    """Under Prefect the registry URL is read inside the flow, by RunContext.create: the
    flow fails with a RegistryError, and the console shows Prefect's log lines (without
    their tracebacks) and then the one error line."""
    result = run_cli("run", "--config", TINY, "--workdir", tmp_path / "w", "--registry",
                     "nosuch://bucket/reg")
    expect_clear(result, "tilecast run: error:", "nosuch://bucket/reg")


def test_run_plain_holds_the_device_it_is_given(tmp_path, monkeypatch):
    from tilecast.flows import cli as flows_cli
    from tilecast.workflows import pipeline

    held = []
    monkeypatch.setattr(pipeline, "run_all",
                        lambda ctx, device=None: held.append(device) or {"device": device})
    assert flows_cli.main(["run", "--plain", "--config", str(TINY), "--workdir",
                           str(tmp_path / "w"), "--device", "gpu@lab-7"]) == 0
    assert held == ["gpu@lab-7"]


# -- config check / schema ---------------------------------------------------------------------

def test_config_check_says_ok_with_a_summary_or_names_the_error(tmp_path):
    ok = run_cli("config", "check", TINY)
    assert ok.returncode == 0, ok.stderr.decode()[-2000:]
    assert ok.stdout.decode() == (f"ok: {TINY}: config 'tiny', 1 family (gemm 12 train + 3 "
                                  "holdout problems)\n")
    bad = _file(tmp_path / "bad.yaml", TINY.read_bytes().replace(b"name: tiny",
                                                                  b"name: tiny\nbudgte: 3", 1))
    cli("config", "check", bad, needles=("bad.yaml", "budgte"))
    cli("config", "check", tmp_path / "nowhere.yaml", needles=("nowhere.yaml", "does not exist"))
    cli("config", "check", _file(tmp_path / "l1.yaml", LATIN1), needles=("l1.yaml", "not UTF-8"))
    cli("config", "check", _file(tmp_path / "list.yaml", b"- 1\n- 2\n"), needles=("list.yaml",))
    cli("config", needles=("{check,schema}",))


def test_config_schema_prints_the_json_schema():
    result = run_cli("config", "schema")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    schema = json.loads(result.stdout)
    assert schema.get("type") == "object" and "families" in schema.get("properties", {})


# -- the boundary itself -----------------------------------------------------------------------

def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    """A programming error is not a user error: main lets it through, traceback and all."""
    from tilecast import cli as library_cli
    from tilecast.cli import records

    monkeypatch.setattr(records, "_cmd_repeatability",
                        lambda args: {}["a bug, not a user error"])
    parser = library_cli.build_parser()
    with pytest.raises(KeyError, match="a bug"):
        library_cli.main(["repeatability", "a", "b"], parser)
    assert library_cli.one_line("while parsing\n  in 'x', line 1\n    ^\nexpected") == \
        "while parsing in 'x', line 1 expected"


def test_rebench_help_names_the_tests_rebench_runs():
    result = run_cli("rebench", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.decode().split())
    assert "Welch t-test on the logs of the two runs' per-round medians" in text
    assert "Wilcoxon signed-rank" in text and "Benjamini-Hochberg" in text
    # per kernel the code runs a Welch test stratified by problem; Wilcoxon is its fallback
    assert "per kernel, a Welch test on the logs of its per-round medians stratified by " \
        "problem" in text
    assert "where records have no rounds, a Wilcoxon signed-rank test" in text
    assert "fall back to a Mann-Whitney U test" in text


def test_a_reader_that_leaves_early_gets_no_traceback():
    # `tilecast config schema | head -0`: the reader is gone before the first line (the
    # command takes far longer to import than this takes to close the pipe)
    process = subprocess.Popen([sys.executable, "-m", "tilecast.cli", "config", "schema"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
