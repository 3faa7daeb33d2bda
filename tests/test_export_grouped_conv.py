"""`tilecast export` of grouped-conv models (forward, bwd_data, bwd_weight; 2D and 3D): a real
small model per direction published to a registry, exported, compiled with g++ alone and
checked against Dispatcher.select on 10,000 problems each."""

import itertools
import json
import shutil
import subprocess

import lightgbm
import numpy as np
import pytest

from test_dispatch import METRICS, PARAMS
from tilecast.core.family import FamilyError
from tilecast.families import get_family
from tilecast.features.formula import Evaluator, Formula, problem_field
from tilecast.features import grouped_conv as definition
from tilecast.features.formula import OPS
from tilecast.features.grouped_conv import DTYPE_CODES, SHAPE_FIELDS, _bwd_data_reach
from tilecast.registry import api as registry
from tilecast.runtime import export, shortlist as shortlists
from tilecast.runtime.dispatch import Dispatcher, NoKernelError
from tilecast.runtime.export import c_runtime, c_source, grouped_conv as exporter
from tilecast.runtime.export.program import compile_program
from tilecast.runtime.export.selector import INVALID_PROBLEM, NO_KERNEL, OUT_OF_RANGE
from tilecast.spaces.grouped_conv import TileEngineConvConfig

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

DIRECTIONS = ("forward", "bwd_data", "bwd_weight")
# AVX-512: gvec's pixel-lane path (the closed-form reach included) is live in the features
HARDWARE = {"threads": 8, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
            "l3_bytes": 32 << 20, "clock_mhz": 3000.0,
            "flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
DRIVER = r"""
#include <cstdio>
#include "HEADER"

// problems (the selector's ARGS arguments, as integers) on stdin -> one kernel index per line
int main() {
  long long v[ARGS];
  for (;;) {
    for (int i = 0; i < ARGS; ++i)
      if (std::scanf("%lld", &v[i]) != 1) return 0;
    std::printf("%d\n", PREFIX_select(CALL));
  }
}
"""


def tile_engine_configs(direction):
    """A few CK tile-engine kernels: fp16 and bf16 candidates, 2D and 3D."""
    return [TileEngineConvConfig(direction, dtype, ndim, 256, tile_m, 64, pipeline, "intrawave",
                                 False, False)
            for dtype in ("fp16", "bf16") for ndim in (2, 3) for tile_m in (64, 128)
            for pipeline in ("compv3", "mem")]


def random_problems(seed: int, count: int, valid_only: bool = False) -> list[dict]:
    """Problem values across the valid space (every dtype, 2D and 3D, depthwise, winograd
    shapes, strides to 4, pads past the filter, empty outputs, small widths) and, unless
    `valid_only`, some the family refuses and some beyond the exported selector's range."""
    rng = np.random.default_rng(seed)
    small = (1, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 48, 64)

    def count_field():
        return int(rng.choice(small)) if rng.random() < 0.6 else \
            int(np.exp(rng.uniform(0, np.log(2048))))

    problems = []
    for _ in range(count):
        ndim = int(rng.choice([2, 3]))
        dtype = str(rng.choice(["fp32"] * 6 + ["fp16", "fp16", "bf16", "bf16", "fp8", "bf8"]))
        v = {"dtype": dtype, "ndim": ndim, "N": count_field(), "G": count_field(),
             "C": count_field(), "K": count_field(), "Di": 1, "Z": 1, "stride_d": 1,
             "pad_d": 0, "dilation_d": 1, "Hi": int(np.exp(rng.uniform(0, np.log(200)))),
             "Wi": int(np.exp(rng.uniform(0, np.log(200)))) if rng.random() < 0.7
             else int(rng.integers(1, 6)),
             "Y": int(rng.integers(1, 8)), "X": int(rng.integers(1, 8))}
        if rng.random() < 0.2:
            v["C"] = v["K"] = 1
        for axis in "hw":
            v[f"stride_{axis}"] = int(rng.choice([1, 1, 1, 2, 2, 3, 4]))
            v[f"pad_{axis}"] = int(rng.integers(0, 6))
            v[f"dilation_{axis}"] = int(rng.choice([1, 1, 1, 2, 3]))
        if rng.random() < 0.3:
            v.update(Y=3, X=3, stride_h=1, stride_w=1, dilation_h=1, dilation_w=1)
        if ndim == 3:
            v.update(Di=int(np.exp(rng.uniform(0, np.log(40)))), Z=int(rng.integers(1, 5)),
                     stride_d=int(rng.choice([1, 2, 3])), pad_d=int(rng.integers(0, 3)),
                     dilation_d=int(rng.choice([1, 2])))
        draw = rng.random()
        if not valid_only and draw < 0.06:      # refused: a bad field, dtype or ndim
            field = str(rng.choice(["N", "C", "Hi", "X", "stride_w", "dilation_h", "pad_h",
                                    "dtype", "ndim", "Di"]))
            v[field] = {"pad_h": -1, "dtype": "fp64", "ndim": 4,
                        "Di": 2 if ndim == 2 else 0}.get(field, int(rng.integers(-2, 1)))
        elif not valid_only and draw < 0.09:    # beyond the exact range
            if rng.random() < 0.5:
                v[str(rng.choice(["N", "Hi", "pad_w", "stride_h"]))] = (1 << 24) + 1
            else:
                v.update(N=1 << 16, C=1 << 12, G=1 << 12, Hi=64, Wi=64)
        problems.append(v)
    return problems


def in_range(values: dict) -> bool:
    """The exported selector's range (tilecast.runtime.export.grouped_conv), in Python ints."""
    if any(values[name] > exporter.MAX_FIELD for name in SHAPE_FIELDS):
        return False
    out = [max((values[size] + 2 * values[f"pad_{a}"] - values[f"dilation_{a}"] * (values[k] - 1)
                - 1) // values[f"stride_{a}"] + 1, 0)
           for a, size, k in (("d", "Di", "Z"), ("h", "Hi", "Y"), ("w", "Wi", "X"))]
    v = values
    tensors = (v["N"] * v["Di"] * v["Hi"] * v["Wi"] * v["G"] * v["C"],
               v["G"] * v["K"] * v["Z"] * v["Y"] * v["X"] * v["C"],
               v["N"] * out[0] * out[1] * out[2] * v["G"] * v["K"])
    return max(tensors) <= exporter.MAX_ELEMENTS


def as_row(values: dict) -> list[int]:
    return [DTYPE_CODES.get(values["dtype"], len(DTYPE_CODES)), values["ndim"],
            *(values[name] for name in SHAPE_FIELDS)]


def target_tflops(names, features):
    """A deterministic 'measurement' over tiles, parallel balance, the pipelines' shapes,
    the caches and the im2col expansion, so the forest splits on every kind of feature."""
    col = {name: features[:, i] for i, name in enumerate(names)}
    size = np.clip((col["log2_flops"] - 8) / 25, 0.05, 1.0)
    pipeline = (1.0 + 0.6 * col["is_winograd"] + 0.3 * col["is_gvec"] * col["is_depthwise"]
                + 0.2 * col["is_tile_engine"] - 0.2 * col["is_dw"] * (1 - col["is_depthwise"]))
    cache = 1.0 / (1.0 + 0.2 * np.minimum(col["working_set_l3_ratio"], 4.0)
                   + 0.1 * np.minimum(col["im2col_expansion"], 8.0))
    return (3.0 * col["tile_eff"] * col["par_balance"] * pipeline * cache * size
            + 0.01 * col["bm"] / 128 + 0.05 * col["has_si"] * col["si_balance"])


def train_and_publish(root, direction):
    family = get_family(f"grouped_conv_{direction}")
    engine = family.feature_engine(HARDWARE)
    configs = family.candidate_space({}, HARDWARE) + tile_engine_configs(direction)
    names = [family.kernel_name(c) for c in configs]
    kernel_matrix = engine.kernel_features(configs)
    blocks = []
    for values in random_problems(seed=100 + DIRECTIONS.index(direction), count=160,
                                  valid_only=True):
        problem = family.problem(values)
        rows = [i for i, c in enumerate(configs) if family.applicable(c, problem)]
        if rows:
            blocks.append(engine.matrix(problem, [configs[i] for i in rows],
                                        kernel_matrix[rows]))
    features = np.vstack(blocks)
    target = np.log1p(target_tflops(engine.feature_names(), features))
    # without log2_bytes, of which working_set_l3_ratio is an increasing function (LightGBM
    # would split on the first of the two): the forest then reads 2 ** log2(bytes)
    keep = [i for i, name in enumerate(engine.feature_names()) if name != "log2_bytes"]
    feature_names = [engine.feature_names()[i] for i in keep]
    booster = lightgbm.train(PARAMS, lightgbm.Dataset(features[:, keep], target),
                             num_boost_round=30)
    # the static best: an fp32 2D direct kernel (it applies to every fp32 2D problem)
    static_best = next(n for n, c in zip(names, configs)
                       if getattr(c, "pipeline", "") == "direct" and c.ndim_spatial == 2)
    spec = {"family": family.name, "feature_names": feature_names, "engine": engine.name,
            "engine_version": engine.version, "target_transform": "log1p_tflops",
            "hardware": HARDWARE}
    candidates = {"family": family.name, "kernels": names, "static_best": static_best}
    registry.publish(root, f"conv-{direction}", {
        "model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
        "candidates.json": json.dumps(candidates), "train_manifest.json": "{}"},
        metrics=METRICS)
    return names


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """direction -> (selector, driver binary, dispatcher), each model exported and compiled
    once."""
    root = tmp_path_factory.mktemp("registry")
    built = {}
    for direction in DIRECTIONS:
        train_and_publish(root, direction)
        model = f"conv-{direction}"
        selector = export.load(root, model)
        out = tmp_path_factory.mktemp(f"export-{direction}")
        export.write(selector, out, "c")
        built[direction] = (selector, compile_driver(selector, out),
                            Dispatcher.from_registry(root, model))
    built["root"] = root
    return built


def compile_driver(selector, directory):
    stem = c_source.file_stem(selector)
    call = ", ".join(f"({item['ctype']})v[{i}]" for i, item in enumerate(selector.inputs))
    source = (DRIVER.replace("HEADER", f"{stem}.h").replace("ARGS", str(len(selector.inputs)))
              .replace("PREFIX_", f"{stem}_").replace("CALL", call))
    (directory / "driver.cpp").write_text(source)
    binary = directory / "driver"
    subprocess.run(["g++", "-O2", "-I", str(directory), str(directory / "driver.cpp"),
                    str(directory / f"{stem}.c"), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    return binary


def run_driver(binary, rows) -> list[int]:
    text = "".join(" ".join(str(v) for v in row) + "\n" for row in rows)
    proc = subprocess.run([str(binary)], input=text, capture_output=True, text=True, check=True)
    return [int(line) for line in proc.stdout.split()]


def expected_choice(dispatcher, kernels, values) -> int:
    """What the exported selector must answer: the dispatcher's choice as an index of the
    kernel table, INVALID_PROBLEM where the family refuses the problem, NO_KERNEL where
    nothing runs it, OUT_OF_RANGE beyond the exact range."""
    try:
        dispatcher.problem(values)
    except FamilyError:
        return INVALID_PROBLEM
    if not in_range(values):
        return OUT_OF_RANGE
    try:
        return kernels.index(dispatcher.select(values))
    except NoKernelError:
        return NO_KERNEL


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_compiled_selector_picks_what_the_dispatcher_picks_on_10000_problems(models, direction):
    selector, binary, dispatcher = models[direction]
    assert selector.candidates > 64           # candidate sets take several words
    problems = random_problems(seed=7 + DIRECTIONS.index(direction), count=10_000)
    expected = [expected_choice(dispatcher, selector.kernels, p) for p in problems]
    got = run_driver(binary, [as_row(p) for p in problems])
    mismatches = [(p, e, g) for p, e, g in zip(problems, expected, got) if e != g]
    assert not mismatches, f"{len(mismatches)} of {len(problems)} differ, e.g. {mismatches[:3]}"
    # the draw reaches every answer: choices of 2D and 3D, own and tile-engine kernels, and
    # each fallback
    valid = [(p, e) for p, e in zip(problems, expected) if e >= 0]
    assert len(valid) > 7000 and len({e for _, e in valid}) >= 10
    assert {p["ndim"] for p, _ in valid} == {2, 3}
    assert {p["dtype"] for p, _ in valid} == {"fp32", "fp16", "bf16"}
    for code in (INVALID_PROBLEM, NO_KERNEL, OUT_OF_RANGE):
        assert expected.count(code) >= 20, code
    # a winograd choice for some 2D 3x3 problem where the pipeline runs (not in bwd_weight)
    winograd = {e for _, e in valid if "winograd" in selector.kernels[e]}
    assert bool(winograd) == (direction != "bwd_weight")


def test_the_forests_read_the_features_that_raise_a_logarithm_and_the_pixel_lane_path(models):
    """The agreement above covers the features computed with the C library's log2 and pow
    and gvec's closed-form reach only if some split reads them."""
    features = {slot["feature"] for direction in DIRECTIONS
                for slot in models[direction][0].slots}
    assert {"working_set_l3_ratio", "im2col_expansion", "n_tile_eff"} <= features


def test_the_closed_form_reach_is_the_kernels_loop():
    """bwd_data's dout reach (grouped_conv_lanes.hpp's reach_of, a loop over phases and
    taps) against its closed form, for strides 1 and 2 (the pixel-lane path's)."""
    def reach_of(size, pad, dil, filt, stride):
        offsets = [(r + pad - f * dil) // stride for r in range(min(stride, size))
                   for f in range(filt) if (r + pad - f * dil) % stride == 0]
        low, high = min(offsets + [0]), max(offsets + [0])
        return -low, high - low

    names = ("size", "pad", "dil", "filt", "stride")
    lead, reach = _bwd_data_reach(*(problem_field(name) for name in names))
    evaluator = Evaluator({"lead": Formula(lead), "reach": Formula(reach)})
    for values in itertools.product(range(1, 6), range(0, 8), range(1, 5), range(1, 8), (1, 2)):
        got = evaluator.values(dict(zip(names, map(float, values))), {}, {})
        assert tuple(got) == reach_of(*values), values


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_applicability_codes_match_the_family(models, direction):
    """Every code of a problem that exists holds the candidates family.applicable admits."""
    selector, _, _ = models[direction]
    family = get_family(f"grouped_conv_{direction}")
    key, representatives = exporter.applicability(family)
    evaluator = Evaluator({"key": Formula(key)})
    for code, problem in representatives:
        if problem is None:
            assert selector.applicability["candidates"][code] == []
            continue
        values = {**{name: float(getattr(problem, name)) for name in SHAPE_FIELDS},
                  "dtype": float(DTYPE_CODES[problem.dtype]), "ndim": float(problem.ndim)}
        assert evaluator.values(values, {}, {})[0] == code
        admitted = [c for c in range(selector.candidates)
                    if family.applicable(family.parse_name(selector.kernels[c]), problem)]
        assert selector.applicability["candidates"][code] == admitted


def test_the_source_is_c99_and_warning_free_as_c_and_cpp(models, tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the C build")
    selector, _, _ = models["bwd_data"]
    paths = export.write(selector, tmp_path, "c")
    source = [str(p) for p in paths if p.suffix == ".c"][0]
    for compiler, std in (("gcc", "-std=c99"), ("g++", "-std=c++11")):
        subprocess.run([compiler, std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-c",
                        source, "-o", str(tmp_path / f"{compiler}.o")],
                       check=True, capture_output=True, text=True)


def test_the_json_form_round_trips_to_the_same_c(models):
    selector, _, _ = models["forward"]
    document = json.loads(export.render(selector, "json")[f"{c_source.file_stem(selector)}.json"])
    assert document["limits"]["max_tensor_elements"] == exporter.MAX_ELEMENTS
    again = export.Selector.from_json(document)
    assert export.render(again, "c") == export.render(selector, "c")


def test_a_model_of_another_engine_version_is_refused(models, monkeypatch):
    name, version, names = exporter.WRITTEN_FOR
    monkeypatch.setattr(exporter, "WRITTEN_FOR", (name, version + 1, names))
    with pytest.raises(export.ExportError, match=r"is not the 'grouped_conv' version 2 the "
                                                 r"exporter's formulas follow"):
        export.load(models["root"], "conv-forward")


def test_the_exact_range_ends_where_the_exporter_says(models):
    """Known answers at the edges: a field of 2**24 and tensors of 2**48 elements are in
    range (answered as the dispatcher answers), one more is OUT_OF_RANGE; refusals first."""
    selector, binary, dispatcher = models["forward"]
    edge = {"dtype": "fp32", "ndim": 2, "N": 1 << 24, "G": 1, "C": 1, "K": 1, "Di": 1,
            "Hi": 1 << 24, "Wi": 1, "Z": 1, "Y": 1, "X": 1, "stride_d": 1, "stride_h": 1,
            "stride_w": 1, "pad_d": 0, "pad_h": 0, "pad_w": 0, "dilation_d": 1,
            "dilation_h": 1, "dilation_w": 1}      # input and output: exactly 2**48 elements
    problems = [edge, {**edge, "Hi": (1 << 24) + 1}, {**edge, "Hi": 1 << 23, "Wi": 3},
                {**edge, "C": 2}, {**edge, "N": 1, "pad_h": 1 << 24, "Hi": 1},
                {**edge, "N": 1, "pad_h": (1 << 24) + 1, "Hi": 1}, {**edge, "N": 0, "Hi": 1 << 30}]
    got = run_driver(binary, [as_row(p) for p in problems])
    assert got[0] == expected_choice(dispatcher, selector.kernels, edge) >= 0
    assert got[1:4] == [OUT_OF_RANGE] * 3
    assert got[4] >= 0 and got[5] == OUT_OF_RANGE and got[6] == INVALID_PROBLEM
    assert [in_range(p) for p in problems[:6]] == [True, False, False, False, True, False]


def test_a_shortlisted_selector_picks_what_the_shortlisted_dispatcher_picks(models, tmp_path):
    """The forward model with a shortlist of 4 learned on its training problems, exported
    with shortlist=3, on 3,000 problems."""
    root = models["root"]
    version = registry.local_copy(root, "conv-forward", 1)
    family = get_family("grouped_conv_forward")
    problems = [family.problem(values) for values in
                random_problems(seed=100, count=160, valid_only=True)]
    shortlist = shortlists.learn(Dispatcher.from_directory(version), problems, 4, drawn=1500)
    files = {name: (version / name).read_text() for name in
             ("model.txt", "feature_spec.json", "candidates.json", "train_manifest.json")}
    registry.publish(root, "conv-short", {**files, shortlists.FILE:
                                          json.dumps(shortlist.to_json())}, metrics=METRICS)
    selector = export.load(root, "conv-short", shortlist=3)
    assert selector.shortlist is not None and len(selector.shortlist_rows) >= 4
    export.write(selector, tmp_path, "c")
    binary = compile_driver(selector, tmp_path)
    dispatcher = Dispatcher.from_registry(root, "conv-short", shortlist=3)
    values = random_problems(seed=55, count=3000)
    expected = [expected_choice(dispatcher, selector.kernels, v) for v in values]
    assert run_driver(binary, [as_row(v) for v in values]) == expected
    assert len({e for e in expected if e >= 0}) >= 10


FEATURES_DRIVER = r"""
#include <stdio.h>
%(prelude)s

static void features(const double* in, const double* kt, double* out) {
%(inputs)s
  (void)kt;
%(statements)s
%(stores)s
}

/* per line: the inputs and a kernel index; writes the outputs as raw float64 */
int main(void) {
  static const double table[%(kernels)d][%(columns)d] = {%(table)s};
  double in[%(count)d], out[%(outputs)d];
  int i, kernel;
  for (;;) {
    for (i = 0; i < %(count)d; ++i)
      if (scanf("%%lf", &in[i]) != 1) return 0;
    if (scanf("%%d", &kernel) != 1) return 0;
    features(in, table[kernel], out);
    fwrite(out, sizeof out, 1, stdout);
  }
}
"""
# the features that raise a logarithm again: computed with the C library's log2 and pow
LIBM_FEATURES = ("im2col_expansion", "working_set_l3_ratio")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_exported_c_features_equal_the_numpy_engine(direction, tmp_path):
    """Every problem and interaction feature of the direction, as the exporter prints it,
    against the engine on 1,500 problems x 8 kernels (one of each pipeline and a tile-engine
    one): equal bit for bit (log2 ones by their argument), but for the two that raise a
    logarithm again, which stay within a few ulps."""
    family = get_family(f"grouped_conv_{direction}")
    engine = family.feature_engine(HARDWARE)
    configs = family.candidate_space({}, HARDWARE)
    chosen = [next(c for c in configs if c.pipeline == pipeline and c.ndim_spatial == ndim)
              for pipeline, ndim in (("direct", 2), ("im2col", 3), ("dw", 2), ("gemm", 2),
                                     ("gvec", 2), ("gvec", 3), ("direct", 3))]
    chosen.append(tile_engine_configs(direction)[0])
    kernel_matrix = engine.kernel_features(chosen)
    rows = [dict(zip(definition.KERNEL_FEATURES, row)) for row in kernel_matrix]
    problem_formulas, interaction_formulas = definition.FORMULAS[direction]
    formulas = {**problem_formulas, **interaction_formulas}
    program = compile_program({name: f.graph for name, f in formulas.items()}, rows, engine.hw)
    computed = list(program.outputs)

    def operand(ref):
        kind, what = ref
        if kind == "const":
            return f"({what!r})" if what < 0 else repr(what)
        return {"input": f"in_{what}", "kernel": f"kt[{what}]", "temp": f"t{what}"}[kind]

    names = list(definition.FIELD_CODES)
    source = tmp_path / "features.c"
    source.write_text(FEATURES_DRIVER % {
        "prelude": c_runtime.PRELUDE,
        "inputs": "\n".join(f"  const double in_{name} = in[{i}]; (void)in_{name};"
                            for i, name in enumerate(names)),
        "statements": "\n".join(
            f"  const double t{s.target} = "
            + OPS[s.op].c_template.format(*(operand(ref) for ref in s.operands)) + ";"
            for s in program.statements),
        "stores": "\n".join(f"  out[{i}] = {operand(program.outputs[name])};"
                            for i, name in enumerate(computed)),
        "kernels": len(chosen), "columns": max(1, len(program.kernel_table[0])),
        "table": ", ".join("{" + ", ".join(repr(v) for v in row) + "}"
                           for row in program.kernel_table),
        "count": len(names), "outputs": len(computed)})
    binary = tmp_path / "features"
    subprocess.run(["gcc", "-std=c99", "-O2", "-o", str(binary), str(source), "-lm"],
                   check=True)

    queries, expected = [], []
    index = {name: engine.feature_names().index(name) for name in formulas}
    for values in random_problems(seed=21 + DIRECTIONS.index(direction), count=1500,
                                  valid_only=True):
        problem = family.problem(values)
        numbers = definition.problem_values(problem)
        inputs = " ".join(repr(numbers[name]) for name in names)
        matrix = engine.matrix(problem, chosen, kernel_matrix)
        for position in range(len(chosen)):
            queries.append(f"{inputs} {position}")
            expected.append(matrix[position])
    run = subprocess.run([str(binary)], input=("\n".join(queries) + "\n").encode(),
                         capture_output=True, check=True)
    got = np.frombuffer(run.stdout, dtype=np.float64).reshape(len(queries), len(computed))
    expected = np.asarray(expected)
    for column, name in enumerate(computed):
        value = np.log2(got[:, column]) if formulas[name].log2 else got[:, column]
        want = expected[:, index[name]]
        if name in LIBM_FEATURES:
            np.testing.assert_allclose(value, want, rtol=64 * np.finfo(np.float64).eps)
        else:
            assert np.array_equal(value, want, equal_nan=True), name
    for name, per_kernel in program.kernel_values.items():
        value = np.log2(per_kernel) if formulas[name].log2 else np.asarray(per_kernel)
        assert np.array_equal(value, expected[:len(chosen), index[name]]), name
