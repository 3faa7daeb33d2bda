"""The GEMM feature formulas are written once (tilecast.features.gemm.formulas); the numpy
engine evaluates them, the exported selector's C and the native scorer's C++ are generated
from them. These tests hold the three to each other on thousands of problems, and the
checked-in C++ header to what the formulas generate."""

import dataclasses
import shutil
import subprocess

import numpy as np
import pytest

from tilecast.families import get_family
from tilecast.features import gemm as definition
from tilecast.features.formula import OPS, Evaluator, Formula, apply, problem_field
from tilecast.runtime.export import c_runtime
from tilecast.runtime.export.program import compile_program
from tilecast.runtime.native import codegen, gemm_features, generate
from tilecast.runtime.native.gemm_features import EngineMismatch, NativeGemmFeatures

GEMM = get_family("gemm")
HARDWARE = {"threads": 8, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
            "l3_bytes": 32 << 20, "clock_mhz": 3000.0,
            "flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
OPTIONS = {"dtype": ["fp32", "bf16"], "isa": ["avx512", "avx2"], "parallel": ["m", "n", "k"],
           "tiles": ["14x32", "6x16", "4x64"], "pack_a": [True, False], "kc": [64, 256]}
LIMIT = 1 << 46   # GemmFamily.problem: mk + kn + mn <= MAX_OPERAND_BYTES / 4
EDGES = (1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 1 << 20,
         (1 << 20) + 1, 1 << 30)
PROBLEM_COUNT = 3000


def random_problems(count: int, seed: int = 5) -> list:
    """Valid problems: log-uniform sizes up to 2^30 (and edge sizes), every dtype and layout."""
    rng = np.random.default_rng(seed)
    problems = []
    while len(problems) < count:
        if rng.random() < 0.2:
            m, n, k = (int(v) for v in rng.choice(EDGES, 3))
        else:
            m, n, k = (int(v) for v in np.exp(rng.uniform(0, np.log(1 << 30), 3)).round())
        m, n, k = max(m, 1), max(n, 1), max(k, 1)
        if m * k + k * n + m * n > LIMIT:
            continue
        problems.append(GEMM.problem({"m": m, "n": n, "k": k,
                                      "dtype": str(rng.choice(["fp32", "bf16"])),
                                      "layout_a": str(rng.choice(["row", "col"])),
                                      "layout_b": str(rng.choice(["row", "col"]))}))
    return problems


@pytest.fixture(scope="module")
def space():
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    return {"engine": engine, "configs": configs,
            "kernel_matrix": engine.kernel_features(configs), "problems":
            random_problems(PROBLEM_COUNT)}


# --- the one definition ----------------------------------------------------------------------


def test_the_engine_features_are_the_definitions_in_column_order():
    engine = GEMM.feature_engine(HARDWARE)
    assert engine.feature_names()[:len(definition.PROBLEM_FORMULAS)] == \
        list(definition.PROBLEM_FORMULAS)
    first = len(definition.PROBLEM_FORMULAS) + len(definition.KERNEL_FEATURES)
    assert engine.feature_names()[first:first + len(definition.INTERACTION_FORMULAS)] == \
        list(definition.INTERACTION_FORMULAS)
    # names and order of published models (feature_spec.json) stay what they were
    assert gemm_features.WRITTEN_FOR[2] == tuple(engine.feature_names())
    assert engine.feature_names()[:4] == ["m", "n", "k", "log2_m"]
    assert engine.feature_names()[-9:-8] == ["log2_est_ms"]


def test_known_answers():
    """A 100 x 200 x 300 fp32 problem on a 6x16 kernel, by hand."""
    engine = GEMM.feature_engine(HARDWARE)
    config = GEMM.parse_name(next(GEMM.kernel_name(c) for c in GEMM.candidate_space(
        {"dtype": ["fp32"], "isa": ["avx2"], "parallel": ["m"], "tiles": ["6x16"],
         "pack_a": [True], "kc": [256]}, HARDWARE)))
    problem = GEMM.problem({"m": 100, "n": 200, "k": 300})
    row = dict(zip(engine.feature_names(), engine.matrix(problem, [config])[0]))
    assert row["log2_flops"] == np.log2(2.0 * 100 * 200 * 300)
    assert row["log2_bytes"] == np.log2(4 * (100 * 300 + 300 * 200) + 4 * 100 * 200)
    assert row["m_tile_eff"] == 100 / (17 * 6)           # ceil(100 / 6) = 17 tiles
    assert row["n_tile_eff"] == 200 / (13 * 16)          # ceil(200 / 16) = 13 tiles
    assert row["k_blocks"] == 2 and row["k_tail_frac"] == (512 - 300) / 512
    assert row["log2_par_units"] == np.log2(17)          # par m: one unit per MR panel
    assert row["par_balance"] == 17 / 24                 # ceil(17 / 8) * 8 = 24 slots
    assert row["is_bf16"] == 0.0 and row["a_col_major"] == 0.0


# --- the native scorer's C++ -----------------------------------------------------------------


def test_the_checked_in_header_is_what_the_formulas_generate():
    family = codegen.gemm()
    assert codegen.header_path(family).read_text() == codegen.header(family)
    assert generate.main(["--check"]) == 0


def test_a_changed_formula_changes_the_header_and_the_stale_one_is_refused(tmp_path, monkeypatch):
    family = codegen.gemm()
    interaction = dict(family.interaction)
    interaction["k_per_thread"] = Formula(apply("max", problem_field("k"), 2.0))
    changed = dataclasses.replace(family, interaction=interaction)
    assert codegen.header(changed) != codegen.header(family)

    stale = tmp_path / "gemm_features_formulas.hpp"
    stale.write_text(codegen.header(changed))
    monkeypatch.setattr(codegen, "header_path", lambda _: stale)
    gemm_features._stale_header.cache_clear()
    try:
        engine = GEMM.feature_engine(HARDWARE)
        with pytest.raises(EngineMismatch, match="not what the formulas .* generate"):
            NativeGemmFeatures(engine, np.ones((1, len(definition.KERNEL_FEATURES))))
        assert generate.main(["--check"]) == 1
    finally:
        gemm_features._stale_header.cache_clear()


@pytest.mark.parametrize("hardware", [HARDWARE, {**HARDWARE, "threads": 3.5}, {}],
                         ids=["counts", "fractional-threads", "no-profile"])
def test_native_features_equal_the_numpy_engine_on_3000_problems(space, hardware):
    engine = GEMM.feature_engine(hardware)
    kernel_matrix = engine.kernel_features(space["configs"])
    filler = NativeGemmFeatures(engine, kernel_matrix)
    for problem in space["problems"]:
        expected = engine.matrix(problem, space["configs"], kernel_matrix)
        got = filler.matrix(problem)
        assert np.array_equal(got, expected), problem


# --- the exported selector's C ---------------------------------------------------------------

DRIVER = r"""
#include <stdio.h>
%(prelude)s

static void features(const double* in, const double* kt, double* out) {
  const double in_m = in[0], in_n = in[1], in_k = in[2];
  const double in_dtype = in[3], in_layout_a = in[4], in_layout_b = in[5];
  (void)in_m; (void)in_n; (void)in_k; (void)in_dtype; (void)in_layout_a; (void)in_layout_b;
  (void)kt;
%(statements)s
%(stores)s
}

/* per line: the 6 inputs and a kernel index; writes the outputs as raw float64 */
int main(void) {
  static const double table[%(kernels)d][%(columns)d] = {%(table)s};
  double in[6], out[%(outputs)d];
  int kernel;
  while (scanf("%%lf %%lf %%lf %%lf %%lf %%lf %%d", &in[0], &in[1], &in[2], &in[3], &in[4],
               &in[5], &kernel) == 7) {
    features(in, table[kernel], out);
    fwrite(out, sizeof out, 1, stdout);
  }
  return 0;
}
"""


def _operand(ref) -> str:
    kind, what = ref
    if kind == "const":
        return f"({what!r})" if what < 0 else repr(what)
    return {"input": f"in_{what}", "kernel": f"kt[{what}]", "temp": f"t{what}"}[kind]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_exported_c_features_equal_the_numpy_engine_on_3000_problems(space, tmp_path):
    """Every problem and interaction feature, as the exporter prints it (OPS' C spellings
    over compile_program's statements), against the engine; log2 ones by their argument."""
    engine, configs = space["engine"], space["configs"]
    kernels = [0, 7, 20, 33, 41, len(configs) - 1]
    rows = [dict(zip(definition.KERNEL_FEATURES, space["kernel_matrix"][i]))
            for i in kernels]
    formulas = {**definition.PROBLEM_FORMULAS, **definition.INTERACTION_FORMULAS}
    program = compile_program({name: f.graph for name, f in formulas.items()}, rows,
                              engine.hw)
    computed = list(program.outputs)
    statements = "\n".join(
        f"  const double t{s.target} = "
        + OPS[s.op].c_template.format(*(_operand(ref) for ref in s.operands)) + ";"
        for s in program.statements)
    stores = "\n".join(f"  out[{i}] = {_operand(program.outputs[name])};"
                       for i, name in enumerate(computed))
    table = ", ".join("{" + ", ".join(repr(v) for v in row) + "}"
                      for row in program.kernel_table) if program.kernel_table[0] else "{0}"
    source = tmp_path / "features.c"
    source.write_text(DRIVER % {
        "prelude": c_runtime.PRELUDE, "statements": statements, "stores": stores,
        "kernels": len(kernels), "columns": max(1, len(program.kernel_table[0])),
        "table": table, "outputs": len(computed)})
    binary = tmp_path / "features"
    subprocess.run(["gcc", "-std=c99", "-O2", "-march=native", "-o", str(binary),
                    str(source), "-lm"], check=True)

    queries, expected = [], []
    index = {name: engine.feature_names().index(name) for name in formulas}
    for problem in space["problems"]:
        values = " ".join(repr(v) for v in definition.problem_values(problem).values())
        matrix = engine.matrix(problem, [configs[i] for i in kernels],
                               space["kernel_matrix"][kernels])
        for position in range(len(kernels)):
            queries.append(f"{values} {position}")
            expected.append(matrix[position])
    run = subprocess.run([str(binary)], input=("\n".join(queries) + "\n").encode(),
                         capture_output=True, check=True)
    got = np.frombuffer(run.stdout, dtype=np.float64).reshape(len(queries), len(computed))
    expected = np.asarray(expected)
    for column, name in enumerate(computed):
        value = np.log2(got[:, column]) if formulas[name].log2 else got[:, column]
        assert np.array_equal(value, expected[:, index[name]]), name
    # the rest are of the kernels alone (or constant): evaluated by compile_program here
    for name, per_kernel in program.kernel_values.items():
        value = np.log2(per_kernel) if formulas[name].log2 else np.asarray(per_kernel)
        assert np.array_equal(value, np.asarray(expected[:len(kernels), index[name]])), name


def test_the_numpy_form_is_vectorized_over_kernels():
    """A formula of no kernel column is one value; one of a kernel column, one per kernel."""
    evaluator = Evaluator({"flops": definition.PROBLEM_FORMULAS["log2_flops"],
                           "m_tiles": definition.INTERACTION_FORMULAS["log2_m_tiles"]})
    flops, tiles = evaluator.values({"m": 10.0, "n": 2.0, "k": 4.0}, {
        "mr": np.array([1.0, 3.0, 16.0])}, {})
    assert np.ndim(flops) == 0 and flops == np.log2(160.0)
    assert np.array_equal(tiles, np.log2([10.0, 4.0, 1.0]))
