"""GEMM family: C = A * B on the CPU, fp32 (or bf16 inputs, fp32 accumulation), A and B each
row- or column-major. Kernels are `kernels/cpu/gemm/gemm.cpp` compiled with -D parameters."""
from __future__ import annotations

import ctypes
import itertools
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from tilecast.core.family import (KERNELS_DIR, BuildSpec, FamilyBase, FamilyError,
                                    PreparedProblem, SharedUnit, integer_field, library_timer,
                                    reject_unknown, table_choice)
from tilecast.features.gemm import GemmFeatureEngine
from tilecast.spaces.gemm import DTYPES, ISAS, LAYOUTS, PARALLEL, Dtype, Isa  # noqa: F401


@dataclass(frozen=True, order=True)
class MicroKernel:
    """One registered micro-kernel: an MR x NR register tile of one ISA. Its code is the
    template of kernels/cpu/gemm/gemm_microkernel.hpp, compiled with -DTC_MR/-DTC_NR."""
    isa: str
    mr: int
    nr: int


# The single source of truth for micro-kernels: a variant is valid only with a tile of its
# ISA from this table, one row per tile (adding a row adds the tile to every candidate space,
# name, build and feature). Each row must obey micro_tile_reason (gemm_config.hpp's rules).
MICRO_KERNELS: tuple[MicroKernel, ...] = (
    MicroKernel("avx512", 14, 32), MicroKernel("avx512", 8, 32), MicroKernel("avx512", 6, 48),
    MicroKernel("avx512", 4, 64), MicroKernel("avx512", 6, 32), MicroKernel("avx512", 16, 16),
    MicroKernel("avx2", 6, 16), MicroKernel("avx2", 4, 24), MicroKernel("avx2", 8, 8),
)


def micro_tiles(isa: str) -> tuple[tuple[int, int], ...]:
    """The (MR, NR) tiles MICRO_KERNELS registers for `isa`, in table order."""
    return tuple((row.mr, row.nr) for row in MICRO_KERNELS if row.isa == isa)


def micro_tile_reason(isa: str, mr: int, nr: int) -> str | None:
    """Why an MR x NR tile cannot compile for `isa` (kernels/cpu/gemm/gemm_config.hpp's checks:
    NR a multiple of the vector width; accumulators + one B row + one A broadcast fit the
    registers, else they spill), or None."""
    unit = ISAS[isa]
    if mr < 1 or nr < 1 or nr % unit.vector_floats:
        return f"nr={nr} must be a positive multiple of the {isa} vector width {unit.vector_floats}"
    vectors = nr // unit.vector_floats
    if mr * vectors + vectors + 1 > unit.registers:
        return (f"{mr}x{nr} needs {mr * vectors + vectors + 1} {isa} vector registers "
                f"(mr*nr/width + nr/width + 1), more than its {unit.registers}")
    return None


NAME_RE = re.compile(
    r"^gemm_(?P<dtype>[a-z0-9]+)_(?P<isa>[a-z0-9]+)_(?P<mr>\d+)x(?P<nr>\d+)"
    r"_mc(?P<mc>\d+)_nc(?P<nc>\d+)_kc(?P<kc>\d+)_par(?P<parallel>[a-z]+)"
    r"_pa(?P<pack_a>[01])_pf(?P<prefetch>[01])$")
NAME_GRAMMAR = "gemm_{dtype}_{isa}_{mr}x{nr}_mc{mc}_nc{nc}_kc{kc}_par{m|n|k}_pa{0|1}_pf{0|1}"
# a problem's A, B and C (fp32) at most this many bytes: beyond it no machine holds one, and
# the features' byte counts would leave int64 (`features.gemm`, the native scorer)
MAX_OPERAND_BYTES = 2 ** 48
CANDIDATE_OPTIONS = ("dtype", "isa", "tiles", "mc", "nc", "kc", "parallel", "pack_a", "prefetch")


@dataclass(frozen=True, order=True)
class GemmConfig:
    """Every compile-time parameter of one GEMM kernel binary."""
    dtype: str
    isa: str
    mr: int
    nr: int
    mc: int
    nc: int
    kc: int
    parallel: str
    pack_a: bool
    prefetch: bool


@dataclass(frozen=True, order=True)
class GemmProblem:
    """C[m, n] = A[m, k] * B[k, n] with the operands' storage layouts."""
    m: int
    n: int
    k: int
    dtype: str = "fp32"
    layout_a: str = "row"
    layout_b: str = "row"


_choice = table_choice


def validate_config(cfg: GemmConfig) -> GemmConfig:
    """Raise FamilyError naming the offending field when cfg is not a valid variant."""
    ctx = f"GEMM config {cfg}"
    _choice(cfg.dtype, DTYPES, "dtype", ctx)
    _choice(cfg.isa, ISAS, "isa", ctx)
    _choice(cfg.parallel, PARALLEL, "parallel scheme", ctx)
    tiles = micro_tiles(cfg.isa)
    if (cfg.mr, cfg.nr) not in tiles:
        valid = ", ".join(f"{m}x{n}" for m, n in tiles)
        raise FamilyError(f"micro-tile {cfg.mr}x{cfg.nr} is not valid for {cfg.isa}; valid: {valid} "
                          "(a new tile is one MicroKernel row in MICRO_KERNELS)")
    reason = micro_tile_reason(cfg.isa, cfg.mr, cfg.nr)
    if reason:
        raise FamilyError(f"micro-tile row MicroKernel({cfg.isa!r}, {cfg.mr}, {cfg.nr}) of "
                          f"MICRO_KERNELS cannot compile: {reason}")
    if cfg.mc < cfg.mr or cfg.mc % cfg.mr:
        raise FamilyError(f"mc={cfg.mc} must be a positive multiple of mr={cfg.mr}")
    if cfg.nc < cfg.nr or cfg.nc % cfg.nr:
        raise FamilyError(f"nc={cfg.nc} must be a positive multiple of nr={cfg.nr}")
    if cfg.kc < 1:
        raise FamilyError(f"kc={cfg.kc} must be positive")
    if cfg.dtype == "bf16" and not cfg.pack_a:
        raise FamilyError("bf16 kernels convert A while packing: pack_a must be 1")
    return cfg


SKINNY_SOURCE = KERNELS_DIR / "cpu" / "gemm" / "gemm_skinny.cpp"


def skinny_unit(dtype: str, isa: str, parallel: str, prefetch: bool) -> SharedUnit:
    """The GEMV-class path (kernels/cpu/gemm/gemm_skinny.cpp) for the GEMM variants of one
    dtype, ISA, parallel scheme and prefetch: all it depends on of a variant. GEMM variants
    and the grouped-conv pipelines that run GEMMs on this library link the same object."""
    defines = {"TC_DTYPE": DTYPES[dtype].code, "TC_ISA": ISAS[isa].code,
               "TC_PAR": PARALLEL[parallel], "TC_PREFETCH": int(prefetch)}
    return SharedUnit(SKINNY_SOURCE, defines,
                      f"gemm_skinny_{dtype}_{isa}_par{parallel}_pf{int(prefetch)}")


class GemmFamily(FamilyBase):
    """The GEMM family (see the module docstring)."""
    name = "gemm"
    problem_fields = tuple(f.name for f in fields(GemmProblem))
    config_fields = tuple(f.name for f in fields(GemmConfig))
    CANDIDATE_OPTIONS = CANDIDATE_OPTIONS
    source = KERNELS_DIR / "cpu" / "gemm" / "gemm.cpp"
    library_source = KERNELS_DIR / "cpu" / "gemm" / "gemm_lib.cpp"
    unit = KERNELS_DIR / "cpu" / "gemm" / "gemm_variant.cpp"   # both, compiled once
    skinny_source = SKINNY_SOURCE   # the GEMV-class path, linked beside the unit (skinny_unit)

    # -- names --------------------------------------------------------------------------
    def kernel_name(self, cfg: GemmConfig) -> str:
        """The unique name of a variant; parse_name(kernel_name(cfg)) == cfg."""
        validate_config(cfg)
        return (f"gemm_{cfg.dtype}_{cfg.isa}_{cfg.mr}x{cfg.nr}_mc{cfg.mc}_nc{cfg.nc}"
                f"_kc{cfg.kc}_par{cfg.parallel}_pa{int(cfg.pack_a)}_pf{int(cfg.prefetch)}")

    def parse_name(self, name: str) -> GemmConfig:
        """Parse a kernel name; FamilyError says what is wrong and the grammar expected."""
        match = NAME_RE.match(name)
        if not match:
            raise FamilyError(f"not a GEMM kernel name: {name!r}; expected {NAME_GRAMMAR}")
        g = match.groupdict()
        _choice(g["dtype"], DTYPES, "dtype", f"kernel name {name!r}")
        _choice(g["isa"], ISAS, "isa", f"kernel name {name!r}")
        _choice(g["parallel"], PARALLEL, "parallel scheme", f"kernel name {name!r}")
        cfg = GemmConfig(dtype=g["dtype"], isa=g["isa"], mr=int(g["mr"]), nr=int(g["nr"]),
                         mc=int(g["mc"]), nc=int(g["nc"]), kc=int(g["kc"]),
                         parallel=g["parallel"], pack_a=g["pack_a"] == "1",
                         prefetch=g["prefetch"] == "1")
        try:
            return validate_config(cfg)
        except FamilyError as err:
            raise FamilyError(f"invalid kernel name {name!r}: {err}") from None

    # -- candidate space ----------------------------------------------------------------
    def candidate_space(self, options: Mapping[str, Sequence], hardware: Mapping) -> list[GemmConfig]:
        """Every valid variant the options allow on this hardware, deduplicated and sorted.
        mc/nc values are targets rounded down to a multiple of the tile (at least one tile)."""
        reject_unknown(options, CANDIDATE_OPTIONS, "GEMM candidate option")
        flags = set(hardware.get("flags", ()))
        dtypes = [_choice(d, DTYPES, "dtype", "candidates") for d in options.get("dtype", ["fp32"])]
        isas = [_choice(i, ISAS, "isa", "candidates") for i in options.get("isa", list(ISAS))]
        configs = set()
        for dtype, isa in itertools.product(dtypes, isas):
            needs = ISAS[isa].flags + DTYPES[dtype].flags
            if flags and not set(needs) <= flags:
                continue  # the CPU cannot run it; never build what cannot run
            registered = micro_tiles(isa)
            tiles = options.get("tiles") or [f"{m}x{n}" for m, n in registered]
            for tile, mc, nc, kc, par, pack_a, pf in itertools.product(
                    tiles, options.get("mc", [128]), options.get("nc", [1024]),
                    options.get("kc", [256]), options.get("parallel", list(PARALLEL)),
                    options.get("pack_a", [True]), options.get("prefetch", [True])):
                mr, nr = (int(v) for v in str(tile).split("x"))
                if (mr, nr) not in registered:
                    continue
                cfg = GemmConfig(dtype, isa, mr, nr, max(mr, int(mc) // mr * mr),
                                 max(nr, int(nc) // nr * nr), int(kc), str(par),
                                 bool(pack_a), bool(pf))
                if dtype == "bf16" and not cfg.pack_a:
                    continue
                configs.add(validate_config(cfg))
        return sorted(configs)

    def build_spec(self, cfg: GemmConfig) -> BuildSpec:
        validate_config(cfg)
        defines = {
            "TC_DTYPE": DTYPES[cfg.dtype].code, "TC_ISA": ISAS[cfg.isa].code, "TC_MR": cfg.mr,
            "TC_NR": cfg.nr, "TC_MC": cfg.mc, "TC_NC": cfg.nc, "TC_KC": cfg.kc,
            "TC_PACK_A": int(cfg.pack_a), "TC_PAR": PARALLEL[cfg.parallel],
            "TC_PREFETCH": int(cfg.prefetch)}
        return BuildSpec(source=self.source, defines=defines,
                         library_source=self.library_source, unit=self.unit,
                         shared_units=(skinny_unit(cfg.dtype, cfg.isa, cfg.parallel,
                                                   cfg.prefetch),))

    # -- problems -----------------------------------------------------------------------
    def problem(self, values: Mapping[str, Any]) -> GemmProblem:
        """A GemmProblem from a mapping (config entry, CLI `k=v` pairs, parquet row)."""
        reject_unknown(values, self.problem_fields, "GEMM problem field")
        missing = [f for f in ("m", "n", "k") if f not in values]
        if missing:
            raise FamilyError(f"GEMM problem is missing field(s) {missing} in {dict(values)}")
        dims = {f: integer_field("GEMM problem", f, values[f], minimum=1) for f in ("m", "n", "k")}
        m, n, k = dims["m"], dims["n"], dims["k"]
        operand_bytes = 4 * (m * k + k * n + m * n)
        if operand_bytes > MAX_OPERAND_BYTES:
            raise FamilyError(f"GEMM problem m={m}, n={n}, k={k}: its operands take "
                              f"{operand_bytes:.3g} bytes, beyond any machine (at most "
                              f"{MAX_OPERAND_BYTES:.3g}: 256 TiB)")
        dtype = _choice(str(values.get("dtype", "fp32")), DTYPES, "dtype", "GEMM problem")
        la = _choice(str(values.get("layout_a", "row")), LAYOUTS, "layout_a", "GEMM problem")
        lb = _choice(str(values.get("layout_b", "row")), LAYOUTS, "layout_b", "GEMM problem")
        return GemmProblem(dims["m"], dims["n"], dims["k"], dtype, la, lb)

    def applicable(self, cfg: GemmConfig, problem: GemmProblem) -> bool:
        """Whether the variant is a candidate for the problem at all (same input dtype)."""
        return cfg.dtype == problem.dtype

    def applicability_key(self, problem: GemmProblem):
        """What `applicable` reads of a problem: equal keys, equal candidate masks (lets the
        dispatcher compute a mask once per key instead of once per query)."""
        return problem.dtype

    def unsupported_reason(self, cfg: GemmConfig, problem: GemmProblem) -> str | None:
        if cfg.dtype != problem.dtype:
            return f"kernel dtype {cfg.dtype} != problem dtype {problem.dtype}"
        return None  # every GEMM variant handles every shape (edges are padded)

    def slices(self, problem: GemmProblem) -> tuple[str, ...]:
        """Report slices the problem belongs to (per-slice results in the report)."""
        dims = (problem.m, problem.n, problem.k)
        tags = ["skinny" if min(problem.m, problem.n) <= 16 else "wide"]
        if any(d & (d - 1) for d in dims):
            tags.append("non_pow2")
        if "col" in (problem.layout_a, problem.layout_b):
            tags.append("col_major")
        return tuple(tags)

    def flops(self, problem: GemmProblem) -> float:
        return 2.0 * problem.m * problem.n * problem.k

    def bytes_moved(self, problem: GemmProblem) -> float:
        elt = DTYPES[problem.dtype].element_bytes
        return float(elt * (problem.m * problem.k + problem.k * problem.n) + 4 * problem.m * problem.n)

    def operand_bytes(self, values: Mapping[str, Any]) -> int:
        """Bytes a measurement of the problem holds at once: A and B as stored, C in fp32 and
        its float64 reference (FamilyError as `problem` for bad fields)."""
        p = self.problem(values)
        return DTYPES[p.dtype].element_bytes * (p.m * p.k + p.k * p.n) + (4 + 8) * p.m * p.n

    def tolerance(self, problem: GemmProblem) -> float:
        return DTYPES[problem.dtype].tolerance

    # -- inputs, reference, peer --------------------------------------------------------
    def prepare(self, problem: GemmProblem, directory: Path, seed: int) -> PreparedProblem:
        """Write A and B in their layouts, compute the float64 torch reference."""
        import torch   # only preparing a problem needs torch: the family table stays light

        directory.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(problem.m, problem.k, generator=gen)
        b = torch.randn(problem.k, problem.n, generator=gen)
        if problem.dtype == "bf16":
            a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        reference = torch.matmul(a.double(), b.double()).numpy()
        stored_a = a if problem.layout_a == "row" else a.t().contiguous()
        stored_b = b if problem.layout_b == "row" else b.t().contiguous()
        paths = {"a": directory / "a.bin", "b": directory / "b.bin", "c": directory / "c.bin"}
        for key, tensor in (("a", stored_a), ("b", stored_b)):
            raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
            raw.numpy().tofile(paths[key])
        # the peer sees the same operands in the same layouts (a transposed view for col)
        peer_a = stored_a if problem.layout_a == "row" else stored_a.t()
        peer_b = stored_b if problem.layout_b == "row" else stored_b.t()
        job = (str(problem.m), str(problem.n), str(problem.k), problem.layout_a,
               problem.layout_b, str(paths["a"]), str(paths["b"]), str(paths["c"]))
        return PreparedProblem(problem=problem, job_args=job, output_path=paths["c"],
                               reference=reference, tensors={"a": peer_a, "b": peer_b})

    def output_tensor(self, prepared: PreparedProblem):
        """C for the interleaved protocol: float32 m x n, shared by a problem's candidates."""
        import torch   # only preparing a problem needs torch: the family table stays light

        return torch.empty(prepared.problem.m, prepared.problem.n, dtype=torch.float32)

    def timer(self, library: Path, prepared: PreparedProblem, threads: int, output):
        """time(reps) -> seconds per call, for the interleaved protocol (tilecast.measurement.interleave):
        the variant's in-process library (`tilecast_gemm_time`: `reps` calls on one
        workspace) on the prepared operands, writing C into `output`."""
        entry = ctypes.CDLL(str(library)).tilecast_gemm_time
        index, pointer = ctypes.c_longlong, ctypes.c_void_p
        entry.argtypes = [pointer, index, index, pointer, index, index, pointer, index, index,
                          index, index, ctypes.c_int, ctypes.c_int,
                          ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, index]
        entry.restype = ctypes.c_int
        p = prepared.problem
        a, b = prepared.tensors["a"], prepared.tensors["b"]
        return library_timer(entry, (a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(),
                                     b.stride(0), b.stride(1), output.data_ptr(), p.n, p.m, p.n,
                                     p.k), threads, owners=(a, b, output))

    def peer(self, prepared: PreparedProblem, threads: int):
        """torch.matmul on the same operands with the same thread count: (name, callable),
        measured with the same protocol."""
        import torch   # only preparing a problem needs torch: the family table stays light

        torch.set_num_threads(threads)
        a, b = prepared.tensors["a"], prepared.tensors["b"]
        out = torch.empty(prepared.problem.m, prepared.problem.n, dtype=a.dtype)
        return "torch.matmul", lambda: torch.matmul(a, b, out=out)

    def feature_engine(self, hardware: Mapping):
        return GemmFeatureEngine(hardware)


FAMILY = GemmFamily()
