"""The kpacked and fused DISCO paths and DiscoConvS2's four-way dispatch (the seed's test
matrix): every path in its enabled and disabled state (the K_PAD = 24 monkeypatch), fused ==
unfused in outputs and gradients, the kpacked kernel against the float64 reference in three
precisions, psi blocks, opcheck, the fused path's transposed backward (psi's adjoint), and the
variant -> op table (tilecast.disco.variants) against the kernel space."""
from __future__ import annotations

import pytest
import torch

from tilecast.disco import compute_psi, native, ops, reference, variants
from tilecast.runtime.disco import DiscoConvS2, fused
from tilecast.disco.blocks import restrict_psi, split_rows
from tilecast.disco.kpacked import kpack_psi
from tilecast.spaces.disco import LANES, TILES, UNUSED_TILE_FIELD, VARIANTS, DiscoConfig

# torch-harmonics-style conventions: harmonic bases share their support (kpacked-eligible),
# piecewise-linear ones do not
GRIDS = {
    "same": ((12, 24), (12, 24), 0.4),
    "down": ((24, 48), (12, 24), None),
    "stride3": ((13, 36), (7, 12), None),
    "wide": ((8, 100), (8, 100), 0.6),
}
PRECISIONS = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _psi(grid, basis="harmonic", kernel_shape=(3, 3)):
    in_shape, out_shape, cutoff = GRIDS[grid]
    return compute_psi(in_shape, out_shape, kernel_shape, basis_type=basis, basis_norm_mode="mean",
                       grid_in="equiangular", grid_out="legendre-gauss", theta_cutoff=cutoff)


def _rel_error(actual, expected) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


# ---------------------------------------------------------------- layout and blocks

@pytest.mark.parametrize("kernel_shape, k, k_pad", [((3, 3), 9, 16), ((3, 1), 3, 8), ((4, 3), 12, 16)])
def test_kpacked_layout_of_a_harmonic_basis(kernel_shape, k, k_pad):
    psi = _psi("down", kernel_shape=kernel_shape)
    packed = kpack_psi(psi)
    assert psi.kernel_size == k and packed.k_pad == k_pad
    assert packed.vals.shape == (psi.nnz // k, k_pad) and packed.idx.shape == (psi.nnz // k, 2)
    assert torch.all(packed.vals[:, k:] == 0)
    assert packed.offset[0] == 0 and packed.offset[-1] == psi.nnz // k
    # entry n of latitude ho holds psi[k, ho, n] for every k
    dense = torch.zeros(k, psi.out_shape[0], psi.in_shape[0] * psi.in_shape[1], dtype=torch.float64)
    dense[psi.idx[0], psi.idx[1], psi.idx[2]] = psi.vals
    ho = torch.repeat_interleave(torch.arange(psi.out_shape[0]), packed.offset.diff())
    column = packed.idx[:, 0] * psi.in_shape[1] + packed.idx[:, 1]
    torch.testing.assert_close(packed.vals[:, :k].double(), dense[:, ho, column].t(), rtol=1e-6, atol=0)


def test_kpacked_layout_refused_when_supports_differ():
    assert kpack_psi(_psi("same", basis="piecewise linear")) is None


@pytest.mark.parametrize("rebase", [True, False])
def test_psi_blocks_reassemble_the_contraction(rebase):
    psi = _psi("down")
    x = torch.randn(2, 3, *psi.in_shape, dtype=torch.float64)
    full = reference.disco_contraction(x, psi, psi.out_shape[1])
    for rows in split_rows(psi.out_shape[0], 5):
        block = restrict_psi(psi, rows, rebase=rebase)
        lo, hi = block.in_rows if rebase else (0, psi.in_shape[0])
        part = reference.disco_contraction(x[:, :, lo:hi], block.psi, psi.out_shape[1])
        torch.testing.assert_close(part, full[:, :, :, rows[0]:rows[1]], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"cannot split 12 latitudes into 13"):
        split_rows(12, 13)
    with pytest.raises(ValueError, match=r"\[5, 5\) is empty"):
        restrict_psi(psi, (5, 5))


# ---------------------------------------------------------------- the kpacked kernel

@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("dtype", list(PRECISIONS))
def test_kpacked_kernel_matches_reference(grid, dtype):
    psi = _psi(grid)
    packed = kpack_psi(psi)
    x = torch.randn(2, 5, *psi.in_shape, dtype=torch.float64)
    expected = reference.disco_contraction(x.to(dtype).double(), psi, psi.out_shape[1])
    out = ops.disco_kpacked_contraction(x.to(dtype), *packed.tensors(), psi.kernel_size,
                                        *psi.out_shape, 0, psi.out_shape[0])
    assert out.dtype == dtype
    assert _rel_error(out, expected) < PRECISIONS[dtype]
    # a range of output latitudes is the same rows of the whole
    part = ops.disco_kpacked_contraction(x.to(dtype), *packed.tensors(), psi.kernel_size,
                                         *psi.out_shape, 2, 3)
    assert torch.equal(part, out[:, :, :, 2:5])


def test_kpacked_kernel_bad_input_is_refused_with_the_reason():
    psi = _psi("same")
    packed = kpack_psi(psi)
    x = torch.randn(1, 2, *psi.in_shape)
    with pytest.raises(ValueError, match=r"outside 0..12"):
        ops.disco_kpacked_contraction(x, *packed.tensors(), 9, 12, 24, 10, 3)
    with pytest.raises(ValueError, match=r"K_PAD >= K"):
        ops.disco_kpacked_contraction(x, packed.idx, packed.vals[:, :8], packed.offset, 9, 12, 24, 0, 12)
    bad_idx = packed.idx.clone()
    bad_idx[0, 0] = 99
    with pytest.raises(ValueError, match=r"outside the grid"):
        ops.disco_kpacked_contraction(x, bad_idx, *packed.tensors()[1:], 9, 12, 24, 0, 12)
    with pytest.raises(ValueError, match=r"K_PAD must be 8 or 16"):
        native.kpacked_contraction(x, packed.idx, torch.zeros(packed.idx.shape[0], 24),
                                   packed.offset, 9, 12, 24)


def test_opcheck_kpacked_op():
    psi = _psi("down")
    packed = kpack_psi(psi)
    x = torch.randn(2, 3, *psi.in_shape)
    torch.library.opcheck(torch.ops.tilecast.disco_kpacked_contraction.default,
                          (x, *packed.tensors(), psi.kernel_size, *psi.out_shape, 0, psi.out_shape[0]))


def test_kpacked_autocast_runs_in_float32():
    psi = _psi("same")
    packed = kpack_psi(psi)
    x = torch.randn(1, 2, *psi.in_shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.disco_kpacked_contraction(x.bfloat16(), *packed.tensors(), 9, *psi.out_shape, 0, 12)
    assert out.dtype == torch.float32


# ---------------------------------------------------------------- the four-way dispatch

class _Spy:
    """Counts calls of the ops the paths are made of, and of the line-blocked transpose (a
    native kernel the fused backward calls directly)."""

    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = {}
        for name in ("disco_contraction", "disco_kpacked_contraction", "disco_transpose_contraction"):
            original = getattr(ops, name)
            monkeypatch.setattr(ops, name, self._wrap(name, original))
        monkeypatch.setattr(native, "transpose_lines", self._wrap("transpose_lines",
                                                                  native.transpose_lines))

    def transposes(self) -> int:
        """Calls of either transpose kernel: the CSR op or the line-blocked one."""
        return self.calls.get("disco_transpose_contraction", 0) + self.calls.get("transpose_lines", 0)

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)
        return counted


def _module(fused_path, basis="harmonic", groups=1, grid="down", seed=0):
    in_shape, out_shape, cutoff = GRIDS[grid]
    torch.manual_seed(seed)
    return DiscoConvS2(4, 6, in_shape, out_shape, (3, 3), basis_type=basis, basis_norm_mode="mean",
                       grid_in="equiangular", grid_out="legendre-gauss", theta_cutoff=cutoff,
                       groups=groups, fused=fused_path)


def _run(conv, x, grad):
    x = x.clone().requires_grad_()
    conv.zero_grad()
    out = conv(x)
    out.backward(grad)
    return out.detach(), x.grad, conv.weight.grad.clone(), conv.bias.grad.clone()


def _reference(conv, x, grad):
    """Output and gradients of the float64 reference convolution with conv's parameters."""
    x = x.double().clone().requires_grad_()
    weight = conv.weight.detach().double().requires_grad_()
    bias = conv.bias.detach().double().requires_grad_()
    out = reference.disco_conv(x, conv.psi, weight, conv.out_shape[1], conv.groups, bias)
    out.backward(grad.double())
    return out.detach(), x.grad, weight.grad, bias.grad


PATHS = {  # (fused, kpacked enabled) -> the ops the forward must call
    (False, False): "disco_contraction",
    (False, True): "disco_kpacked_contraction",
    (True, False): "disco_contraction",
    (True, True): "disco_kpacked_contraction",
}


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("fused_path, kpacked", list(PATHS))
def test_every_path_matches_the_reference_and_takes_its_kernel(fused_path, kpacked, groups, monkeypatch):
    conv = _module(fused_path, groups=groups)
    assert conv.psi_kpacked_K_pad == 16
    if not kpacked:
        conv.psi_kpacked_K_pad = 24   # the seed's monkeypatch: ineligible -> CSR fallback
    x = torch.randn(2, 4, *conv.in_shape)
    grad = torch.randn(2, 6, *conv.out_shape)
    spy = _Spy(monkeypatch)
    results = _run(conv, x, grad)
    forward_op = PATHS[(fused_path, kpacked)]
    other = "disco_contraction" if kpacked else "disco_kpacked_contraction"
    assert spy.calls.get(forward_op, 0) >= 1 and spy.calls.get(other, 0) == 0, spy.calls
    assert spy.transposes() >= 1   # the backward transposes (CSR, or line-blocked bands)
    for actual, expected in zip(results, _reference(conv, x, grad)):
        assert _rel_error(actual, expected) < 1e-5


# ---------------------------------------------------------------- the variant -> op table

def _machine_isa() -> str:
    return {lanes: isa for isa, lanes in LANES.items()}[native.lanes()]


def _kernel_space(direction: str) -> set[str]:
    return {variant for d, variant, _ in TILES if d == direction}


def test_the_variant_tables_hold_one_row_per_variant_of_the_kernel_space():
    assert set(variants.FORWARD) == _kernel_space("forward") == {"csr", "kpacked"}
    assert set(variants.BACKWARD) == _kernel_space("backward") == {"csr", "lines"}
    assert set(variants.FORWARD_PREFERENCE) == set(variants.FORWARD)


def test_an_unknown_variant_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown DISCO forward variant 'lines'; valid: csr, "
                                         r"kpacked"):
        variants.forward_op("lines")
    with pytest.raises(ValueError, match=r"unknown DISCO backward variant 'kpacked'; valid: "
                                         r"csr, lines"):
        variants.gradient_kernel("kpacked", (1, 1), lambda: None)
    with pytest.raises(ValueError, match=r"unknown DISCO forward variant 'simd'"):
        variants.has_layout("simd", None)
    conv = _module(False)
    conv._chosen_kernels = lambda x: ({"variant": "lines", "tile": ()}, None)   # a bad choice
    with pytest.raises(ValueError, match=r"unknown DISCO forward variant 'lines'"):
        conv(torch.randn(1, 4, *conv.in_shape))


@pytest.mark.parametrize("backward", sorted(_kernel_space("backward")))
@pytest.mark.parametrize("forward", sorted(_kernel_space("forward")))
def test_every_row_pair_runs_its_kernels_and_matches_the_reference(forward, backward,
                                                                   monkeypatch):
    """Each forward row, with each backward row's gradient (a TILES tile of this CPU), runs
    the ops it names and gives the float64 reference's output and input gradient."""
    isa = _machine_isa()
    configs = {direction: DiscoConfig(direction, variant, isa, lat_block=1, **{
        **UNUSED_TILE_FIELD, **dict(zip(VARIANTS[variant].tile_fields,
                                        TILES[(direction, variant, isa)][0]))})
        for direction, variant in (("forward", forward), ("backward", backward))}
    conv = _module(False)
    psi, packed = conv._psi_tensors(), conv._kpacked()
    gradient = variants.gradient_kernel(backward, configs["backward"].tile(),
                                        lambda: conv._chosen_line_layout(torch.device("cpu")))
    assert (gradient.lines is not None) == (backward == "lines")
    spy = _Spy(monkeypatch)
    x = torch.randn(2, 4, *conv.in_shape, requires_grad=True)
    out = variants.forward_op(forward)(x, psi, packed, conv.kernel_size, *conv.out_shape,
                                       list(configs["forward"].tile()), gradient)
    grad = torch.randn_like(out)
    out.backward(grad)
    forward_op = {"csr": "disco_contraction", "kpacked": "disco_kpacked_contraction"}[forward]
    transpose = {"csr": "disco_transpose_contraction", "lines": "transpose_lines"}[backward]
    assert spy.calls == {forward_op: 1, transpose: 1}, spy.calls
    xd = x.detach().double().requires_grad_()
    expected = reference.disco_contraction(xd, conv.psi, conv.out_shape[1])
    expected.backward(grad.double())
    assert _rel_error(out, expected) < 1e-5 and _rel_error(x.grad, xd.grad) < 1e-5


def test_piecewise_linear_basis_falls_back_to_csr(monkeypatch):
    for fused_path in (False, True):
        conv = _module(fused_path, basis="piecewise linear")
        assert conv.psi_kpacked_K_pad is None
        x, grad = torch.randn(1, 4, *conv.in_shape), torch.randn(1, 6, *conv.out_shape)
        spy = _Spy(monkeypatch)
        results = _run(conv, x, grad)
        assert "disco_kpacked_contraction" not in spy.calls
        for actual, expected in zip(results, _reference(conv, x, grad)):
            assert _rel_error(actual, expected) < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("kpacked", [True, False])
def test_fused_equals_unfused_across_block_sizes(rows, kpacked, monkeypatch):
    monkeypatch.setattr(fused, "block_rows", lambda *args, **kwargs: rows)
    unfused, fused_conv = _module(False, grid="stride3"), _module(True, grid="stride3")
    if not kpacked:
        unfused.psi_kpacked_K_pad = fused_conv.psi_kpacked_K_pad = 24
    assert len(fused_conv._fused_plan(torch.device("cpu")).blocks) == -(-7 // rows)
    x, grad = torch.randn(3, 4, *unfused.in_shape), torch.randn(3, 6, *unfused.out_shape)
    for a, b in zip(_run(unfused, x, grad), _run(fused_conv, x, grad)):
        assert _rel_error(a, b) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused_path", [False, True])
def test_kpacked_fallback_in_half_precision(dtype, fused_path):
    """K_PAD = 24 in 16-bit: no crash, the CSR path's result, within the dtype's rounding of
    the float32 module."""
    conv = _module(fused_path).to(dtype)
    x = torch.randn(2, 4, *conv.in_shape)
    enabled = conv(x.to(dtype))
    conv.psi_kpacked_K_pad = 24
    fallback = conv(x.to(dtype))
    assert fallback.dtype == dtype
    assert _rel_error(fallback, enabled) < 4 * PRECISIONS[dtype]
    assert _rel_error(fallback, conv.float()(x)) < 8 * PRECISIONS[dtype]


def test_fused_none_takes_the_fused_path_where_the_expansion_passes_the_slab_target(monkeypatch):
    from tilecast.runtime.disco import fused as fused_module

    calls, real_fused_conv = [], fused_module.fused_conv
    monkeypatch.setattr(fused_module, "fused_conv",
                        lambda *args: calls.append(args) or real_fused_conv(*args))
    auto, unfused = _module(None), _module(False)
    assert auto.fused is None and unfused.fused is False
    (in_shape, out_shape, _), gen = GRIDS["down"], torch.Generator().manual_seed(5)
    x, grad = torch.randn(2, 4, *in_shape, generator=gen), torch.randn(2, 6, *out_shape, generator=gen)
    want = _run(unfused, x, grad)
    # 4 channels x 9 basis functions x 12 x 24 floats: one block of the 24 MB target, unfused
    assert fused_module.block_rows(4, 9, out_shape[1]) >= out_shape[0]
    assert all(_rel_error(got, w) < 1e-6 for got, w in zip(_run(auto, x, grad), want))
    assert calls == []
    # a target of two output latitudes' expansion: six blocks, fused
    monkeypatch.setattr(fused_module, "TARGET_SLAB_BYTES", 2 * 4 * 4 * 9 * out_shape[1])
    assert all(_rel_error(got, w) < 1e-5 for got, w in zip(_run(auto, x, grad), want))
    assert len(calls) == 1 and len(auto._fused_plan(x.device).blocks) == 6
    # never with a registry (its selector chooses the unfused paths' kernels), nor off the CPU
    assert auto._runs_fused(x) and not auto._runs_fused(x.to("meta"))
    auto.registry = "elsewhere"
    assert not auto._runs_fused(x)
    assert not unfused._runs_fused(x) and _module(True)._runs_fused(x.to("meta"))


def test_optimized_kernel_false_runs_the_reference(monkeypatch):
    in_shape, out_shape, cutoff = GRIDS["same"]
    conv = DiscoConvS2(4, 6, in_shape, out_shape, (3, 3), basis_type="harmonic",
                       theta_cutoff=cutoff, optimized_kernel=False, fused=True)
    assert conv.psi_kpacked_K_pad is None and conv.fused is False
    spy = _Spy(monkeypatch)
    x = torch.randn(1, 4, *in_shape)
    out = conv(x)
    assert spy.calls == {}
    expected = reference.disco_conv(x.double(), conv.psi, conv.weight.double(), out_shape[1], 1,
                                    conv.bias.double())
    assert _rel_error(out, expected) < 1e-6


def test_module_moves_and_casts_keep_the_kpacked_values_exact():
    conv = _module(False)
    vals = conv._kpacked().vals.clone()
    conv = conv.bfloat16().float()
    assert torch.equal(conv._kpacked().vals, vals)


# ---------------------------------------------------------------- the transposed backward

@pytest.mark.parametrize("grid", ["same", "wide"])
def test_transposed_psi_is_the_adjoint_filter(grid):
    """Contracting gy with transpose_psi(psi) gives T[c, k] with sum_k a_k T[c, k] equal to
    the transpose contraction of the K-expanded a_k * gy, for any weights a_k (float64)."""
    psi = _psi(grid)
    transposed = fused.transpose_psi(psi)
    assert transposed.in_shape == psi.out_shape and transposed.out_shape == psi.in_shape
    assert transposed.nnz == psi.nnz
    gen = torch.Generator().manual_seed(3)
    gy = torch.randn(2, 3, *psi.out_shape, generator=gen, dtype=torch.float64)
    weights = torch.randn(psi.kernel_size, generator=gen, dtype=torch.float64)
    expanded = weights.reshape(1, 1, -1, 1, 1) * gy.unsqueeze(2)
    expected = reference.disco_transpose_contraction(expanded, psi, psi.in_shape[1])
    contracted = reference.disco_contraction(gy, transposed, psi.in_shape[1])
    actual = (weights.reshape(1, 1, -1, 1, 1) * contracted).sum(2)
    assert _rel_error(actual, expected) < 1e-12
    with pytest.raises(ValueError, match="same longitudes"):
        fused.transpose_psi(_psi("down"))


def _self_module(in_shape, out_shape, channels=6, out_channels=4, groups=1, seed=0):
    torch.manual_seed(seed)
    return DiscoConvS2(channels, out_channels, in_shape, out_shape, (3, 3), basis_type="harmonic",
                       basis_norm_mode="mean", grid_in="equiangular", grid_out="legendre-gauss",
                       theta_cutoff=0.4, groups=groups, fused=True)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("in_shape", [(12, 24), (9, 24)])
def test_transposed_backward_matches_the_reference_and_runs_no_csr_transpose(in_shape, groups,
                                                                               monkeypatch):
    """fused + kpacked on grids of one longitude count with C_out <= C_in: the backward runs
    the kpacked kernel on gy and two matmuls, no CSR transpose, and every gradient matches
    the float64 reference."""
    conv = _self_module(in_shape, (12, 24), groups=groups)
    assert conv._fused_plan(torch.device("cpu")).transposed is not None
    x, grad = torch.randn(2, 6, *conv.in_shape), torch.randn(2, 4, *conv.out_shape)
    spy = _Spy(monkeypatch)
    results = _run(conv, x, grad)
    assert spy.calls.get("disco_kpacked_contraction", 0) >= 2, spy.calls   # forward, backward
    assert spy.transposes() == 0 and "disco_contraction" not in spy.calls
    for actual, expected in zip(results, _reference(conv, x, grad)):
        assert _rel_error(actual, expected) < 1e-5
    # input-gradient-only and weight-gradient-only backwards
    xg = x.clone().requires_grad_()
    conv.weight.requires_grad_(False)
    conv(xg).backward(grad)
    assert _rel_error(xg.grad, results[1]) < 1e-6
    conv.weight.requires_grad_(True)
    conv.zero_grad()
    conv(x).backward(grad)
    assert _rel_error(conv.weight.grad, results[2]) < 1e-6


@pytest.mark.parametrize("shapes, channels, applies", [
    (((12, 24), (12, 24)), (6, 4), True),
    (((12, 24), (12, 24)), (4, 6), False),    # more output channels: the blockwise backward
    (((16, 24), (12, 24)), (6, 4), False),    # more input latitudes
    (((24, 48), (12, 24)), (6, 4), False),    # longitudes differ
])
def test_transposed_backward_applies_only_where_it_saves_work(shapes, channels, applies,
                                                              monkeypatch):
    conv = _self_module(*shapes, *channels)
    assert (conv._fused_plan(torch.device("cpu")).transposed is not None) == applies
    x = torch.randn(1, channels[0], *conv.in_shape)
    grad = torch.randn(1, channels[1], *conv.out_shape)
    spy = _Spy(monkeypatch)
    results = _run(conv, x, grad)
    assert (spy.transposes() > 0) != applies
    for actual, expected in zip(results, _reference(conv, x, grad)):
        assert _rel_error(actual, expected) < 1e-5
    conv.psi_kpacked_K_pad = 24          # kpacked off: the blockwise CSR backward
    spy = _Spy(monkeypatch)
    _run(conv, x, grad)
    assert spy.transposes() > 0 and "disco_kpacked_contraction" not in spy.calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transposed_backward_in_half_precision(dtype):
    """16-bit input on the transposed backward: gradients in the input's dtype, within its
    rounding of the float32 module's."""
    conv = _self_module((12, 24), (12, 24))
    x, grad = torch.randn(2, 6, *conv.in_shape), torch.randn(2, 4, *conv.out_shape)
    expected = _run(conv, x, grad)
    half = _self_module((12, 24), (12, 24)).to(dtype)
    results = _run(half, x.to(dtype), grad.to(dtype))
    assert results[1].dtype == dtype and results[2].dtype == dtype
    for actual, want in zip(results, expected):
        assert _rel_error(actual, want) < 8 * PRECISIONS[dtype]


# ---------------------------------------------------------------- the mix inside the kernel

# nlon_out a whole number of the kernel's panels on AVX2 (16) and AVX-512 (32): 32; a partial
# last panel: 40 (16+16+8, 32+8), 24 (16+8; one partial panel of 32), 48 (three of 16; 32+16)
MIX_GRIDS = {"same": ((16, 32), (16, 32), 0.4), "down": ((23, 64), (12, 32), None),
             "partial": ((20, 40), (20, 40), 0.3), "narrow": ((12, 24), (12, 24), 0.5),
             "down-partial": ((23, 96), (12, 48), None)}


def _mix_module(grid, channels, out_channels, seed=0, **kwargs):
    in_shape, out_shape, cutoff = MIX_GRIDS[grid]
    torch.manual_seed(seed)
    return DiscoConvS2(channels, out_channels, in_shape, out_shape, (3, 3), basis_type="harmonic",
                       basis_norm_mode="mean", grid_in="equiangular", grid_out="legendre-gauss",
                       theta_cutoff=cutoff, fused=True, **kwargs)


def _blockwise(conv, x):
    """conv's forward on the blocks, torch mixing (the kernel never asked)."""
    plan = conv._fused_plan(x.device)
    return fused.fused_conv(x, conv.weight, plan, conv._kpacked(), 1,
                            fused.Mixer(in_kernel=False)).detach()


@pytest.mark.parametrize("grid", list(MIX_GRIDS))
@pytest.mark.parametrize("channels, out_channels, batch", [(3, 1, 2), (61, 13, 1), (30, 20, 3)])
def test_kpacked_mix_equals_the_blockwise_forward(grid, channels, out_channels, batch):
    """Channels past one chunk of the kernel's k (61, 30 > 28 at K = 9), output channels off
    its MR rows (1, 13, 20), batches, and a stride-2 grid; a row range writes those rows only."""
    conv = _mix_module(grid, channels, out_channels)
    x = torch.randn(batch, channels, *conv.in_shape)
    packed, (nlat_out, nlon_out) = conv._kpacked(), conv.out_shape
    weight = conv.weight.detach().reshape(out_channels, -1).contiguous()
    expected = _blockwise(conv, x)
    whole = native.kpacked_mix(x, weight, *packed.tensors(), conv.kernel_size, nlat_out, nlon_out)
    assert _rel_error(whole, expected) < 1e-6
    out = torch.full_like(expected, float("nan"))
    native.kpacked_mix(x, weight, *packed.tensors(), conv.kernel_size, nlat_out, nlon_out, 3, 5,
                       out=out)
    assert torch.isnan(out[:, :, :3]).all() and torch.isnan(out[:, :, 8:]).all()
    assert _rel_error(out[:, :, 3:8], expected[:, :, 3:8]) < 1e-6


def test_kpacked_mix_bad_input_is_refused_with_the_reason():
    conv = _mix_module("same", 4, 6)
    x, packed = torch.randn(1, 4, *conv.in_shape), conv._kpacked()
    weight = conv.weight.detach().reshape(6, -1).contiguous()
    k, (nlat_out, nlon_out) = conv.kernel_size, conv.out_shape
    with pytest.raises(ValueError, match="float32 only"):
        native.kpacked_mix(x.double(), weight, *packed.tensors(), k, nlat_out, nlon_out)
    with pytest.raises(ValueError, match=r"weight must be \(C_out, C \* K\)"):
        native.kpacked_mix(x, weight[:, :-1], *packed.tensors(), k, nlat_out, nlon_out)
    with pytest.raises(ValueError, match="rows 15\\+2"):
        native.kpacked_mix(x, weight, *packed.tensors(), k, nlat_out, nlon_out, 15, 2)
    with pytest.raises(ValueError, match="out must be a contiguous float32"):
        native.kpacked_mix(x, weight, *packed.tensors(), k, nlat_out, nlon_out,
                           out=torch.empty(1, 6, nlat_out, nlon_out + 1))


@pytest.mark.parametrize("rows, race_rows, raced_forwards", [(1, 1, 1), (8, 8, 4), (1, 4, 2)])
@pytest.mark.parametrize("kernel_s, winner", [(0.1, "kpacked_mix"), (0.5, "torch"), (0.25, "torch")])
def test_the_forward_races_the_kernel_against_torch_and_keeps_the_winner(kernel_s, winner, rows,
                                                                         race_rows,
                                                                         raced_forwards,
                                                                         monkeypatch):
    """A unit (a run of blocks of race_rows latitudes) lasts 0.25 s on the race's clock
    through torch, kernel_s through the kernel (a tie goes to torch). The units go A B B A ...
    over whole forwards (16 units of a row; 2 of 8 rows, when the race takes 4 forwards; 4 of
    4 blocks of a row, the kernel running each unit in one call), each side's first untimed;
    the race ends with the forward that gives both RACE_SAMPLES timed units, and the winner
    runs every later forward (the kernel in one call for all rows). Every output and
    gradient matches the reference."""
    from tilecast.runtime.disco import mix

    monkeypatch.setattr(fused, "block_rows", lambda *args, **kwargs: rows)
    monkeypatch.setattr(fused, "RACE_ROWS", race_rows)
    now, calls, real_mix = [0.0], [], native.kpacked_mix

    def tick() -> float:
        return now[0]

    def timed_mix(*args, **kwargs):
        # (first row, rows) of a block, or of all nlat_out
        calls.append((args[8], args[9]) if len(args) > 9 else (0, args[6]))
        now[0] += kernel_s
        return real_mix(*args, **kwargs)

    real_matmul_into = fused._matmul_into

    def timed_matmul_into(*args, **kwargs):   # one block of a unit
        now[0] += 0.25 * rows / race_rows
        return real_matmul_into(*args, **kwargs)

    monkeypatch.setattr(mix, "clock", tick)
    monkeypatch.setattr(native, "kpacked_mix", timed_mix)
    monkeypatch.setattr(fused, "_matmul_into", timed_matmul_into)
    conv = _mix_module("same", 5, 7)
    x, grad = torch.randn(2, 5, *conv.in_shape), torch.randn(2, 7, *conv.out_shape)
    key = ("kpacked_mix", (2, 5, 16, 32), 7, (16, 32))
    expected = _reference(conv, x, grad)
    units = 16 // race_rows
    for call in range(raced_forwards + 2):
        for actual, want in zip(_run(conv, x, grad), expected):
            assert _rel_error(actual, want) < 1e-5
        race = conv.mixer.races[key]
        assert (race.winner is None) == (call < raced_forwards - 1)
        if call == raced_forwards - 1:
            assert race.winner == winner
            raced = units * raced_forwards
            pattern = ["torch", "kpacked_mix", "kpacked_mix", "torch"] * raced
            sides = pattern[:raced]
            timed = {side: sides.count(side) - 1 for side in race.contenders}
            assert {side: len(t) for side, t in race.seconds.items()} == timed
            assert min(timed.values()) >= mix.RACE_SAMPLES
            assert race.medians() == pytest.approx({"torch": 0.25, "kpacked_mix": kernel_s})
            # the kernel's units, one call each, in the pattern's places
            assert calls == [((i % units) * race_rows, race_rows) for i, side in enumerate(sides)
                             if side == "kpacked_mix"]
            calls.clear()
    # the two later forwards: the kernel once each over all 16 rows, or never
    assert calls == ([(0, 16), (0, 16)] if winner == "kpacked_mix" else [])


def test_the_kernel_mix_applies_only_where_it_can_run():
    conv = _mix_module("same", 4, 6)
    packed = conv._kpacked()
    x, weight = torch.randn(1, 4, *conv.in_shape), conv.weight
    assert fused.kernel_mix_applies(x, weight, packed, 1, fused.Mixer())
    assert not fused.kernel_mix_applies(x, weight, packed, 2, fused.Mixer())
    assert not fused.kernel_mix_applies(x, weight, None, 1, fused.Mixer())
    assert not fused.kernel_mix_applies(x.bfloat16(), weight, packed, 1, fused.Mixer())
    assert not fused.kernel_mix_applies(x, weight, packed, 1, fused.Mixer(in_kernel=False))
    name = "gemm_fp32_avx2_6x16_mc192_nc2048_kc256_parm_pa1_pf0"
    # a GEMM kernel forced on every product keeps the forward's products on it; a raced one
    # races the one-kernel mix too
    assert not fused.kernel_mix_applies(x, weight, packed, 1, fused.Mixer(name, race=False))
    assert fused.kernel_mix_applies(x, weight, packed, 1, fused.Mixer(name))
    narrow = _module(True, grid="same")   # nlon_out 24: a partial last panel, which it cuts
    assert fused.kernel_mix_applies(torch.randn(1, 4, 12, 24), narrow.weight, narrow._kpacked(), 1,
                                    fused.Mixer())
    # race=False runs the kernel on every forward, no race kept
    forced = _mix_module("same", 4, 6)
    forced.mixer = fused.Mixer(race=False)
    assert _rel_error(forced(x), conv(x)) < 1e-6 and not forced.mixer.races
