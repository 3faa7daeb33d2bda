"""DiscoConvS2 and DiscoConvTransposeS2: DISCO convolutions on the sphere as nn.Modules, drop-in
for torch-harmonics' DiscreteContinuousConvS2 / DiscreteContinuousConvTransposeS2.

The constructor arguments they share mean the same (defaults included), the weight has the
same shape (out_channels, in_channels / groups, kernel_size) and initialisation, and the
forward is the same computation: the contraction with psi (tilecast's CPU or CUDA kernels,
ops.py), then a per-group channel/basis mix and the bias, as in reference.disco_conv. psi is
built once, in __init__, into buffers that move with the module. float64 input, and
optimized_kernel=False, run the pure-torch reference instead.

DiscoConvS2's forward picks one of four paths (`_contract_and_mix`), symmetric in its two
switches as the seed prescribes (fused=None, the default, decides the first switch per input:
`_runs_fused`):

    fused + kpacked   fused.fused_conv with the kpacked contraction (its backward: fused.py)
    fused only        fused.fused_conv with the CSR contraction
    kpacked only      ops.disco_contraction_kpacked, then the mix
    neither           ops.disco_contraction, then the mix

The unfused paths run their variant through the table of tilecast.disco.variants (one row per
variant of the kernel space, tilecast.spaces.disco), never an if on its name.

The unfused paths' backward runs the line-blocked transpose where psi's transpose has that
layout (CPU, tilecast.disco.lines: dense filters such as the downsampling ones; built at the
first forward that needs the input's gradient), else the CSR transpose.

kpacked is eligible when psi has the layout (kpacked.kpack_psi: shared supports) and
`psi_kpacked_K_pad` is in kpacked.SUPPORTED_K_PAD; setting that attribute to anything else
(the seed's K_PAD = 24 test) forces the CSR path. The distributed convolution calls the same
method on its shard's psi, so both dispatch alike.

With `registry=` (a tilecast registry holding the disco_forward and disco_backward models,
`tilecast run --config disco`), the unfused paths run the kernels the published selector
chooses for each input's batch size and dtype (tilecast.runtime.disco.selector): CSR or kpacked for
the forward where both are eligible, each kernel's register tile, and the backward's kernel:
the CSR transpose with the tile the selector names, or the line-blocked transpose (whatever
its fill) where the selector chose it; without one, kpacked where eligible and the library's
own tiles.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Union

import torch
from torch import Tensor, nn

from tilecast.disco import native, ops, reference, variants
from tilecast.runtime.disco import fused as fused_path, selector
from tilecast.disco.basis import get_basis
from tilecast.disco.csr import DiscoCSR, csr_from_psi
from tilecast.disco.grids import default_theta_cutoff
from tilecast.disco.kpacked import SUPPORTED_K_PAD, KPacked, kpack_psi
from tilecast.disco.lines import LineBlocked, line_blocked
from tilecast.runtime.disco.mix import Mixer
from tilecast.disco.psi import Psi, compute_psi

KernelShape = Union[int, tuple[int], tuple[int, int]]

# psi's values are kept as the int32 bits of their float32 values, so that module.to(dtype)
# and .half() (which cast every floating buffer) leave them exact; device moves still apply
_CSR_BUFFERS = ("roff", "col", "vals", "troff", "tcol", "tvals")
_KPACKED_BUFFERS = ("idx", "vals", "offset")
_BIT_VIEWED = ("vals", "tvals")


class _DiscoConvBase(nn.Module):
    """Weight, bias and psi buffers shared by the forward and transpose convolutions."""

    def __init__(self, in_channels: int, out_channels: int, kernel_shape: KernelShape,
                 basis_type: str, groups: int, bias: bool, optimized_kernel: bool = True):
        super().__init__()
        self.optimized_kernel = bool(optimized_kernel)
        self.mixer = Mixer()  # the fused path's mix on torch (DiscoConvS2's mix_gemm changes it)
        for label, count in (("in_channels", in_channels), ("out_channels", out_channels),
                             ("groups", groups)):
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
                raise ValueError(f"{type(self).__name__}: {label}={count!r} must be a positive "
                                 "integer")
        if in_channels % groups != 0 or out_channels % groups != 0:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) "
                             f"must be multiples of groups ({groups})")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_shape = kernel_shape
        self.basis_type = basis_type
        self.kernel_size = get_basis(basis_type, kernel_shape).kernel_size
        self.groupsize = in_channels // groups
        # torch-harmonics' init: unit variance over the groupsize * kernel_size fan-in
        scale = math.sqrt(1.0 / (self.groupsize * self.kernel_size))
        self.weight = nn.Parameter(scale * torch.randn(out_channels, self.groupsize, self.kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None

    def _forward_geometry(self, in_shape, out_shape, theta_cutoff: Optional[float],
                          grid_out: str) -> None:
        """in_shape, out_shape and theta_cutoff of a convolution from in_shape to out_shape
        (the cutoff defaults to one latitude gap of the output grid)."""
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        if theta_cutoff is None:
            theta_cutoff = default_theta_cutoff(self.out_shape[0], grid_out)
        self.theta_cutoff = float(theta_cutoff)

    def _transpose_geometry(self, in_shape, out_shape, theta_cutoff: Optional[float],
                            grid_in: str) -> None:
        """The same for a transpose convolution: nlon_out must be a multiple of nlon_in, and
        the cutoff defaults to one latitude gap of the input grid."""
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        if self.out_shape[1] % self.in_shape[1] != 0:
            raise ValueError(f"nlon_out ({self.out_shape[1]}) must be a multiple of nlon_in "
                             f"({self.in_shape[1]})")
        if theta_cutoff is None:
            theta_cutoff = default_theta_cutoff(self.in_shape[0], grid_in)
        self.theta_cutoff = float(theta_cutoff)

    def _store_psi(self, psi: Psi, kpacked: bool = False) -> None:
        """psi as buffers: both CSR layouts, and with kpacked=True the kpacked layout where
        psi has one (psi_kpacked_K_pad is then its K_PAD, else None)."""
        self.psi = psi
        csr = csr_from_psi(psi)
        for name in _CSR_BUFFERS:
            tensor = getattr(csr, name)
            if name in _BIT_VIEWED:
                tensor = tensor.view(torch.int32)
            self.register_buffer(f"psi_{name}", tensor, persistent=False)
        self.psi_kpacked_K_pad = None
        packed = kpack_psi(psi) if kpacked else None
        if packed is not None:
            for name, tensor in zip(_KPACKED_BUFFERS, packed.tensors()):
                if name == "vals":
                    tensor = tensor.view(torch.int32)
                self.register_buffer(f"psi_kpacked_{name}", tensor, persistent=False)
            self.psi_kpacked_K_pad = packed.k_pad
        self._fused_plans = {}
        self._line_layouts = {}
        self._chosen_line_layouts = {}
        self._choices = {}

    def _kpacked(self) -> Optional[KPacked]:
        """The kpacked buffers, or None when the path is not eligible (no layout, or a
        psi_kpacked_K_pad the kernels are not instantiated for)."""
        if self.psi_kpacked_K_pad not in SUPPORTED_K_PAD or not hasattr(self, "psi_kpacked_idx"):
            return None
        return KPacked(self.psi_kpacked_idx, self.psi_kpacked_vals.view(torch.float32),
                       self.psi_kpacked_offset, self.psi_kpacked_K_pad)

    def _psi_tensors(self) -> tuple[Tensor, ...]:
        """The six CSR tensors in the ops' order, values as float32."""
        tensors = []
        for name in _CSR_BUFFERS:
            tensor = getattr(self, f"psi_{name}")
            tensors.append(tensor.view(torch.float32) if name in _BIT_VIEWED else tensor)
        return tuple(tensors)

    def csr(self) -> DiscoCSR:
        """psi in the kernels' CSR layouts (the module's buffers)."""
        return DiscoCSR(*self._psi_tensors(), in_shape=self.psi.in_shape,
                        out_shape=self.psi.out_shape, kernel_size=self.kernel_size)

    def _check_input(self, x: Tensor, shape: tuple[int, int]) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_channels or tuple(x.shape[-2:]) != shape:
            raise ValueError(f"{type(self).__name__} expects x of shape (B, {self.in_channels}, "
                             f"{shape[0]}, {shape[1]}), got {tuple(x.shape)}")

    def _empty_batch(self, x: Tensor, out_shape: tuple[int, int]) -> Tensor:
        """The output of a batch of size 0: (0, out_channels, *out_shape) in x's dtype, as
        torch's convolutions give one, instead of a failed reshape on one of the paths. It
        hangs off x and the weight (zero gradients), as an output of the other paths does."""
        anchor = x.sum().to(self.weight.dtype) * 0 + self.weight.sum() * 0
        return self._add_bias(anchor.to(x.dtype).expand(0, self.out_channels, *out_shape))

    def _grouped_weight(self) -> Tensor:
        return self.weight.reshape(self.groups, self.out_channels // self.groups,
                                   self.groupsize, self.kernel_size)

    def _add_bias(self, out: Tensor) -> Tensor:
        return out if self.bias is None else out + self.bias.reshape(1, -1, 1, 1)

    def _mix(self, equation: str, tensor: Tensor) -> Tensor:
        """torch.einsum(equation, tensor, grouped weight), in tensor's dtype, computed in
        fused.mix_dtype (float32 for float16 on the CPU: torch's CPU float16 matmul was 84 %
        of a float16 forward)."""
        dtype = fused_path.mix_dtype(tensor)
        if dtype == tensor.dtype:
            return torch.einsum(equation, tensor, self._grouped_weight())
        mixed = torch.einsum(equation, tensor.to(dtype), self._grouped_weight().to(dtype))
        return mixed.to(tensor.dtype)

    def _mix_and_transpose(self, x: Tensor, nlon_out: int) -> Tensor:
        """The transpose convolution without its bias: the channel/basis mix of x (B, C,
        nlat, nlon) on psi's output grid, then the transpose contraction into psi's input
        grid with nlon_out longitudes (the line-blocked kernel where psi's transpose has that
        layout, as for the unfused backward; else CSR)."""
        batch, _, nlat_in, nlon_in = x.shape
        grouped = x.reshape(batch, self.groups, self.groupsize, nlat_in, nlon_in)
        expanded = self._mix("bgcxy,gock->bgokxy", grouped)
        expanded = expanded.reshape(batch, self.out_channels, self.kernel_size, nlat_in, nlon_in)
        if x.dtype == torch.float64 or not self.optimized_kernel:
            return reference.disco_transpose_contraction(expanded, self.psi, nlon_out)
        lines = self._line_layout(x.device)
        if lines is not None:
            return ops.disco_transpose_contraction_lines(expanded, *self._psi_tensors(),
                                                         self.psi.in_shape[0], nlon_out, lines)
        return ops.disco_transpose_contraction(expanded, *self._psi_tensors(),
                                               self.psi.in_shape[0], nlon_out)

    def _contract_and_mix(self, x: Tensor) -> Tensor:
        """The convolution without its bias: x (B, C, nlat_in, nlon_in) -> (B, out_channels,
        nlat_out, nlon_out) on psi's grids, by the four-way dispatch of the module docstring."""
        nlat_out, nlon_out = self.psi.out_shape
        if x.dtype == torch.float64 or not self.optimized_kernel:
            return reference.disco_conv(x, self.psi, self.weight, nlon_out, self.groups)
        packed = self._kpacked()
        if self._runs_fused(x):
            plan = self._fused_plan(x.device)
            return fused_path.fused_conv(x, self.weight, plan, packed, self.groups, self.mixer)
        forward, backward = self._chosen_kernels(x)
        variant, tile = self._forward_kernel(forward, packed)
        gradient = variants.Gradient()
        if x.requires_grad and torch.is_grad_enabled():
            gradient = self._gradient_kernel(backward, x.device)
        expanded = variants.forward_op(variant)(x, self._psi_tensors(), packed, self.kernel_size,
                                                nlat_out, nlon_out, tile, gradient)
        batch = x.shape[0]
        expanded = expanded.reshape(batch, self.groups, self.groupsize, self.kernel_size,
                                    nlat_out, nlon_out)
        out = self._mix("bgckxy,gock->bgoxy", expanded)
        return out.reshape(batch, self.out_channels, nlat_out, nlon_out)

    @staticmethod
    def _forward_kernel(choice: Optional[dict],
                        packed: Optional[KPacked]) -> tuple[str, Optional[list[int]]]:
        """The forward variant and register tile to run: the selector's choice where psi has
        its variant's layout, else the first of variants.FORWARD_PREFERENCE psi has the
        layout for, with the library's tile."""
        if choice is not None and variants.has_layout(choice["variant"], packed):
            return choice["variant"], list(choice["tile"])
        preferred = (v for v in variants.FORWARD_PREFERENCE if variants.has_layout(v, packed))
        return next(preferred), None

    def _gradient_kernel(self, choice: Optional[dict], device: torch.device) -> variants.Gradient:
        """The kernel of the input gradient: the selector's choice (the line-blocked layout
        whatever its fill where it chose that kernel), else the line-blocked transpose where
        its fill pays (_line_layout) and the CSR transpose with the library's tile elsewhere."""
        if choice is None:
            return variants.Gradient(lines=self._line_layout(device))
        return variants.gradient_kernel(choice["variant"], choice["tile"],
                                        lambda: self._chosen_line_layout(device))

    def _chosen_kernels(self, x: Tensor) -> tuple[Optional[dict], Optional[dict]]:
        """The (forward, backward) kernels the registry's selector chose for x's batch size
        and dtype (selector.choose_variant results), or (None, None) without a registry or
        off the CPU."""
        registry = getattr(self, "registry", None)
        if registry is None or x.device.type != "cpu":
            return None, None
        key = (x.shape[0], x.dtype)
        if key not in self._choices:
            problem = selector.problem_fields(x.shape, self.psi.in_shape, self.psi.out_shape,
                                              self.kernel_shape, self.basis_type, self.grid_in,
                                              self.grid_out, self.theta_cutoff, x.dtype)
            self._choices[key] = tuple(
                selector.choose_variant(registry, problem, model, self.registry_alias)
                for model in ("disco_forward", "disco_backward"))
        return self._choices[key]

    def _line_layout(self, device: torch.device) -> Optional[LineBlocked]:
        """psi's transpose in the line-blocked layout where that kernel is the faster one
        (tilecast.disco.lines: CPU, fill >= MIN_FILL), else None; built once per device, at
        the first call that runs a transpose contraction (the unfused backward, the transpose
        convolution's forward)."""
        if device.type != "cpu":
            return None
        key = str(device)
        if key not in self._line_layouts:
            self._line_layouts[key] = line_blocked(self.csr(), native.line_block())
        return self._line_layouts[key]

    def _chosen_line_layout(self, device: torch.device) -> Optional[LineBlocked]:
        """The line-blocked layout whatever its fill, for a registry's selector that chose
        the lines kernel (CPU only, as the selector is asked; None where psi has no
        entries); built once per device."""
        key = str(device)
        if key not in self._chosen_line_layouts:
            self._chosen_line_layouts[key] = line_blocked(self.csr(), native.line_block(),
                                                          min_fill=0.0)
        return self._chosen_line_layouts[key]

    def _runs_fused(self, x: Tensor) -> bool:
        """Whether x takes the fused path: `fused` where it is set; where it is None (auto),
        on the CPU without a registry when psi's output needs more than one of the fused
        path's latitude blocks, i.e. when the unfused path's (C, K, nlat_out, nlon_out)
        expansion of one batch element would pass fused.TARGET_SLAB_BYTES (at
        self_256x360x720, 2.4 GB: the unfused forward ran 0.82x torch-harmonics there, the
        fused 2.0x)."""
        if self.fused is not None:
            return self.fused
        if x.device.type != "cpu" or getattr(self, "registry", None) is not None:
            return False
        nlat_out, nlon_out = self.psi.out_shape
        return fused_path.block_rows(self.in_channels, self.kernel_size, nlon_out) < nlat_out

    def _fused_plan(self, device: torch.device) -> "fused_path.FusedPlan":
        """psi cut into the fused path's latitude blocks, built once per device."""
        key = str(device)
        if key not in self._fused_plans:
            self._fused_plans[key] = fused_path.plan_blocks(
                self.psi, self.in_channels, device, out_channels=self.out_channels)
        return self._fused_plans[key]


class DiscoConvS2(_DiscoConvBase):
    """DISCO convolution x (B, in_channels, *in_shape) -> (B, out_channels, *out_shape).

    Arguments as torch-harmonics' DiscreteContinuousConvS2: kernel_shape and basis_type pick
    the filter basis, basis_norm_mode its normalisation (default "nodal"), grid_in / grid_out
    the latitude grids, theta_cutoff the filter radius (default: one latitude gap of the
    output grid), optimized_kernel=False the pure-torch reference, fused=True the fused
    path, fused=False the unfused ones; fused=None (the default) takes the fused path on the
    CPU where the unfused one would expand a batch element past the fused path's slab
    target (24 MB; e.g. 256 channels on a 360x720 grid) and no registry is given, else the
    unfused ones. nlon_in must be a multiple of nlon_out. registry (a path or fsspec URL) and
    registry_alias: the published DISCO selector whose kernel choices the forward follows
    (module docstring); SelectorError at construction if it cannot answer. mix_gemm (fused
    path only): the fused path's float32 CPU channel-mix products may run on tilecast GEMM
    kernels (a kernel name, a list of them, or a gemm dispatcher, whose best-ranked kernels
    for each product's shape are taken): each shape's first products race them against
    torch's sgemm, and the fastest runs the rest (tilecast.runtime.disco.mix); None (the default) runs
    them on torch.
    """

    def __init__(self, in_channels: int, out_channels: int, in_shape: tuple[int, int],
                 out_shape: tuple[int, int], kernel_shape: KernelShape,
                 basis_type: str = "piecewise linear", basis_norm_mode: str = "nodal",
                 groups: int = 1, grid_in: str = "equiangular", grid_out: str = "equiangular",
                 bias: bool = True, theta_cutoff: Optional[float] = None,
                 optimized_kernel: bool = True, fused: Optional[bool] = None,
                 registry: Optional[str] = None, registry_alias: Union[str, int] = "production",
                 mix_gemm=None):
        super().__init__(in_channels, out_channels, kernel_shape, basis_type, groups, bias,
                         optimized_kernel)
        if fused is None and mix_gemm is not None:
            fused = True
        # None: decided per input (_runs_fused)
        if not self.optimized_kernel:
            self.fused = False
        else:
            self.fused = None if fused is None else bool(fused)
        if mix_gemm is not None and not self.fused:
            raise ValueError("mix_gemm runs the fused path's mix: pass fused=True (and "
                             "optimized_kernel=True) with it")
        self.mixer = Mixer(mix_gemm)
        self.grid_in, self.grid_out = grid_in, grid_out
        self.registry, self.registry_alias = registry, registry_alias
        self._forward_geometry(in_shape, out_shape, theta_cutoff, grid_out)
        self._store_psi(compute_psi(self.in_shape, self.out_shape, kernel_shape,
                                    basis_type=basis_type, basis_norm_mode=basis_norm_mode,
                                    grid_in=grid_in, grid_out=grid_out,
                                    theta_cutoff=self.theta_cutoff),
                        kpacked=self.optimized_kernel)
        if registry is not None:
            # fail here, not at the first forward, when the registry cannot answer
            # (only the batch size, channels, dtype and device of the probe are read)
            self._chosen_kernels(torch.empty(1, in_channels, 0, 0, dtype=self.weight.dtype))

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"in_shape={self.in_shape}, out_shape={self.out_shape}, "
                f"kernel_shape={self.kernel_shape}, basis_type={self.basis_type!r}, "
                f"groups={self.groups}, theta_cutoff={self.theta_cutoff:g}")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x, self.in_shape)
        if x.shape[0] == 0:
            return self._empty_batch(x, self.out_shape)
        return self._add_bias(self._contract_and_mix(x))


class DiscoConvTransposeS2(_DiscoConvBase):
    """Transpose DISCO convolution x (B, in_channels, *in_shape) -> (B, out_channels,
    *out_shape), the adjoint of DiscoConvS2 from out_shape to in_shape (typically upsampling).

    Arguments as torch-harmonics' DiscreteContinuousConvTransposeS2; theta_cutoff defaults to
    one latitude gap of the input grid. nlon_out must be a multiple of nlon_in.
    """

    def __init__(self, in_channels: int, out_channels: int, in_shape: tuple[int, int],
                 out_shape: tuple[int, int], kernel_shape: KernelShape,
                 basis_type: str = "piecewise linear", basis_norm_mode: str = "nodal",
                 groups: int = 1, grid_in: str = "equiangular", grid_out: str = "equiangular",
                 bias: bool = True, theta_cutoff: Optional[float] = None,
                 optimized_kernel: bool = True):
        super().__init__(in_channels, out_channels, kernel_shape, basis_type, groups, bias,
                         optimized_kernel)
        self.fused = False
        self._transpose_geometry(in_shape, out_shape, theta_cutoff, grid_in)
        # psi of the forward convolution out_shape -> in_shape, normalised for the transpose
        self._store_psi(compute_psi(self.out_shape, self.in_shape, kernel_shape,
                                    basis_type=basis_type, basis_norm_mode=basis_norm_mode,
                                    grid_in=grid_out, grid_out=grid_in,
                                    theta_cutoff=self.theta_cutoff, transpose_normalization=True))

    extra_repr = DiscoConvS2.extra_repr

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x, self.in_shape)
        if x.shape[0] == 0:
            return self._empty_batch(x, self.out_shape)
        return self._add_bias(self._mix_and_transpose(x, self.out_shape[1]))
