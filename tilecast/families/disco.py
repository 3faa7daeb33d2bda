"""DISCO contraction families on the CPU: `disco_forward` (psi contracted with x) and
`disco_backward` (the transpose contraction, the forward's gradient with respect to x).

A problem is one contraction of a DiscoConvS2-like layer: batch x channels maps of
nlat_in x nlon_in points onto K basis functions (kernel_shape, basis) at nlat_out x nlon_out
points, psi built with grid_in / grid_out / theta_cutoff (basis_norm_mode "mean", which changes
no sparsity), the activations stored as fp32, bf16 or fp16 (computed in float32). The storage
precision is a problem field: one binary serves all three.

A kernel is a row of TILES (direction, variant, ISA -> the register tiles the library
instantiates; tilecast/spaces/disco.py) and a latitude block (latitudes per OpenMP
work item, a run-time argument of the kernels). Variants:

  csr      psi in CSR, one row per basis function; tile BT channels x NV vectors of output
           longitudes (kernels/cpu/disco/disco_csr_variants.hpp), both directions.
  kpacked  the forward with psi in the kpacked layout (tilecast/disco/kpacked.py): one entry per
           neighbour carrying all K basis values; tile KREG basis functions x NV vectors
           (kernels/cpu/disco/disco_kpacked_variants.hpp), in ceil(K / KREG) passes over the
           neighbours where KREG < K. The layout exists only where every basis function has
           the same support (harmonic bases), so kpacked kernels are not applicable
           (`unsupported_reason` says why) to piecewise-linear problems.
  lines    the transpose with psi's transpose regrouped by blocks of LB input lines
           (tilecast/disco/lines.py): one loaded gy slice feeds every line of the block, a zero
           where a line lacks it; its one tile LB lines x NV vectors
           (kernels/cpu/disco/disco_lines_transpose.hpp), no latitude block (lat_block 1). It runs
           any problem; where it pays (the share of non-zeros in its layout, which the
           problem's grids decide) is what the model learns. Bit for bit the csr transpose.

`kernels/cpu/disco/disco_bench.cpp` runs exactly the named tile through the shared harness; the
runtime runs the same tile through the tilecast.disco.native entry RUNTIME names, with
`tile=cfg.tile()`. TILES mirrors the C++ tables (the harness refuses to compile a tile missing
there, and tests/test_disco_family.py checks they agree). Adding a variant is a row of VARIANTS
and TILES, its layout in `prepare`, and its branch in disco_bench.cpp.

The problem (DiscoProblem), the precisions and the bases are in tilecast/spaces/disco.py, which the
feature engine reads too. tilecast.disco (psi, grids, bases, the reference) and torch are
imported inside the functions that build psi or inputs: importing this module (tilecast.families
does, for the dispatcher and the CLI) must not import torch.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tilecast.core.family import (KERNELS_DIR, BuildSpec, FamilyBase, FamilyError,
                                    PreparedProblem, reject_unknown, table_choice)
from tilecast.features.disco import DiscoFeatureEngine
from tilecast.spaces.disco import (BASES, DIRECTIONS, ELEMENT_BYTES, ISA_FLAGS, ISAS,
                                             LAT_BLOCKS, PRECISIONS, TILES, UNUSED_TILE_FIELD,
                                             VARIANTS, DiscoConfig, DiscoProblem, kernel_name,
                                             kernel_size, parse_kernel_name, shape_tuple,
                                             validate_config)

# norm-relative error vs the float64 reference on the same stored inputs: the output is
# rounded to the storage type (bf16 keeps 8 bits, fp16 11)
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}
BASIS_ALIASES = {"piecewise linear": "piecewise_linear"}
NORM_MODE = "mean"
#: input lines per block of the lines variant's layout: its tiles' LB, the kernels'
#: kLineBlock (tests/test_disco_family.py checks both)
LINE_BLOCK = 4


# -- problems (DiscoProblem: tilecast/spaces/disco.py) ---------------------------

_choice = table_choice

REQUIRED_FIELDS = ("channels", "nlat_in", "nlon_in", "nlat_out", "nlon_out")
DEFAULTS = {"batch": 1, "kernel_shape": "3x3", "basis": "harmonic", "grid_in": "equiangular",
            "grid_out": "equiangular", "theta_cutoff": None, "precision": "fp32"}


@functools.lru_cache(maxsize=64)
def _basis_kernel_shape(shape: tuple[int, ...], basis: str) -> str:
    """'AxB' as the basis reads `shape` (cached: building a basis costs tens of ms, and a
    config checks hundreds of problems)."""
    from tilecast.disco.basis import get_basis   # torch: see the module docstring

    basis_obj = get_basis(BASES[basis], shape if len(shape) > 1 else shape[0])
    return "x".join(str(v) for v in basis_obj.kernel_shape)


def _canonical_kernel_shape(value, basis: str) -> str:
    """'AxB' from an int, a sequence or a string ('3', '3x3', '(3, 3)'), as the basis reads it."""
    if isinstance(value, str):
        parts = [p for p in re.split(r"[x,()\[\]\s]+", value.strip()) if p]
    elif isinstance(value, (int, np.integer)):
        parts = [value]
    else:
        parts = list(value)
    try:
        return _basis_kernel_shape(tuple(int(p) for p in parts), basis)
    except (ValueError, TypeError, IndexError) as err:
        raise FamilyError(f"disco problem kernel_shape={value!r} is not valid for basis "
                          f"{basis!r}: {err}") from None


def _integer(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise FamilyError(f"disco problem field {name}={value!r} is not an integer") from None
    if number != float(value) or number < 1:
        raise FamilyError(f"disco problem field {name}={value!r} must be a positive integer")
    return number


def _merged_fields(values: Mapping[str, Any]) -> dict:
    """The given fields (None and NaN: not given) over DEFAULTS; FamilyError naming unknown
    or missing ones."""
    reject_unknown(values, tuple(f.name for f in fields(DiscoProblem)), "disco problem field")
    given = {k: v for k, v in values.items() if v is not None and not (
        isinstance(v, float) and math.isnan(v))}
    missing = [f for f in REQUIRED_FIELDS if f not in given]
    if missing:
        raise FamilyError(f"disco problem is missing field(s) {missing} in {dict(values)}")
    return {**DEFAULTS, **given}


def make_problem(values: Mapping[str, Any]) -> DiscoProblem:
    """A validated DiscoProblem from field values (strings from the CLI, numpy values from a
    dataset); FamilyError names the offending field."""
    from tilecast.disco.grids import GRIDS, default_theta_cutoff   # torch: see the module docstring

    merged = _merged_fields(values)
    sizes = {f: _integer(f, merged[f]) for f in ("batch", *REQUIRED_FIELDS)}
    basis = BASIS_ALIASES.get(str(merged["basis"]), str(merged["basis"]))
    _choice(basis, BASES, "basis", "disco problem")
    grid_in = _choice(str(merged["grid_in"]), GRIDS, "grid_in", "disco problem")
    grid_out = _choice(str(merged["grid_out"]), GRIDS, "grid_out", "disco problem")
    precision = _choice(str(merged["precision"]), PRECISIONS, "precision", "disco problem")
    if sizes["nlon_in"] % sizes["nlon_out"]:
        raise FamilyError(f"disco problem nlon_in={sizes['nlon_in']} must be a multiple of "
                          f"nlon_out={sizes['nlon_out']}")
    for field, grid in (("nlat_in", grid_in), ("nlat_out", grid_out)):
        if grid == "equiangular" and sizes[field] < 2:
            raise FamilyError(f"disco problem {field}={sizes[field]}: the equiangular grid "
                              "needs at least 2 latitudes")
    cutoff = merged["theta_cutoff"]
    if cutoff is None:
        cutoff = default_theta_cutoff(sizes["nlat_out"], grid_out)
    try:
        cutoff = float(f"{float(cutoff):.6g}")
    except (TypeError, ValueError):
        raise FamilyError(f"disco problem theta_cutoff={cutoff!r} is not a number") from None
    if not 0.0 < cutoff <= math.pi:
        raise FamilyError(f"disco problem theta_cutoff={cutoff} must be in (0, pi]")
    return DiscoProblem(batch=sizes["batch"], channels=sizes["channels"],
                        nlat_in=sizes["nlat_in"], nlon_in=sizes["nlon_in"],
                        nlat_out=sizes["nlat_out"], nlon_out=sizes["nlon_out"],
                        kernel_shape=_canonical_kernel_shape(merged["kernel_shape"], basis),
                        basis=basis, grid_in=grid_in, grid_out=grid_out, theta_cutoff=cutoff,
                        precision=precision)


@functools.lru_cache(maxsize=8)
def _psi_and_csr(psi_key: tuple):
    """psi and both CSR layouts for a problem's psi_key (shared by its directions, batches
    and precisions; prepare and flops both need them)."""
    from tilecast.disco.csr import csr_from_psi   # torch: see the module docstring
    from tilecast.disco.psi import compute_psi   # torch: see the module docstring

    nlat_in, nlon_in, nlat_out, nlon_out, kernel_shape, basis, grid_in, grid_out, cutoff = psi_key
    psi = compute_psi((nlat_in, nlon_in), (nlat_out, nlon_out), shape_tuple(kernel_shape),
                      basis_type=BASES[basis], basis_norm_mode=NORM_MODE, grid_in=grid_in,
                      grid_out=grid_out, theta_cutoff=cutoff)
    return psi, csr_from_psi(psi)


@functools.lru_cache(maxsize=8)
def _kpacked(psi_key: tuple):
    """psi's kpacked layout for a psi_key, None where it has none."""
    from tilecast.disco.kpacked import kpack_psi   # torch: see the module docstring

    return kpack_psi(_psi_and_csr(psi_key)[0])


@functools.lru_cache(maxsize=8)
def _lines(psi_key: tuple):
    """psi's transpose regrouped by blocks of the lines tile's LB input lines (every ISA's
    lines tile has the same LB: the layout is the kernel's)."""
    from tilecast.disco.lines import regroup   # torch: see the module docstring

    csr = _psi_and_csr(psi_key)[1]
    return regroup(csr.troff, csr.tcol, csr.tvals, LINE_BLOCK)


@functools.lru_cache(maxsize=1024)
def _has_kpacked(psi_key: tuple) -> bool:
    """Whether psi has the kpacked layout (asked per candidate and problem: kept apart from
    the layouts, which are large)."""
    return _kpacked(psi_key) is not None


# bases whose basis functions share one support, so that psi has the kpacked layout
SHARED_SUPPORT_BASES = ("harmonic",)


def _field_reason(direction: str, cfg: DiscoConfig, problem: DiscoProblem) -> str | None:
    """Why cfg cannot run (or computes padding only) on problem, from the fields alone."""
    if cfg.direction != direction:
        return f"kernel direction {cfg.direction} != family direction {direction}"
    if cfg.bt > problem.bc:
        return (f"channel tile BT={cfg.bt} exceeds batch*channels={problem.bc}: its extra "
                "slots would compute padding only")
    if VARIANTS[cfg.variant].kpacked_layout:
        if problem.basis not in SHARED_SUPPORT_BASES:
            return (f"{cfg.variant} kernels need psi in the kpacked layout, which a "
                    f"{problem.basis} basis lacks (its basis functions' supports differ); "
                    "csr kernels run it")
    return None


def psi_nnz(problem: DiscoProblem) -> int:
    """Entries of the problem's psi (computed once per psi_key)."""
    return _psi_and_csr(problem.psi_key())[0].nnz


def _peer_available() -> bool:
    try:
        from torch_harmonics.disco import optimized_kernels_is_available
        from torch_harmonics.disco.optimized import disco_optimized  # noqa: F401
    except ImportError:
        return False
    return bool(optimized_kernels_is_available())


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class DiscoFamily(FamilyBase):
    """A DISCO contraction family for one direction (see the module docstring)."""
    problem_fields = tuple(f.name for f in fields(DiscoProblem))
    config_fields = tuple(f.name for f in fields(DiscoConfig))
    source = KERNELS_DIR / "cpu" / "disco" / "disco_bench.cpp"

    def __init__(self, direction: str):
        self.direction = _choice(direction, DIRECTIONS, "direction", "DiscoFamily")
        self.name = f"disco_{direction}"

    # -- names ----------------------------------------------------------------------------
    def kernel_name(self, cfg: DiscoConfig) -> str:
        return kernel_name(cfg)

    def parse_name(self, name: str) -> DiscoConfig:
        cfg = parse_kernel_name(name)
        if cfg.direction != self.direction:
            raise FamilyError(f"kernel {name!r} is a {cfg.direction} kernel; family {self.name} "
                              f"holds {self.direction} kernels (use disco_{cfg.direction})")
        return cfg

    # -- candidate space ------------------------------------------------------------------
    CANDIDATE_OPTIONS = ("variant", "isa", "tiles", "lat_block")

    def candidate_space(self, options: Mapping[str, Sequence], hardware: Mapping) -> list[DiscoConfig]:
        """Every TILES row of this direction the options allow (variant, isa: lists of names;
        tiles: 'AxB' strings in each variant's tile-field order, BTxNV for csr, KREGxNV for
        kpacked, LBxNV for lines; lat_block: ints, default LAT_BLOCKS, and 1 alone for the
        variants that take none), sorted. ISAs the hardware's flags (when known) cannot build
        are left out."""
        reject_unknown(options, self.CANDIDATE_OPTIONS, "disco candidate option")
        variants = [_choice(v, VARIANTS, "variant", "candidates") for v in options.get("variant") or VARIANTS]
        isas = [_choice(i, ISAS, "isa", "candidates") for i in options.get("isa") or ISAS]
        flags = set(hardware.get("flags", ()))
        if flags:
            isas = [i for i in isas if ISA_FLAGS[i][0] <= flags and not ISA_FLAGS[i][1] & flags]
        wanted_tiles = None
        if options.get("tiles"):
            wanted_tiles = set()
            for tile in options["tiles"]:
                try:
                    rows, nv = (int(v) for v in str(tile).split("x"))
                except ValueError:
                    raise FamilyError(f"candidate tile {tile!r} is not AxB (BTxNV for csr, "
                                      "KREGxNV for kpacked, LBxNV for lines, e.g. 4x3)") from None
                wanted_tiles.add((rows, nv))
        blocks = [int(b) for b in options.get("lat_block") or LAT_BLOCKS[self.direction]]
        configs = set()
        for variant, isa, lat_block in itertools.product(variants, isas, blocks):
            if not VARIANTS[variant].lat_blocked:
                lat_block = 1
            tile_fields = VARIANTS[variant].tile_fields
            for tile in TILES.get((self.direction, variant, isa), ()):
                if wanted_tiles is None or tile in wanted_tiles:
                    configs.add(validate_config(DiscoConfig(
                        self.direction, variant, isa, lat_block=lat_block,
                        **{**UNUSED_TILE_FIELD, **dict(zip(tile_fields, tile))})))
        return sorted(configs)

    def build_spec(self, cfg: DiscoConfig) -> BuildSpec:
        validate_config(cfg)
        return BuildSpec(source=self.source, defines={
            "TC_DISCO_DIR": DIRECTIONS[cfg.direction],
            "TC_DISCO_VARIANT": VARIANTS[cfg.variant].code, "TC_DISCO_ISA": ISAS[cfg.isa],
            "TC_BT": cfg.bt, "TC_KREG": cfg.kreg, "TC_LB": cfg.lb, "TC_NV": cfg.nv,
            "TC_LAT_BLOCK": cfg.lat_block})

    # -- problems -------------------------------------------------------------------------
    def problem(self, values: Mapping[str, Any]) -> DiscoProblem:
        return make_problem(values)

    def dims_key(self, problem: DiscoProblem) -> str:
        """Every problem field: the join key and the CV group."""
        return ",".join(f"{f}={getattr(problem, f):g}" if f == "theta_cutoff"
                        else f"{f}={getattr(problem, f)}" for f in self.problem_fields)

    def applicable(self, cfg: DiscoConfig, problem: DiscoProblem) -> bool:
        """Same direction, a channel tile no wider than batch * channels (a wider one computes
        only padding in its extra slots), and for kpacked kernels a basis with the layout and
        K <= KREG, so that a dispatcher never picks a kernel that cannot run or wastes work.
        Read from the problem's fields alone: no psi is built at dispatch time."""
        return _field_reason(self.direction, cfg, problem) is None

    def applicability_key(self, problem: DiscoProblem):
        """What `applicable` reads of a problem (the widest tile is 8 channels)."""
        return min(problem.bc, 8), problem.kernel_size, problem.basis

    def unsupported_reason(self, cfg: DiscoConfig, problem: DiscoProblem) -> str | None:
        """Why cfg cannot (or should not) run on problem, None if it can: the reasons behind
        `applicable`, then, for kpacked kernels, whether this problem's psi has the layout."""
        reason = _field_reason(self.direction, cfg, problem)
        if reason is None and VARIANTS[cfg.variant].kpacked_layout \
                and not _has_kpacked(problem.psi_key()):
            reason = ("psi of this problem has no kpacked layout (tilecast.disco.kpacked."
                      "kpack_psi: its basis functions' supports differ, or it has no entries)")
        return reason

    def slices(self, problem: DiscoProblem) -> tuple[str, ...]:
        """Report slices: resampling (same / down / up), precision, basis, narrow channels."""
        if (problem.nlat_in, problem.nlon_in) == (problem.nlat_out, problem.nlon_out):
            tags = ["same_grid"]
        elif problem.nlat_in >= problem.nlat_out and problem.nlon_in >= problem.nlon_out:
            tags = ["downsample"]
        else:
            tags = ["upsample"]
        tags += [problem.precision, problem.basis]
        if problem.bc < 8:
            tags.append("few_channels")
        return tuple(tags)

    def flops(self, problem: DiscoProblem) -> float:
        """2 * B*C * nnz(psi) * nlon_out: each entry meets every output longitude once."""
        return 2.0 * problem.bc * psi_nnz(problem) * problem.nlon_out

    def bytes_moved(self, problem: DiscoProblem) -> float:
        p, elt = problem, ELEMENT_BYTES[problem.precision]
        activations = p.bc * (p.nlat_in * p.nlon_in + p.kernel_size * p.nlat_out * p.nlon_out)
        return float(elt * activations + 12 * psi_nnz(problem))

    def operand_bytes(self, values: Mapping[str, Any]) -> int:
        """Bytes a measurement of the problem holds at once: the input in its storage
        precision, the float32 output and its float64 reference (psi, whose size takes psi
        itself, is left out). From the fields alone, without the grids' quadratures that
        building the problem computes: an oversized problem is refused before them."""
        merged = _merged_fields(values)
        sizes = {f: _integer(f, merged[f]) for f in ("batch", *REQUIRED_FIELDS)}
        basis = BASIS_ALIASES.get(str(merged["basis"]), str(merged["basis"]))
        _choice(basis, BASES, "basis", "disco problem")
        precision = _choice(str(merged["precision"]), PRECISIONS, "precision", "disco problem")
        kernels = kernel_size(basis, _canonical_kernel_shape(merged["kernel_shape"], basis))
        points_in = sizes["nlat_in"] * sizes["nlon_in"]
        points_out = kernels * sizes["nlat_out"] * sizes["nlon_out"]
        stored, produced = ((points_in, points_out) if self.direction == "forward"
                            else (points_out, points_in))
        return sizes["batch"] * sizes["channels"] * (ELEMENT_BYTES[precision] * stored
                                                     + (4 + 8) * produced)

    def tolerance(self, problem: DiscoProblem) -> float:
        return TOLERANCE[problem.precision]

    # -- inputs, reference, peer ----------------------------------------------------------
    def prepare(self, problem: DiscoProblem, directory: Path, seed: int) -> PreparedProblem:
        """Write psi's CSR (transposed for the backward), for the forward also its kpacked
        layout where it has one (the job line's <nbr> <kpad> <kp_offset> <kp_idx> <kp_vals>,
        `0 0 - - -` without), for the backward also its line-blocked layout (<keys> <boff>
        <bcol> <bvals>), and the input in its storage precision; the reference is
        tilecast.disco.reference in float64 on the stored values."""
        import torch   # torch: see the module docstring

        from tilecast.disco import reference   # torch: see the module docstring

        p = problem
        psi, csr = _psi_and_csr(p.psi_key())
        dtype = getattr(torch, _TORCH_DTYPES[p.precision])
        gen = torch.Generator().manual_seed(seed)
        if self.direction == "forward":
            shape = (p.batch, p.channels, p.nlat_in, p.nlon_in)
            stored = torch.randn(*shape, generator=gen).to(dtype)
            expected = reference.disco_contraction(stored.double(), psi, p.nlon_out)
            offsets, columns, values = csr.roff, csr.col, csr.vals
        else:
            shape = (p.batch, p.channels, psi.kernel_size, p.nlat_out, p.nlon_out)
            stored = torch.randn(*shape, generator=gen).to(dtype)
            expected = reference.disco_transpose_contraction(stored.double(), psi, p.nlon_in)
            offsets, columns, values = csr.troff, csr.tcol, csr.tvals
        directory.mkdir(parents=True, exist_ok=True)
        paths = {name: directory / f"{name}.bin"
                 for name in ("offsets", "columns", "values", "in", "out")}
        offsets.numpy().tofile(paths["offsets"])
        columns.numpy().tofile(paths["columns"])
        values.numpy().tofile(paths["values"])
        raw = stored if dtype == torch.float32 else stored.view(torch.int16)
        raw.contiguous().numpy().tofile(paths["in"])
        layout = (self._write_kpacked(p, directory) if self.direction == "forward"
                  else self._write_lines(p, directory))
        job = (p.precision, str(p.bc), str(p.nlat_in), str(p.nlon_in), str(psi.kernel_size),
               str(p.nlat_out), str(p.nlon_out), str(int(columns.numel())),
               *(str(paths[n]) for n in ("offsets", "columns", "values")), *layout,
               str(paths["in"]), str(paths["out"]))
        return PreparedProblem(problem=p, job_args=job, output_path=paths["out"],
                               reference=expected.numpy(), tensors={"input": stored})

    @staticmethod
    def _write_kpacked(problem: DiscoProblem, directory: Path) -> tuple[str, ...]:
        """psi's kpacked layout as files, and its job tokens: (nbr, kpad, offset, idx, vals)
        paths; ('0', '0', '-', '-', '-') where psi has no such layout."""
        packed = _kpacked(problem.psi_key())
        if packed is None:
            return ("0", "0", "-", "-", "-")
        paths = []
        for name, tensor in (("offset", packed.offset), ("idx", packed.idx), ("vals", packed.vals)):
            paths.append(directory / f"kpacked_{name}.bin")
            tensor.contiguous().numpy().tofile(paths[-1])
        return (str(packed.idx.shape[0]), str(packed.k_pad), *map(str, paths))

    @staticmethod
    def _write_lines(problem: DiscoProblem, directory: Path) -> tuple[str, ...]:
        """psi's transpose in the line-blocked layout as files, and its job tokens: (keys,
        boff, bcol, bvals) paths."""
        layout = _lines(problem.psi_key())
        paths = []
        for name, tensor in zip(("boff", "bcol", "bvals"), layout.tensors()):
            paths.append(directory / f"lines_{name}.bin")
            tensor.contiguous().numpy().tofile(paths[-1])
        return (str(int(layout.bcol.numel())), *map(str, paths))

    def has_peer(self) -> bool:
        """Whether the peer (torch-harmonics' optimized CPU contraction) can run here."""
        return _peer_available()

    def peer(self, prepared: PreparedProblem, threads: int):
        """torch-harmonics' optimized CPU contraction of this direction on the same stored
        input and psi, with the same thread count: (name, callable)."""
        import torch   # torch, and the optional torch_harmonics: see the module docstring
        from torch_harmonics.disco.optimized.disco_optimized import (
            _disco_s2_contraction_optimized, _disco_s2_transpose_contraction_optimized)

        torch.set_num_threads(threads)
        p = prepared.problem
        psi, _ = _psi_and_csr(p.psi_key())
        # torch-harmonics' psi layout is tilecast's: CSR over (kernel, output latitude) rows
        th_psi = (psi.roff, psi.idx[0], psi.idx[1], psi.idx[2], psi.vals.float())
        stored = prepared.tensors["input"]
        if self.direction == "forward":
            return "torch_harmonics.disco_s2_contraction", lambda: _disco_s2_contraction_optimized(
                stored, *th_psi, psi.kernel_size, p.nlat_out, p.nlon_out)
        return ("torch_harmonics.disco_s2_transpose_contraction",
                lambda: _disco_s2_transpose_contraction_optimized(
                    stored, *th_psi, psi.kernel_size, p.nlat_in, p.nlon_in))

    def feature_engine(self, hardware: Mapping):
        return DiscoFeatureEngine(hardware)
