"""Tests for tilecast.runtime.export (`tilecast export`): a real small GEMM model published to a
registry, exported, compiled with g++ alone and checked against Dispatcher.select."""

import itertools
import json
import re
import shutil
import subprocess

import lightgbm
import numpy as np
import pytest

from test_dispatch import (BF16_STATIC_BEST, HARDWARE, METRICS, PARAMS, publish_model,
                           synthetic_tflops)
from tilecast.cli import main
from tilecast.families import get_family
from tilecast.core.family import FamilyError
from tilecast.registry import api as registry
from tilecast.registry.api import RegistryError
from tilecast.runtime import export, shortlist as shortlists
from tilecast.runtime.dispatch import Dispatcher, NoKernelError
from tilecast.runtime.export import c_source, forest as forests
from tilecast.runtime.export.gemm import DTYPE_CODES, LAYOUT_CODES
from tilecast.runtime.export.selector import INVALID_PROBLEM, NO_KERNEL

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

GEMM = get_family("gemm")
# 48 fp32 and 24 bf16 candidates: more than 64, so candidate sets take two words
OPTIONS = {"dtype": ["fp32", "bf16"], "isa": ["avx512", "avx2"], "parallel": ["m", "n", "k"],
           "tiles": ["14x32", "6x16", "8x8", "4x64"], "pack_a": [True, False], "kc": [64, 256]}
TRAIN_SIZES = (8, 64, 300, 2048)
EDGE_SIZES = (1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 192,
              255, 256, 257, 1000, 1023, 1024, 1025, 2048, 4095, 4096, 65536, 1 << 20,
              (1 << 20) + 1, 1 << 30, (1 << 45) - 1)
LIMIT = 1 << 46   # GemmFamily.problem: mk + kn + mn <= MAX_OPERAND_BYTES / 4

DRIVER = r"""
#include <cstdio>
#include <cstring>
#include "HEADER"

// problems "m n k dtype layout_a layout_b" (codes) on stdin -> one kernel index per line;
// "names": every kernel name, and those of the indices around the table; "codes": lookups
int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "names") == 0) {
    for (int i = -1; i <= PREFIX_KERNEL_COUNT; ++i) {
      const char* name = PREFIX_kernel_name(i);
      std::printf("%s\n", name ? name : "(null)");
    }
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "codes") == 0) {
    std::printf("%d %d %d %d %d %d\n", PREFIX_dtype_code("fp32"), PREFIX_dtype_code("bf16"),
                PREFIX_dtype_code("fp64"), PREFIX_layout_a_code("row"),
                PREFIX_layout_b_code("col"), PREFIX_layout_a_code(nullptr));
    return 0;
  }
  long long m, n, k;
  int dtype, layout_a, layout_b;
  while (std::scanf("%lld %lld %lld %d %d %d", &m, &n, &k, &dtype, &layout_a, &layout_b) == 6)
    std::printf("%d\n", PREFIX_select(m, n, k, dtype, layout_a, layout_b));
  return 0;
}
"""


def target_tflops(names, features):
    """test_dispatch's synthetic measurement, with layouts and dtype mattering too."""
    col = {name: features[:, i] for i, name in enumerate(names)}
    return (synthetic_tflops(names, features) * (1.0 - 0.4 * col["a_strided_unpacked"])
            * (1.0 + 0.3 * col["is_bf16"] * col["par_k"]) * (1.0 + 0.1 * col["b_col_major"]))


def training_set(engine, configs):
    blocks = []
    for (m, n, k), dtype, layout_a, layout_b in itertools.product(
            itertools.product(TRAIN_SIZES, repeat=3), DTYPE_CODES, LAYOUT_CODES, LAYOUT_CODES):
        problem = GEMM.problem({"m": m, "n": n, "k": k, "dtype": dtype, "layout_a": layout_a,
                                "layout_b": layout_b})
        rows = [c for c in configs if GEMM.applicable(c, problem)]
        blocks.append(engine.matrix(problem, rows))
    features = np.vstack(blocks)
    return features, target_tflops(engine.feature_names(), features)


def train(features, tflops, **params):
    return lightgbm.train({**PARAMS, **params}, lightgbm.Dataset(features, np.log1p(tflops)),
                          num_boost_round=40)


def split_kinds(booster) -> set:
    """(decision_type, missing_type) of every split of a booster."""
    kinds, pending = set(), [t["tree_structure"] for t in booster.dump_model()["tree_info"]]
    while pending:
        node = pending.pop()
        if "split_feature" in node:
            kinds.add((node["decision_type"], node["missing_type"]))
            pending += (node["left_child"], node["right_child"])
    return kinds


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A registry of GEMM models on the same features: 'gemm' (fp32 and bf16 candidates),
    'fp32-bf16-best' (fp32 candidates, a bf16 static best), 'fp32' (fp32 only), and models
    with Zero and NaN missing types."""
    root = tmp_path_factory.mktemp("registry")
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    names = [GEMM.kernel_name(c) for c in configs]
    fp32 = [name for name, c in zip(names, configs) if c.dtype == "fp32"]
    assert len(names) == 72 and len(fp32) == 48
    features, tflops = training_set(engine, configs)
    feature_names = engine.feature_names()
    booster = train(features, tflops)
    publish_model(root, "gemm", booster, feature_names, names, "log1p_tflops",
                  static_best=fp32[5])
    publish_model(root, "fp32-bf16-best", booster, feature_names, fp32, "log1p_tflops",
                  static_best=BF16_STATIC_BEST)
    publish_model(root, "fp32", booster, feature_names, fp32, "log_tflops")

    zero = train(features, tflops, zero_as_missing=True)
    publish_model(root, "zero-missing", zero, feature_names, names, "log1p_tflops")
    with_nan = features.copy()
    rng = np.random.default_rng(3)
    for column in ("tile_eff", "k_tail_frac", "log2_m"):   # NaN in training: NaN splits
        with_nan[rng.random(len(features)) < 0.2, feature_names.index(column)] = np.nan
    nan = train(with_nan, tflops)
    publish_model(root, "nan-missing", nan, feature_names, names, "log1p_tflops")

    # 'gemm' again with a shortlist of 4 learned on its training problems
    version = registry.local_copy(root, "gemm", 1)
    dispatcher = Dispatcher.from_directory(version)
    problems = [GEMM.problem({"m": m, "n": n, "k": k, "dtype": dtype, "layout_a": a,
                              "layout_b": b})
                for (m, n, k), dtype, a, b in itertools.product(
                    itertools.product(TRAIN_SIZES, repeat=3), DTYPE_CODES, LAYOUT_CODES,
                    LAYOUT_CODES)]
    shortlist = shortlists.learn(dispatcher, problems, 4, drawn=1500)
    files = {name: (version / name).read_text() for name in
             ("model.txt", "feature_spec.json", "candidates.json", "train_manifest.json")}
    registry.publish(root, "gemm-short", {**files, shortlists.FILE:
                                          json.dumps(shortlist.to_json())}, metrics=METRICS)
    return {"root": root, "names": names, "fp32": fp32, "engine": engine,
            "features": features, "tflops": tflops, "boosters": {
                "gemm": booster, "zero-missing": zero, "nan-missing": nan}}


@pytest.fixture(scope="module")
def compiled(setup, tmp_path_factory):
    """model -> (selector, driver binary), exported and compiled on first use."""
    built = {}

    def get(model, flags=("-O2",), shortlist=None):
        key = (model, tuple(flags), shortlist)
        if key not in built:
            out = tmp_path_factory.mktemp(f"export-{model}")
            selector = export.load(setup["root"], model, shortlist=shortlist)
            export.write(selector, out, "c")
            built[key] = (selector, compile_driver(selector, out, flags))
        return built[key]
    return get


def compile_driver(selector, directory, flags):
    stem = c_source.file_stem(selector)
    prefix = f"tilecast_{c_source.identifier(selector.model)}"
    source = (DRIVER.replace("HEADER", f"{stem}.h")
              .replace("PREFIX_KERNEL_COUNT", f"{prefix.upper()}_KERNELS")
              .replace("PREFIX_", f"{prefix}_"))
    (directory / "driver.cpp").write_text(source)
    binary = directory / "driver"
    subprocess.run(["g++", *flags, "-I", str(directory), str(directory / "driver.cpp"),
                    str(directory / f"{stem}.c"), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    return binary


def run_driver(binary, rows, mode=None) -> list[str]:
    text = "".join(" ".join(str(v) for v in row) + "\n" for row in rows)
    proc = subprocess.run([str(binary)] + ([mode] if mode else []), input=text,
                          capture_output=True, text=True, check=True)
    return proc.stdout.split("\n")[:-1]


def random_problems(seed: int, count: int) -> list[dict]:
    """Sizes: a third edge values (1, powers of two and their neighbours, 2**30, 2**45 - 1),
    most log-uniform up to 2**24, a few up to 2**45 (often beyond the operand limit), a few
    zero or negative; both dtypes, both layouts of A and B."""
    rng = np.random.default_rng(seed)

    def size():
        draw = rng.random()
        if draw < 0.33:
            return int(rng.choice(EDGE_SIZES))
        if draw < 0.93:
            return int(np.exp(rng.uniform(0, np.log(1 << 24))))
        if draw < 0.98:
            return int(np.exp(rng.uniform(0, np.log(1 << 45))))
        return int(rng.integers(-3, 1))

    return [{"m": size(), "n": size(), "k": size(), "dtype": str(rng.choice(list(DTYPE_CODES))),
             "layout_a": str(rng.choice(list(LAYOUT_CODES))),
             "layout_b": str(rng.choice(list(LAYOUT_CODES)))} for _ in range(count)]


def as_codes(values: dict) -> tuple:
    return (values["m"], values["n"], values["k"], DTYPE_CODES[values["dtype"]],
            LAYOUT_CODES[values["layout_a"]], LAYOUT_CODES[values["layout_b"]])


def dispatcher_choice(dispatcher, kernels: list[str], values: dict) -> int:
    """Dispatcher.select as an index of the exported kernel table, or the fallback code."""
    try:
        return kernels.index(dispatcher.select(values))
    except NoKernelError:
        return NO_KERNEL
    except FamilyError:
        return INVALID_PROBLEM


# --- the compiled selector agrees with the dispatcher ---------------------------------------


def choices_agree(selector, binary, dispatcher, problems) -> list[int]:
    """The dispatcher's choices of `problems` (kernel table indices or fallback codes),
    asserted equal to the compiled selector's."""
    expected = [dispatcher_choice(dispatcher, selector.kernels, p) for p in problems]
    got = [int(line) for line in run_driver(binary, [as_codes(p) for p in problems])]
    mismatches = [(p, e, g) for p, e, g in zip(problems, expected, got) if e != g]
    assert not mismatches, f"{len(mismatches)} of {len(problems)} differ, e.g. {mismatches[:3]}"
    return expected


def test_compiled_selector_picks_what_the_dispatcher_picks_on_10000_problems(setup, compiled):
    selector, binary = compiled("gemm")
    assert selector.kernels == sorted(setup["names"]) and selector.candidates == 72
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm")
    expected = choices_agree(selector, binary, dispatcher,
                             random_problems(seed=11, count=10_000))
    valid = [e for e in expected if e >= 0]
    assert len(valid) > 8000 and expected.count(INVALID_PROBLEM) > 200
    # the choice depends on the shape, the dtype (both word of the candidate set) and layout
    assert len(set(valid)) >= 10
    dtype_of = {c: code for code, rows in enumerate(selector.applicability["candidates"])
                for c in rows}
    assert {dtype_of[e] for e in valid} == set(DTYPE_CODES.values())
    fp32 = selector.applicability["candidates"][DTYPE_CODES["fp32"]]
    assert min(fp32) < 64 <= max(fp32)   # fp32 problems score candidates of both words


@pytest.mark.parametrize("size", [1, 3])
def test_a_shortlisted_selector_picks_what_the_shortlisted_dispatcher_picks(setup, compiled,
                                                                           size):
    selector, binary = compiled("gemm-short", shortlist=size)
    assert selector.shortlist is not None and len(selector.shortlist_rows) >= 4
    assert max(len(row) for row in selector.shortlist_rows) == size
    listed = Dispatcher.from_registry(setup["root"], "gemm-short", shortlist=size)
    full = Dispatcher.from_registry(setup["root"], "gemm-short")
    problems = random_problems(seed=12, count=10_000)
    expected = choices_agree(selector, binary, listed, problems)
    valid = [(p, e) for p, e in zip(problems, expected) if e >= 0]
    assert len({e for _, e in valid}) >= 5
    # the shortlist changes some choices (so the test would see a selector ignoring it)
    forest = [dispatcher_choice(full, selector.kernels, p) for p, _ in valid[:2000]]
    assert any(f != e for f, (_, e) in zip(forest, valid[:2000]))


def test_a_version_without_a_shortlist_cannot_be_exported_with_one(setup, tmp_path, capsys):
    assert main(["export", "--registry", str(setup["root"]), "--model", "gemm",
                 "--shortlist", "2", "--out", str(tmp_path)]) == 2
    assert "trained without a shortlist" in capsys.readouterr().err
    assert main(["export", "--registry", str(setup["root"]), "--model", "gemm-short",
                 "--shortlist", "0", "--out", str(tmp_path)]) == 2
    assert "--shortlist 0 must be a number of kernels >= 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("model", ["zero-missing", "nan-missing"])
def test_missing_value_splits_decide_as_lightgbm_does(setup, compiled, model):
    missing = {"zero-missing": "Zero", "nan-missing": "NaN"}[model]
    assert any(kind == ("<=", missing) for kind in split_kinds(setup["boosters"][model]))
    selector, binary = compiled(model)
    assert forests.MISSING_TYPES[missing] in selector.forest.missing
    dispatcher = Dispatcher.from_registry(setup["root"], model)
    problems = random_problems(seed=12, count=2000)
    expected = [dispatcher_choice(dispatcher, selector.kernels, p) for p in problems]
    assert [int(v) for v in run_driver(binary, [as_codes(p) for p in problems])] == expected


def test_contraction_is_off_even_where_the_compiler_would_fuse(setup, compiled, tmp_path):
    """Built for this CPU in GNU mode (where GCC fuses a * b + c by default), the source still
    has no fused multiply-add, and the choices are the same."""
    macros = subprocess.run(["g++", "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"],
                            capture_output=True, text=True, check=True).stdout
    if "__FMA__" not in macros:
        pytest.skip("this CPU has no FMA: nothing to fuse")
    selector, native = compiled("gemm", ("-O3", "-march=native"))
    export.write(selector, tmp_path, "c")
    assembly = subprocess.run(["g++", "-O3", "-march=native", "-S", "-o", "-", "-x", "c++",
                               str(tmp_path / f"{c_source.file_stem(selector)}.c")],
                              capture_output=True, text=True, check=True).stdout
    assert not re.search(r"vfn?m(add|sub)", assembly)
    _, portable = compiled("gemm")
    rows = [as_codes(p) for p in random_problems(seed=13, count=3000)]
    assert run_driver(native, rows) == run_driver(portable, rows)


@pytest.mark.parametrize("model, shortlist", [("gemm", None), ("gemm-short", 2)])
def test_the_source_is_c99_and_warning_free_as_c_and_cpp(setup, compiled, tmp_path, model,
                                                        shortlist):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the C build")
    selector, _ = compiled(model, shortlist=shortlist)
    paths = export.write(selector, tmp_path, "c")
    source = [str(p) for p in paths if p.suffix == ".c"][0]
    for compiler, std in (("gcc", "-std=c99"), ("g++", "-std=c++11")):
        subprocess.run([compiler, std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-c",
                        source, "-o", str(tmp_path / f"{compiler}.o")],
                       check=True, capture_output=True, text=True)


# --- fallbacks -------------------------------------------------------------------------------


def test_problems_the_family_refuses_give_invalid_problem(setup, compiled):
    selector, binary = compiled("gemm")
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm")
    edge = (1 << 45) - 1   # m=edge, n=k=1: mk + kn + mn = 2**46 - 1, the largest allowed
    problems = [(0, 8, 8, 0, 0, 0), (8, -1, 8, 0, 0, 0), (8, 8, -(1 << 62), 0, 0, 0),
                (1 << 24, 1 << 24, 1, 0, 0, 0), (1 << 62, 1 << 62, 1 << 62, 0, 0, 0),
                (edge + 1, 1, 1, 0, 0, 0), (edge, 1, 1, 0, 0, 0), (edge, 1, 1, 1, 1, 1),
                (8, 8, 8, 2, 0, 0), (8, 8, 8, -1, 0, 0), (8, 8, 8, 0, 2, 0), (8, 8, 8, 0, 0, 7)]
    got = [int(v) for v in run_driver(binary, problems)]
    assert got[:6] == [INVALID_PROBLEM] * 6 and got[8:] == [INVALID_PROBLEM] * 4
    for row, choice in zip(problems[:8], got[:8]):
        values = dict(zip(("m", "n", "k"), row[:3]), dtype=list(DTYPE_CODES)[row[3]],
                      layout_a=list(LAYOUT_CODES)[row[4]], layout_b=list(LAYOUT_CODES)[row[5]])
        assert dispatcher_choice(dispatcher, selector.kernels, values) == choice, row
    assert 0 <= got[6] < selector.candidates and 0 <= got[7] < selector.candidates


def test_no_candidate_of_the_dtype_gives_the_static_best_or_no_kernel(setup, compiled):
    bf16, fp32 = (8, 8, 8, DTYPE_CODES["bf16"], 0, 0), (8, 8, 8, DTYPE_CODES["fp32"], 0, 0)
    selector, binary = compiled("fp32-bf16-best")
    # the bf16 static best is no candidate: it ends the table and only a fallback returns it
    assert selector.kernels[-1] == BF16_STATIC_BEST and selector.candidates == 48
    got = [int(v) for v in run_driver(binary, [bf16, fp32])]
    assert got[0] == len(selector.kernels) - 1 and 0 <= got[1] < selector.candidates
    assert run_driver(binary, [], "names")[got[0] + 1] == BF16_STATIC_BEST

    dispatcher = Dispatcher.from_registry(setup["root"], "fp32")
    with pytest.raises(NoKernelError):
        dispatcher.select("m=8,n=8,k=8,dtype=bf16")
    _, binary = compiled("fp32")
    assert [int(v) for v in run_driver(binary, [bf16])] == [NO_KERNEL]


def test_names_and_codes_lookups(setup, compiled):
    selector, binary = compiled("gemm")
    assert run_driver(binary, [], "names") == ["(null)", *selector.kernels, "(null)"]
    assert run_driver(binary, [], "codes") == [
        f"{DTYPE_CODES['fp32']} {DTYPE_CODES['bf16']} -1 {LAYOUT_CODES['row']} "
        f"{LAYOUT_CODES['col']} -1"]


# --- the JSON form ---------------------------------------------------------------------------

JSON_OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
            "div": lambda a, b: a / b, "neg": lambda a: -a,
            "min": lambda a, b: a if a <= b else b, "max": lambda a, b: a if a >= b else b,
            "ceil_div": lambda a, b: -((-a) // b), "eq": lambda a, b: float(a == b),
            "gt": lambda a, b: float(a > b), "select": lambda c, a, b: a if c != 0 else b}
ZERO_THRESHOLD = float(np.float32(1e-35))


def json_select(doc: dict, row: tuple) -> int:
    """An evaluator of the JSON form written from its description alone."""
    values = dict(zip([item["name"] for item in doc["inputs"]], row))
    m, n, k = values["m"], values["n"], values["k"]
    invalid = doc["fallback"]["invalid_problem"]
    if min(m, n, k) < doc["limits"]["min_size"] or \
            m * k + k * n + m * n > doc["limits"]["max_operand_elements"]:
        return invalid
    if any(item["codes"] and values[item["name"]] not in item["codes"].values()
           for item in doc["inputs"]):
        return invalid
    inputs = {name: float(value) for name, value in values.items()}
    problem_temps = {}

    def problem_operand(ref):
        kind, what = ref
        return {"input": lambda: inputs[what], "const": lambda: float(what),
                "temp": lambda: problem_temps[what]}[kind]()

    for target, level, op, operands in doc["statements"]:
        if level == "problem":
            problem_temps[target] = JSON_OPS[op](*(problem_operand(r) for r in operands))
    code = int(problem_operand(doc["applicability"]["source"]))
    rows = doc["applicability"]["candidates"][code]
    if not rows:
        return doc["static_best"] if doc["applicability"]["static_best"][code] else \
            doc["fallback"]["no_kernel"]

    kernel_slots = [i for i, s in enumerate(doc["slots"]) if s["level"] == "kernel"]

    def slot_values_of(c):
        temps = {}

        def operand(ref):
            kind, what = ref
            return {"input": lambda: inputs[what], "const": lambda: float(what),
                    "kernel": lambda: doc["kernel_table"][c][what],
                    "temp": lambda: temps[what]}[kind]()

        for target, _, op, operands in doc["statements"]:
            temps[target] = JSON_OPS[op](*(operand(ref) for ref in operands))
        slot_values = []
        for i, slot in enumerate(doc["slots"]):
            if slot["level"] == "kernel":
                value = doc["kernel_slot_values"][c][kernel_slots.index(i)]
            else:
                value = operand(slot["source"])
                if not slot["log2"] and abs(value) <= ZERO_THRESHOLD:
                    value = 0.0
            slot_values.append(value)
        return slot_values

    def walk(tree, node, slot_values):
        nodes = tree["nodes"]
        while node >= 0:
            slot = nodes["slot"][node]
            value, zero = slot_values[slot], 1.0 if doc["slots"][slot]["log2"] else 0.0
            missing, go_default = nodes["missing"][node], nodes["default_left"][node]
            if value != value and missing == 2:      # NaN, a NaN split: its default
                left = go_default
            else:
                value = zero if value != value else value
                left = go_default if missing == 1 and value == zero else \
                    value <= nodes["threshold"][node]
            node = nodes["left"][node] if left else nodes["right"][node]
        return -1 - node

    if doc["shortlist"] is not None:   # problem slots read the same for every candidate
        tree = doc["shortlist"]["tree"]
        leaf = walk(tree, tree["roots"][0], slot_values_of(rows[0]))
        listed = [c for c in rows if c in doc["shortlist"]["rows"][leaf]]
        if len(listed) == 1:
            return listed[0]
        rows = listed or rows
    best, best_score = None, None
    for c in rows:
        slot_values = slot_values_of(c)
        score = sum(doc["forest"]["leaves"][walk(doc["forest"], root, slot_values)]
                    for root in doc["forest"]["roots"])
        if score <= doc["raw_score_max"] and (best is None or score > best_score):
            best, best_score = c, score
    return rows[0] if best is None else best


@pytest.mark.parametrize("model, shortlist", [("gemm", None), ("gemm-short", 2)])
def test_a_python_evaluator_of_the_json_form_picks_what_the_dispatcher_picks(setup, tmp_path,
                                                                             model, shortlist):
    assert main(["export", "--registry", str(setup["root"]), "--model", model, "--version",
                 "1", "--out", str(tmp_path), "--format", "json"]
                + (["--shortlist", str(shortlist)] if shortlist else [])) == 0
    doc = json.loads((tmp_path / f"tilecast_{model.replace('-', '_')}.json").read_text())
    dispatcher = Dispatcher.from_registry(setup["root"], model, shortlist=shortlist)
    problems = random_problems(seed=14, count=300)
    got = [json_select(doc, as_codes(p)) for p in problems]
    assert got == [dispatcher_choice(dispatcher, doc["kernels"], p) for p in problems]
    assert len({g for g in got if g >= 0}) >= 5


@pytest.mark.parametrize("model, shortlist", [("gemm", None), ("gemm-short", 3)])
def test_the_json_form_round_trips_to_the_same_c(setup, model, shortlist):
    selector = export.load(setup["root"], model, shortlist=shortlist)
    document = json.loads(export.render(selector, "json")[f"{c_source.file_stem(selector)}.json"])
    assert (document["shortlist"] is None) == (shortlist is None)
    again = export.Selector.from_json(document)
    assert export.render(again, "c") == export.render(selector, "c")
    assert again.to_json() == document
    document["format_version"] = 99
    with pytest.raises(export.ExportError, match="not a tilecast-selector version 3"):
        export.Selector.from_json(document)


# --- refusals ----------------------------------------------------------------------------


def test_a_damaged_version_is_refused_naming_the_file(setup, tmp_path, capsys):
    root = tmp_path / "registry"
    shutil.copytree(setup["root"] / "gemm", root / "gemm")
    model_file = registry.version_path(root, "gemm", 1) / "model.txt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0x01   # one flipped bit: same size, another sha256
    model_file.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match=r"model\.txt.*checksum does not match"):
        export.load(root, "gemm")
    out = tmp_path / "out"
    assert main(["export", "--registry", str(root), "--model", "gemm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tilecast export: error: ") and "model.txt" in err
    assert "\n" not in err and not out.exists()


def test_an_unsupported_family_is_refused_naming_the_supported_ones(setup, tmp_path, capsys):
    spec = {"family": "disco_forward", "feature_names": ["N"], "target_transform": "log_tflops",
            "hardware": HARDWARE}
    registry.publish(tmp_path, "disco", {"model.txt": "tree\n", "feature_spec.json":
                                         json.dumps(spec), "candidates.json": "{}"},
                     metrics=METRICS)
    assert main(["export", "--registry", str(tmp_path), "--model", "disco",
                 "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        "tilecast export: error: family 'disco_forward' cannot be exported; tilecast export "
        "supports the families gemm, grouped_conv_forward, grouped_conv_bwd_data, "
        "grouped_conv_bwd_weight (another family needs its feature formulas in "
        "tilecast.runtime.export)")


def test_categorical_splits_are_refused(setup, tmp_path):
    features, tflops = setup["features"], setup["tflops"]
    names = setup["engine"].feature_names()
    booster = lightgbm.train({**PARAMS, "min_data_per_group": 5, "max_cat_to_onehot": 8},
                             lightgbm.Dataset(features, np.log1p(tflops),
                                              categorical_feature=[names.index("mr")]),
                             num_boost_round=10)
    assert any(kind == "==" for kind, _ in split_kinds(booster))
    publish_model(tmp_path, "categorical", booster, names, setup["names"], "log1p_tflops")
    with pytest.raises(export.ExportError, match=r"categorical split .*numerical splits"):
        export.load(tmp_path, "categorical")


def test_a_newer_engine_than_the_formulas_follow_is_refused(setup, monkeypatch):
    from tilecast.runtime.export import gemm

    name, _, names = gemm.WRITTEN_FOR
    monkeypatch.setattr(gemm, "WRITTEN_FOR", (name, 1, names))
    with pytest.raises(export.ExportError, match=r"is not the 'gemm' version 1"):
        export.load(setup["root"], "gemm")


# --- the parts -----------------------------------------------------------------------------


def test_log2_bounds_turn_a_log2_split_into_a_split_on_its_argument():
    rng = np.random.default_rng(5)
    sizes = np.array([48, 96, 192, 3, 1 << 30, 7], dtype=np.float64)
    thresholds = np.concatenate([
        (np.log2(sizes[:-1]) + np.log2(sizes[1:])) / 2,   # LightGBM's midpoints
        np.log2(sizes), rng.uniform(-60, 60, 200), [0.0, -1e-300, 1100.0, -1100.0]])
    bounds = forests.log2_bounds(thresholds)
    with np.errstate(divide="ignore", over="ignore"):
        above = np.nextafter(bounds, np.inf)
        assert (np.log2(bounds) <= thresholds).all()
        assert (np.log2(above) > thresholds).all()
    # only 0 (log2 -inf) is below -1100; every finite float64 is below 1100
    assert bounds[-1] == 0.0 and bounds[-2] == np.finfo(np.float64).max


def test_the_raw_score_bound_is_where_the_inverse_transform_stops_being_finite():
    for inverse in (np.exp, np.expm1):
        bound = forests.raw_score_bound(inverse)
        with np.errstate(over="ignore"):
            assert np.isfinite(inverse(np.array([bound])))[0]
            assert not np.isfinite(inverse(np.array([np.nextafter(bound, np.inf)])))[0]
