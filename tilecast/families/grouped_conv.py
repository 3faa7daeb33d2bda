"""Grouped-convolution families (forward, bwd_data, bwd_weight; 2D and 3D), fp32 on the CPU.

Layouts (as in the seed): input NDHWGC, weight GKZYXC, output NDHWGK, with C and K per group;
a 2D problem has Di = Z = 1, stride_d = dilation_d = 1 and pad_d = 0. Kernels are
`kernels/cpu/grouped_conv/grouped_conv.cpp` compiled with -D parameters. One `GroupedConvFamily` per
direction is registered; they share this module's tables and those of the kernel space.

Two kernel-name flavours are read by one parser driven by `NAME_FLAVOURS`
(tilecast/spaces/grouped_conv.py, with the table of valid variants): tilecast's own
variants (`GroupedConvConfig`) and the CK tile engine's (`TileEngineConvConfig`), whose
benchmark CSVs `tilecast.stages.convert_ck` imports. Only tilecast's own variants can be built.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tilecast.core import hardware
from tilecast.core.family import (KERNELS_DIR, BuildSpec, FamilyBase, FamilyError, PreparedProblem,
                                    SharedUnit, integer_field, library_timer, reject_unknown,
                                    table_choice)
from tilecast.families.gemm import skinny_unit
from tilecast.features.grouped_conv import GroupedConvFeatureEngine
from tilecast.spaces.grouped_conv import (DIRECTIONS, DTYPES, GEMM_PIPELINES, NDIMS,
                                                    PIPELINE_VARIANTS, PIPELINES, REQUIRED_FLAGS,
                                                    TILE_ENGINE_DTYPES, WAVE_MODES,
                                                    GroupedConvConfig, kernel_name,
                                                    parse_kernel_name, validate_config)

TOLERANCE = {"fp32": 1e-4}   # norm-relative error vs a float64 torch reference
ELEMENT_BYTES = 4


@dataclass(frozen=True, order=True)
class GroupedConvProblem:
    """One grouped convolution; C and K are channels per group, Do/Ho/Wo derived."""
    direction: str
    dtype: str
    ndim: int
    N: int
    G: int
    C: int
    K: int
    Di: int
    Hi: int
    Wi: int
    Z: int
    Y: int
    X: int
    stride_d: int
    stride_h: int
    stride_w: int
    pad_d: int
    pad_h: int
    pad_w: int
    dilation_d: int
    dilation_h: int
    dilation_w: int

    def output_dims(self) -> tuple[int, int, int]:
        """(Do, Ho, Wo); a value below 1 means an empty output (see unsupported_reason)."""
        return tuple((size + 2 * pad - dil * (k - 1) - 1) // stride + 1
                     for size, pad, dil, k, stride in self._axes())

    def is_depthwise(self) -> bool:
        return self.C == 1 and self.K == 1

    def is_winograd(self) -> bool:
        """A 2D 3x3 layer with stride 1 and dilation 1: what the winograd pipeline runs."""
        return (self.ndim == 2 and self.Y == self.X == 3 and self.stride_h == self.stride_w == 1
                and self.dilation_h == self.dilation_w == 1)

    def _axes(self):
        return ((self.Di, self.pad_d, self.dilation_d, self.Z, self.stride_d),
                (self.Hi, self.pad_h, self.dilation_h, self.Y, self.stride_h),
                (self.Wi, self.pad_w, self.dilation_w, self.X, self.stride_w))


# -- problems ----------------------------------------------------------------------------

_choice = table_choice

# The shape tokens of a job line, in the kernel's order (the three file paths follow).
# floats past each tensor of the interleaved protocol's in-process calls (the kernels read up
# to FloatBuffer::kSlack there; checked against the library when it is loaded)
IN_PROCESS_SLACK = 64
JOB_FIELDS = ("N", "G", "C", "K", "Di", "Hi", "Wi", "Z", "Y", "X", "stride_d", "stride_h",
              "stride_w", "pad_d", "pad_h", "pad_w", "dilation_d", "dilation_h", "dilation_w")
SPATIAL_D_DEFAULTS = {"Di": 1, "Z": 1, "stride_d": 1, "pad_d": 0, "dilation_d": 1}
OPTIONAL_DEFAULTS = {"N": 1, "G": 1, "stride_h": 1, "stride_w": 1, "pad_h": 0, "pad_w": 0,
                     "dilation_h": 1, "dilation_w": 1}
REQUIRED_FIELDS = ("C", "K", "Hi", "Wi", "Y", "X")
NONNEGATIVE_FIELDS = ("pad_d", "pad_h", "pad_w")


def make_problem(values: Mapping[str, Any], direction: str) -> GroupedConvProblem:
    """Validate a mapping (config entry, CLI `k=v`, parquet row) into a GroupedConvProblem.
    ndim defaults to 3 when any depth field is given, else 2; a 2D problem's depth fields
    must be trivial (Di = Z = 1, stride_d = dilation_d = 1, pad_d = 0)."""
    reject_unknown(values, tuple(f.name for f in fields(GroupedConvProblem)),
                   "grouped-conv problem field")
    given = {k: v for k, v in values.items() if v is not None}
    if str(given.get("direction", direction)) != direction:
        raise FamilyError(f"problem direction {given['direction']!r} != family direction "
                          f"{direction!r}; use family grouped_conv_{given['direction']}")
    dtype = _choice(str(given.get("dtype", "fp32")), TILE_ENGINE_DTYPES, "dtype", "grouped-conv problem")
    missing = [f for f in REQUIRED_FIELDS if f not in given]
    depth_given = any(f in given for f in ("Di", "Z"))
    ndim = integer_field("grouped-conv problem", "ndim", given.get("ndim", 3 if depth_given else 2))
    _choice(ndim, NDIMS, "ndim", "grouped-conv problem")
    if ndim == 3:
        missing += [f for f in ("Di", "Z") if f not in given]
    if missing:
        raise FamilyError(f"grouped-conv problem is missing field(s) {missing} in {dict(values)}")
    dims = {f: integer_field("grouped-conv problem", f, given.get(f, default),
                             minimum=0 if f in NONNEGATIVE_FIELDS else 1)
            for f, default in {**SPATIAL_D_DEFAULTS, **OPTIONAL_DEFAULTS,
                               **{r: None for r in REQUIRED_FIELDS}}.items()}
    if ndim == 2:
        for f, trivial in SPATIAL_D_DEFAULTS.items():
            if dims[f] != trivial:
                raise FamilyError(f"2D grouped-conv problem has {f}={dims[f]}; a 2D problem "
                                  f"needs {f}={trivial} (set ndim=3 for a 3D convolution)")
    return GroupedConvProblem(direction=direction, dtype=dtype, ndim=ndim,
                              **{f: dims[f] for f in JOB_FIELDS})


def geometry_reason(p: GroupedConvProblem) -> str | None:
    """Why no kernel can run this problem's geometry, or None."""
    for axis, (size, pad, dil, k, _), out in zip("dhw", p._axes(), p.output_dims()):
        extent = dil * (k - 1) + 1
        if pad > extent:
            return f"pad_{axis}={pad} exceeds the filter extent {extent} (dilation*(size-1)+1)"
        if out < 1:
            return f"empty output along {axis}: input {size} + 2*pad {pad} < filter extent {extent}"
    return None


# -- tensor layouts ----------------------------------------------------------------------
# torch holds (N, G*C, D, H, W) / (G*K, C, Z, Y, X); the kernels NDHWGC / GKZYXC / NDHWGK.

def _to_ndhwgc(t, groups: int):
    n, gc, *spatial = t.shape
    grouped = t.reshape(n, groups, gc // groups, *spatial)
    order = (0, *range(3, 3 + len(spatial)), 1, 2)
    return grouped.permute(order).contiguous()


def _to_gkzyxc(w, groups: int):
    gk, c, *spatial = w.shape
    grouped = w.reshape(groups, gk // groups, c, *spatial)
    order = (0, 1, *range(3, 3 + len(spatial)), 2)
    return grouped.permute(order).contiguous()


@dataclass(frozen=True)
class _Direction:
    """What one direction reads and writes: (in1, in2, out) as torch tensor keys, the output's
    kernel layout, and which argument of convolution_backward the peer asks for."""
    operands: tuple[str, str, str]
    output_layout: Callable
    output_mask: tuple[bool, bool, bool] | None


DIRECTION_IO = {
    "forward": _Direction(("x", "w", "y"), _to_ndhwgc, None),
    "bwd_data": _Direction(("dy", "w", "dx"), _to_ndhwgc, (True, False, False)),
    "bwd_weight": _Direction(("x", "dy", "dw"), _to_gkzyxc, (False, True, False)),
}
_LAYOUT_OF = {"x": _to_ndhwgc, "dy": _to_ndhwgc, "w": _to_gkzyxc}
# each direction's output has the shape of one of the tensors prepare draws
SAME_SHAPE = {"y": "dy", "dx": "x", "dw": "w"}


def _gemm_library_units(cfg: GroupedConvConfig) -> tuple[SharedUnit, ...]:
    """The gemm and winograd pipelines run their GEMMs on the GEMM library, whose GEMV-class
    path is the GEMM family's object for the parameters grouped_conv_config.hpp gives them
    (fp32, this CPU's widest ISA under -march=native, split-K with SI, prefetch): linked beside
    the unit, not compiled in it. A wrong guess of the ISA fails to link (the object's entry is
    named by its parameters), never runs another's code."""
    if cfg.pipeline not in GEMM_PIPELINES:
        return ()
    isa = "avx512" if "avx512f" in _cpu_flags() else "avx2"
    return (skinny_unit("fp32", isa, "k" if cfg.has_si else "m", True),)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    return frozenset(hardware.profile().get("flags", ()))


class GroupedConvFamily(FamilyBase):
    """A grouped-conv family for one direction (see the module docstring)."""
    problem_fields = tuple(f.name for f in fields(GroupedConvProblem))
    config_fields = tuple(f.name for f in fields(GroupedConvConfig))
    source = KERNELS_DIR / "cpu" / "grouped_conv" / "grouped_conv.cpp"
    library_source = KERNELS_DIR / "cpu" / "grouped_conv" / "grouped_conv_lib.cpp"
    unit = KERNELS_DIR / "cpu" / "grouped_conv" / "grouped_conv_variant.cpp"   # both, compiled once

    def __init__(self, direction: str):
        self.direction = _choice(direction, DIRECTIONS, "direction", "GroupedConvFamily")
        self.name = f"grouped_conv_{direction}"

    # -- names --------------------------------------------------------------------------
    def kernel_name(self, cfg) -> str:
        return kernel_name(cfg)

    def parse_name(self, name: str):
        """Either flavour; a name of another direction is an error naming its family."""
        cfg = parse_kernel_name(name)
        if cfg.direction != self.direction:
            raise FamilyError(f"kernel {name!r} is a {cfg.direction} kernel; family {self.name} "
                              f"holds {self.direction} kernels (use grouped_conv_{cfg.direction})")
        return cfg

    # -- candidate space ----------------------------------------------------------------
    CANDIDATE_OPTIONS = {"dtype": ["fp32"], "ndim": list(NDIMS),
                         "tiles": ["32x32x32", "64x32x32", "32x64x32", "64x64x64", "128x64x32"],
                         # the gemm and winograd pipelines' tiles are their GEMM cache blocks
                         # MC x NC x KC
                         "gemm_tiles": ["192x512x256"],
                         "pipeline": list(PIPELINES), "wave_mode": list(WAVE_MODES),
                         "has_dsb": [False, True], "has_si": [False, True]}

    def candidate_space(self, options: Mapping[str, Sequence], hardware: Mapping) -> list[GroupedConvConfig]:
        """Every valid variant the options allow (each option a list; defaults in
        CANDIDATE_OPTIONS), filtered through PIPELINE_VARIANTS, deduplicated and sorted.
        Empty when the hardware's flags are known and lack AVX-512F (never build what
        cannot run)."""
        reject_unknown(options, tuple(self.CANDIDATE_OPTIONS), "grouped-conv candidate option")
        opt = {k: list(options.get(k) or default) for k, default in self.CANDIDATE_OPTIONS.items()}
        for p in opt["pipeline"]:
            _choice(p, PIPELINES, "pipeline", "candidates")
        for w in opt["wave_mode"]:
            _choice(w, WAVE_MODES, "wave_mode", "candidates")
        flags = set(hardware.get("flags", ()))
        if flags and not set(REQUIRED_FLAGS) <= flags:
            return []
        configs = set()
        for dtype, ndim, variant in itertools.product(opt["dtype"], opt["ndim"], PIPELINE_VARIANTS):
            pipeline, wave, dsb, si = variant
            if (pipeline not in opt["pipeline"] or wave not in opt["wave_mode"]
                    or dsb not in opt["has_dsb"] or si not in opt["has_si"]):
                continue
            if pipeline == "winograd" and (self.direction == "bwd_weight" or int(ndim) != 2):
                continue   # 2D forward and bwd_data only
            for tile in opt["gemm_tiles" if pipeline in GEMM_PIPELINES else "tiles"]:
                try:
                    bm, bn, bk = (int(v) for v in str(tile).split("x"))
                except ValueError:
                    raise FamilyError(f"candidate tile {tile!r} is not BMxBNxBK") from None
                configs.add(validate_config(GroupedConvConfig(
                    self.direction, str(dtype), int(ndim), bm, bn, bk, pipeline, wave, dsb, si)))
        return sorted(configs)

    def stratum(self, cfg) -> tuple[str, int]:
        """A candidate budget is dealt round-robin across (pipeline, 2D or 3D)
        (workflows.pipeline.budgeted): every pipeline has kernels for both kinds of layer."""
        return cfg.pipeline, cfg.ndim_spatial

    def build_spec(self, cfg) -> BuildSpec:
        if not isinstance(cfg, GroupedConvConfig):
            raise FamilyError(f"{kernel_name(cfg)} is a tile-engine kernel; tilecast builds "
                              "only its own grouped-conv variants")
        validate_config(cfg)
        defines = {
            "TC_DIR": DIRECTIONS[cfg.direction], "TC_NDIM": cfg.ndim_spatial, "TC_BM": cfg.bm,
            "TC_BN": cfg.bn, "TC_BK": cfg.bk, "TC_PIPELINE": PIPELINES[cfg.pipeline],
            "TC_WAVE": WAVE_MODES[cfg.wave_mode], "TC_DSB": int(cfg.has_dsb),
            "TC_SI": int(cfg.has_si)}
        return BuildSpec(source=self.source, defines=defines,
                         library_source=self.library_source, unit=self.unit,
                         shared_units=_gemm_library_units(cfg))

    # -- problems -----------------------------------------------------------------------
    def problem(self, values: Mapping[str, Any]) -> GroupedConvProblem:
        return make_problem(values, self.direction)

    @property
    def dims_fields(self) -> tuple[str, ...]:
        """Every shape field but the direction, which the family fixes."""
        return tuple(f for f in self.problem_fields if f != "direction")

    def applicable(self, cfg, problem: GroupedConvProblem) -> bool:
        """Whether the kernel is a candidate for the problem at all: same direction, dtype
        and ndim, and a pipeline that handles it (dw only for depthwise problems, winograd
        only for 3x3 stride-1 undilated 2D ones), so a dispatcher never picks a kernel that
        cannot run the problem."""
        return (cfg.direction == problem.direction and cfg.dtype == problem.dtype
                and cfg.ndim_spatial == problem.ndim
                and (cfg.pipeline != "dw" or problem.is_depthwise())
                and (cfg.pipeline != "winograd" or problem.is_winograd()))

    def applicability_key(self, problem: GroupedConvProblem):
        """What `applicable` reads of a problem: equal keys, equal candidate masks."""
        return (problem.direction, problem.dtype, problem.ndim, problem.is_depthwise(),
                problem.is_winograd())

    def unsupported_reason(self, cfg, problem: GroupedConvProblem) -> str | None:
        for field, kernel_value, problem_value in (
                ("direction", cfg.direction, problem.direction), ("dtype", cfg.dtype, problem.dtype),
                ("ndim", cfg.ndim_spatial, problem.ndim)):
            if kernel_value != problem_value:
                return f"kernel {field} {kernel_value} != problem {field} {problem_value}"
        if cfg.pipeline == "dw" and not problem.is_depthwise():
            return (f"the dw pipeline needs a depthwise problem (C = K = 1 per group), "
                    f"got C={problem.C}, K={problem.K}")
        if cfg.pipeline == "winograd" and not problem.is_winograd():
            return (f"the winograd pipeline needs a 2D 3x3 filter with stride 1 and dilation 1, "
                    f"got {problem.Y}x{problem.X} stride {problem.stride_h}x{problem.stride_w} "
                    f"dilation {problem.dilation_h}x{problem.dilation_w}")
        return geometry_reason(problem)

    def slices(self, problem: GroupedConvProblem) -> tuple[str, ...]:
        """Report slices: 2d/3d, depthwise or grouped, strided, dilated, pointwise."""
        tags = [f"{problem.ndim}d"]
        if problem.is_depthwise():
            tags.append("depthwise")
        elif problem.G > 1:
            tags.append("grouped")
        if max(problem.stride_d, problem.stride_h, problem.stride_w) > 1:
            tags.append("strided")
        if max(problem.dilation_d, problem.dilation_h, problem.dilation_w) > 1:
            tags.append("dilated")
        if problem.Z == problem.Y == problem.X == 1:
            tags.append("pointwise")
        return tuple(tags)

    def flops(self, p: GroupedConvProblem) -> float:
        do, ho, wo = p.output_dims()
        return 2.0 * p.N * p.G * p.K * p.C * p.Z * p.Y * p.X * max(do * ho * wo, 0)

    def bytes_moved(self, p: GroupedConvProblem) -> float:
        do, ho, wo = (max(v, 0) for v in p.output_dims())
        elements = (p.N * p.Di * p.Hi * p.Wi * p.G * p.C + p.G * p.K * p.Z * p.Y * p.X * p.C
                    + p.N * do * ho * wo * p.G * p.K)
        return float(ELEMENT_BYTES * elements)

    def operand_bytes(self, values: Mapping[str, Any]) -> int:
        """Bytes a measurement of the problem holds at once: x, w and dy in float32 (prepare
        draws all three), the direction's output and its float64 reference (FamilyError as
        `problem` for bad fields)."""
        p = self.problem(values)
        do, ho, wo = (max(v, 0) for v in p.output_dims())
        elements = {"x": p.N * p.Di * p.Hi * p.Wi * p.G * p.C,
                    "w": p.G * p.K * p.Z * p.Y * p.X * p.C, "dy": p.N * do * ho * wo * p.G * p.K}
        output = elements[SAME_SHAPE[DIRECTION_IO[self.direction].operands[2]]]
        return ELEMENT_BYTES * sum(elements.values()) + (ELEMENT_BYTES + 8) * output

    def tolerance(self, problem: GroupedConvProblem) -> float:
        return TOLERANCE[_choice(problem.dtype, TOLERANCE, "dtype", "tolerance")]

    # -- inputs, reference, peer --------------------------------------------------------
    def prepare(self, problem: GroupedConvProblem, directory: Path, seed: int) -> PreparedProblem:
        """Write the direction's two inputs in the kernel layouts and compute the float64
        torch reference (autograd of the same convolution for the backward directions)."""
        import torch   # only preparing a problem needs torch: the family table stays light

        reason = geometry_reason(problem)
        if reason or problem.dtype not in DTYPES:
            raise FamilyError(f"cannot prepare {self.dims_key(problem)}: "
                              f"{reason or 'tilecast kernels are fp32 only'}")
        p, io = problem, DIRECTION_IO[self.direction]
        spatial_in, spatial_k = _spatial(p, (p.Di, p.Hi, p.Wi)), _spatial(p, (p.Z, p.Y, p.X))
        gen = torch.Generator().manual_seed(seed)
        tensors = {"x": torch.randn(p.N, p.G * p.C, *spatial_in, generator=gen),
                   "w": torch.randn(p.G * p.K, p.C, *spatial_k, generator=gen)}
        tensors["dy"] = torch.randn(p.N, p.G * p.K, *_spatial(p, p.output_dims()), generator=gen)
        reference = self._reference(p, tensors)
        directory.mkdir(parents=True, exist_ok=True)
        paths = [directory / f"{name}.bin" for name in io.operands]
        for key, path in zip(io.operands[:2], paths):
            _LAYOUT_OF[key](tensors[key], p.G).numpy().tofile(path)
        job = (*(str(getattr(p, f)) for f in JOB_FIELDS), *map(str, paths))
        return PreparedProblem(problem=p, job_args=job, output_path=paths[2],
                               reference=io.output_layout(reference, p.G).numpy(),
                               tensors=tensors)

    def _reference(self, p: GroupedConvProblem, tensors: Mapping) -> Any:
        import torch   # only preparing a problem needs torch: the family table stays light

        x = tensors["x"].double().requires_grad_(self.direction == "bwd_data")
        w = tensors["w"].double().requires_grad_(self.direction == "bwd_weight")
        y = _conv(p)(x, w)
        if self.direction == "forward":
            return y.detach()
        wrt = x if self.direction == "bwd_data" else w
        (grad,) = torch.autograd.grad(y, wrt, tensors["dy"].double())
        return grad

    def output_tensor(self, prepared: PreparedProblem):
        """The output buffer of the interleaved protocol, shared by a problem's candidates:
        zeroed float32, the reference's elements in kernel layout, then the kernels' slack."""
        import torch   # only preparing a problem needs torch: the family table stays light

        return torch.zeros(prepared.reference.size + IN_PROCESS_SLACK, dtype=torch.float32)

    def timer(self, library: Path, prepared: PreparedProblem, threads: int, output):
        """time(reps) -> seconds per call, for the interleaved protocol (tilecast.measurement.interleave):
        the variant's in-process library (`tilecast_grouped_conv_time`: `reps` calls on one
        set of scratch buffers) on the prepared operands in kernel layout, into `output`."""
        import torch   # only preparing a problem needs torch: the family table stays light

        lib = ctypes.CDLL(str(library))
        lib.tilecast_grouped_conv_slack.restype = ctypes.c_longlong
        slack = int(lib.tilecast_grouped_conv_slack())
        if slack > IN_PROCESS_SLACK:
            raise RuntimeError(f"{library.name} reads {slack} floats past a tensor; the "
                               f"interleaved protocol pads {IN_PROCESS_SLACK}")
        entry = lib.tilecast_grouped_conv_time
        pointer = ctypes.c_void_p
        entry.argtypes = [ctypes.POINTER(ctypes.c_longlong), pointer, pointer, pointer,
                          ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                          ctypes.c_char_p, ctypes.c_longlong]
        entry.restype = ctypes.c_int
        p, io = prepared.problem, DIRECTION_IO[self.direction]
        inputs = []
        for key in io.operands[:2]:
            stored = _LAYOUT_OF[key](prepared.tensors[key], p.G).reshape(-1)
            padded = torch.zeros(stored.numel() + IN_PROCESS_SLACK, dtype=torch.float32)
            padded[:stored.numel()] = stored
            inputs.append(padded)
        shape = (ctypes.c_longlong * len(JOB_FIELDS))(*(getattr(p, f) for f in JOB_FIELDS))
        return library_timer(entry, (shape, inputs[0].data_ptr(), inputs[1].data_ptr(),
                                     output.data_ptr()), threads, owners=(inputs, output))

    def peer(self, prepared: PreparedProblem, threads: int):
        """torch's own CPU op for this direction on the same operands and thread count:
        ("torch.conv", callable), measured with the same protocol."""
        import torch   # only preparing a problem needs torch: the family table stays light

        torch.set_num_threads(threads)
        p, t = prepared.problem, prepared.tensors
        mask = DIRECTION_IO[self.direction].output_mask
        if mask is None:
            conv = _conv(p)
            return "torch.conv", lambda: conv(t["x"], t["w"])
        stride, pad, dil = _geometry(p)
        return "torch.conv", lambda: torch.ops.aten.convolution_backward(
            t["dy"], t["x"], t["w"], None, stride, pad, dil, False, [0] * len(stride), p.G,
            list(mask))

    def feature_engine(self, hardware: Mapping):
        return GroupedConvFeatureEngine(hardware)


def _spatial(p: GroupedConvProblem, dhw: tuple[int, int, int]) -> tuple[int, ...]:
    return dhw if p.ndim == 3 else dhw[1:]


def _geometry(p: GroupedConvProblem) -> tuple[list[int], list[int], list[int]]:
    return (list(_spatial(p, (p.stride_d, p.stride_h, p.stride_w))),
            list(_spatial(p, (p.pad_d, p.pad_h, p.pad_w))),
            list(_spatial(p, (p.dilation_d, p.dilation_h, p.dilation_w))))


def _conv(p: GroupedConvProblem) -> Callable:
    """conv2d / conv3d with the problem's geometry and groups: f(input, weight)."""
    import torch.nn.functional as F   # only preparing a problem needs torch

    op = F.conv3d if p.ndim == 3 else F.conv2d
    stride, pad, dil = _geometry(p)
    return lambda x, w: op(x, w, None, stride, pad, dil, p.G)

