"""The line-blocked transpose (kernels/cpu/disco/disco_lines_transpose.hpp, tilecast.disco.lines):
its layout against the transpose CSR it regroups, the kernel bit for bit against the CSR
transpose in three precisions, its bad input refused, and its use by the fused and the
kpacked paths' backwards."""
from __future__ import annotations

import pytest
import torch

from tilecast.disco import compute_psi, csr_from_psi, native, ops, reference
from tilecast.runtime.disco import DiscoConvS2, DiscoConvTransposeS2, fused
from tilecast.disco.lines import MIN_FILL, line_blocked, regroup

# (in_shape, out_shape, theta_cutoff): strides 1, 2, 3; tiles wider than nlon_out, cut last tiles
GRIDS = {
    "same": ((12, 24), (12, 24), 0.4),
    "down": ((24, 48), (12, 24), None),
    "stride3": ((13, 36), (7, 12), None),
    "wide_down": ((16, 200), (8, 100), 0.5),
    "tail": ((14, 112), (7, 56), 0.5),  # a last tile of 56 longitudes: 4 of 6 zmm vectors
}


def _csr(grid, basis=("harmonic", (3, 3))):
    in_shape, out_shape, cutoff = GRIDS[grid]
    psi = compute_psi(in_shape, out_shape, basis[1], basis_type=basis[0], basis_norm_mode="mean",
                      grid_in="equiangular", grid_out="legendre-gauss", theta_cutoff=cutoff)
    return psi, csr_from_psi(psi)


def test_regroup_known_answer():
    """Three lines in blocks of two: line 0 reads columns 1 and 4, line 1 column 4, line 2
    column 0."""
    troff = torch.tensor([0, 2, 3, 4])
    tcol = torch.tensor([1, 4, 4, 0])
    tvals = torch.tensor([0.5, 1.5, 2.5, 3.5])
    layout = regroup(troff, tcol, tvals, 2)
    assert layout.boff.tolist() == [0, 2, 3]
    assert layout.bcol.tolist() == [1, 4, 0]
    assert layout.bvals.tolist() == [[0.5, 0.0], [1.5, 2.5], [3.5, 0.0]]
    assert layout.fill == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="positive integer"):
        regroup(troff, tcol, tvals, 0)


@pytest.mark.parametrize("grid", list(GRIDS))
def test_regroup_holds_every_transpose_entry_once(grid):
    psi, csr = _csr(grid)
    block = native.line_block()
    layout = regroup(csr.troff, csr.tcol, csr.tvals, block)
    lines = csr.troff.numel() - 1
    assert layout.boff.numel() == -(-lines // block) + 1 and layout.boff[-1] == layout.bcol.numel()
    columns = psi.kernel_size * psi.out_shape[0] * psi.out_shape[1]
    dense = torch.zeros(lines, columns)
    line_of = torch.repeat_interleave(torch.arange(lines), csr.troff.diff())
    dense[line_of, csr.tcol] = csr.tvals
    rebuilt = torch.zeros(lines, columns)
    for b in range(layout.boff.numel() - 1):
        keys = slice(int(layout.boff[b]), int(layout.boff[b + 1]))
        assert torch.all(layout.bcol[keys].diff() > 0)           # ascending, unique per block
        for i in range(min(block, lines - b * block)):
            rebuilt[b * block + i, layout.bcol[keys]] = layout.bvals[keys, i]
        assert torch.all(layout.bvals[keys, lines - b * block:] == 0)
    assert torch.equal(rebuilt, dense)
    assert layout.fill == pytest.approx(csr.tcol.numel() / layout.bvals.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [1, 3, 9])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_line_blocked_transpose_equals_the_csr_transpose_bit_for_bit(grid, channels, dtype):
    psi, csr = _csr(grid)
    layout = regroup(csr.troff, csr.tcol, csr.tvals, native.line_block())
    y = torch.randn(2, channels, psi.kernel_size, *psi.out_shape,
                    generator=torch.Generator().manual_seed(channels)).to(dtype)
    expected = native.transpose_contraction(y, csr.troff, csr.tcol, csr.tvals, *psi.in_shape)
    actual = native.transpose_lines(y, *layout.tensors(), *psi.in_shape)
    assert actual.dtype == dtype and torch.equal(actual, expected)
    if dtype == torch.float32:
        exact = reference.disco_transpose_contraction(y.double(), psi, psi.in_shape[1])
        assert float((actual.double() - exact).norm() / exact.norm()) < 1e-5


def test_line_blocked_transpose_refuses_bad_layouts():
    psi, csr = _csr("down")
    layout = regroup(csr.troff, csr.tcol, csr.tvals, native.line_block())
    y = torch.randn(1, 2, psi.kernel_size, *psi.out_shape)
    boff, bcol, bvals = layout.tensors()
    with pytest.raises(ValueError, match="bvals must be"):
        native.transpose_lines(y, boff, bcol, bvals[:, :1].contiguous(), *psi.in_shape)
    short = boff.clone()
    short[-1] -= 1
    with pytest.raises(ValueError, match="bad row offsets"):
        native.transpose_lines(y, short, bcol, bvals, *psi.in_shape)
    outside = bcol.clone()
    outside[3] = psi.kernel_size * psi.out_shape[0] * psi.out_shape[1]
    with pytest.raises(ValueError, match="outside the grid"):
        native.transpose_lines(y, boff, outside, bvals, *psi.in_shape)
    with pytest.raises(ValueError, match="bad shape"):   # psi for another grid
        native.transpose_lines(y, boff, bcol, bvals, psi.in_shape[0], psi.in_shape[1] + 1)


def test_line_blocked_is_built_only_from_the_minimum_fill():
    _, dense = _csr("wide_down")
    _, sparse = _csr("same")
    block = native.line_block()
    assert regroup(dense.troff, dense.tcol, dense.tvals, block).fill >= MIN_FILL
    assert regroup(sparse.troff, sparse.tcol, sparse.tvals, block).fill < MIN_FILL
    assert line_blocked(dense, block) is not None and line_blocked(sparse, block) is None
    assert line_blocked(sparse, block, min_fill=0.0) is not None


def test_the_fused_backward_runs_the_line_blocked_bands_and_matches_the_reference(monkeypatch):
    in_shape, out_shape, cutoff = GRIDS["wide_down"]
    torch.manual_seed(0)
    conv = DiscoConvS2(3, 5, in_shape, out_shape, (3, 3), basis_type="harmonic",
                       basis_norm_mode="mean", grid_in="equiangular", grid_out="legendre-gauss",
                       theta_cutoff=cutoff, fused=True)
    plan = conv._fused_plan(torch.device("cpu"))
    assert plan.transposed is None and any(b.band_lines is not None for b in plan.blocks)
    calls = []
    original = native.transpose_lines
    monkeypatch.setattr(native, "transpose_lines",
                        lambda *args: calls.append(1) or original(*args))
    x = torch.randn(2, 3, *in_shape, requires_grad=True)
    grad = torch.randn(2, 5, *out_shape)
    out = conv(x)
    out.backward(grad)
    assert len(calls) == sum(b.band_lines is not None for b in plan.blocks)
    xd = x.detach().double().requires_grad_()
    weight = conv.weight.detach().double().requires_grad_()
    expected = reference.disco_conv(xd, conv.psi, weight, out_shape[1], 1,
                                    conv.bias.detach().double())
    expected.backward(grad.double())
    for actual, want in ((out, expected), (x.grad, xd.grad), (conv.weight.grad, weight.grad)):
        assert float((actual.detach().double() - want).norm() / want.norm()) < 1e-5


def _unfused(grid, seed=0, basis_type="harmonic", kernel_shape=(3, 3)):
    in_shape, out_shape, cutoff = GRIDS[grid]
    torch.manual_seed(seed)
    return DiscoConvS2(3, 5, in_shape, out_shape, kernel_shape, basis_type=basis_type,
                       basis_norm_mode="mean", grid_in="equiangular", grid_out="legendre-gauss",
                       theta_cutoff=cutoff)


def _gradients(conv, x, grad):
    x = x.clone().requires_grad_()
    conv.zero_grad()
    conv(x).backward(grad)
    return x.grad, conv.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("forward", ["kpacked", "csr", "csr_piecewise_linear"])
def test_the_unfused_backward_runs_the_line_blocked_transpose_bit_for_bit(forward, dtype,
                                                                          monkeypatch):
    """On a dense filter the unfused paths' backward (after the kpacked or the CSR forward)
    is the line-blocked kernel, with the CSR transpose's gradients exactly; on a sparse one
    (fill < MIN_FILL) it stays CSR."""
    # piecewise linear (3,) on wide_down: no kpacked layout, fill 0.77
    basis, shape = (("piecewise linear", (3,)) if forward == "csr_piecewise_linear"
                    else ("harmonic", (3, 3)))
    conv = _unfused("wide_down", basis_type=basis, kernel_shape=shape).to(dtype)
    if forward == "csr":
        conv.psi_kpacked_K_pad = 24   # the seed's monkeypatch: kpacked ineligible
    assert (conv._kpacked() is not None) == (forward == "kpacked")
    spy = {}
    for name, module in (("transpose_lines", native), ("disco_transpose_contraction", ops),
                         ("disco_contraction", ops), ("disco_kpacked_contraction", ops)):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _f=original, **k:
                            spy.__setitem__(_n, spy.get(_n, 0) + 1) or _f(*a, **k))
    x = torch.randn(2, 3, *conv.in_shape, dtype=dtype)
    grad = torch.randn(2, 5, *conv.out_shape, dtype=dtype)
    lines_grads = _gradients(conv, x, grad)
    forward_op = "disco_kpacked_contraction" if forward == "kpacked" else "disco_contraction"
    assert spy == {forward_op: 1, "transpose_lines": 1}, spy
    assert conv._line_layout(torch.device("cpu")) is not None
    conv._line_layouts["cpu"] = None   # what line_blocked answers below MIN_FILL: CSR
    csr_grads = _gradients(conv, x, grad)
    assert spy == {forward_op: 2, "transpose_lines": 1, "disco_transpose_contraction": 1}, spy
    for actual, expected in zip(lines_grads, csr_grads):
        assert torch.equal(actual, expected)

    sparse = _unfused("same", basis_type=basis, kernel_shape=shape)
    sparse(torch.randn(1, 3, *sparse.in_shape, requires_grad=True)).sum().backward()
    assert spy["transpose_lines"] == 1 and sparse._line_layout(torch.device("cpu")) is None


@pytest.mark.parametrize("chosen", ["lines", "csr"])
def test_a_registry_choice_of_the_lines_kernel_runs_it_whatever_the_fill(chosen, monkeypatch):
    """Where a published disco_backward selector chose the lines kernel, the unfused backward
    runs it even on a sparse filter (fill < MIN_FILL, where it would run CSR on its own), with
    the CSR transpose's gradients exactly; a chosen CSR tile runs CSR."""
    from dataclasses import asdict

    from tilecast.spaces.disco import LANES, TILES, DiscoConfig, kernel_name

    isa = {lanes: name for name, lanes in LANES.items()}[native.lanes()]
    if chosen == "lines":
        (lb, nv), = TILES[("backward", "lines", isa)]
        config = DiscoConfig("backward", "lines", isa, 1, nv, 1, lb=lb)
    else:
        bt, nv = TILES[("backward", "csr", isa)][0]
        config = DiscoConfig("backward", "csr", isa, bt, nv, 4)
    choice = {"kernel": kernel_name(config), **asdict(config), "entry": config.runtime_entry(),
              "tile": config.tile()}
    calls = {}
    for name in ("transpose_lines", "transpose_contraction"):
        original = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _n=name, _f=original, **k:
                            calls.__setitem__(_n, calls.get(_n, 0) + 1) or _f(*a, **k))
    conv = _unfused("same")
    assert conv._line_layout(torch.device("cpu")) is None     # sparse: CSR on its own
    x = torch.randn(2, 3, *conv.in_shape)
    grad = torch.randn(2, 5, *conv.out_shape)
    csr_grads = _gradients(conv, x, grad)
    assert calls == {"transpose_contraction": 1}, calls
    # what DiscoConvS2(registry=...) asks the published selectors: no forward choice (the
    # library's tile), the backward kernel below
    monkeypatch.setattr(conv, "_chosen_kernels", lambda x: (None, choice))
    chosen_grads = _gradients(conv, x, grad)
    expected = {"lines": {"transpose_contraction": 1, "transpose_lines": 1},
                "csr": {"transpose_contraction": 2}}[chosen]
    assert calls == expected, calls
    if chosen == "lines":
        assert conv._chosen_line_layout(torch.device("cpu")).fill < MIN_FILL
    for actual, reference_grad in zip(chosen_grads, csr_grads):
        assert torch.equal(actual, reference_grad)


def test_the_line_layout_is_built_only_for_an_input_gradient():
    conv = _unfused("wide_down")
    x = torch.randn(1, 3, *conv.in_shape)
    conv(x).sum().backward()                      # weight gradient only
    with torch.no_grad():
        conv(x.requires_grad_())
    assert conv._line_layouts == {}
    conv(x).sum().backward()
    assert conv._line_layouts["cpu"] is not None


def test_a_chosen_csr_tile_and_the_line_layout_are_not_both_accepted():
    conv = _unfused("wide_down")
    packed = conv._kpacked()
    lines = conv._line_layout(torch.device("cpu"))
    x = torch.randn(1, 3, *conv.in_shape, requires_grad=True)
    with pytest.raises(ValueError, match="give one of them"):
        ops.disco_contraction_kpacked(x, *packed.tensors(), *conv._psi_tensors(),
                                      conv.kernel_size, *conv.out_shape, None, [1, 1, 1], lines)
    with pytest.raises(ValueError, match="runs on the CPU"):
        ops.disco_contraction_lines(x.to("meta"), *conv._psi_tensors(), conv.kernel_size,
                                    *conv.out_shape, lines)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_transpose_convolution_runs_the_line_blocked_transpose_bit_for_bit(dtype,
                                                                               monkeypatch):
    """DiscoConvTransposeS2 (upsampling) on a dense filter: its forward is the line-blocked
    kernel, with the CSR transpose's output and gradients exactly."""
    in_shape, out_shape, cutoff = GRIDS["wide_down"]
    torch.manual_seed(0)
    conv = DiscoConvTransposeS2(3, 5, out_shape, in_shape, (3, 3), basis_type="harmonic",
                                basis_norm_mode="mean", grid_in="legendre-gauss",
                                grid_out="equiangular", theta_cutoff=cutoff).to(dtype)
    calls = []
    original = native.transpose_lines
    monkeypatch.setattr(native, "transpose_lines", lambda *args: calls.append(1) or original(*args))
    x = torch.randn(2, 3, *out_shape, dtype=dtype)
    grad = torch.randn(2, 5, *in_shape, dtype=dtype)

    def run():
        xr = x.clone().requires_grad_()
        conv.zero_grad()
        out = conv(xr)
        out.backward(grad)
        return out.detach(), xr.grad, conv.weight.grad.clone()

    with_lines = run()
    assert len(calls) == 1 and conv._line_layout(torch.device("cpu")) is not None
    conv._line_layouts["cpu"] = None
    with_csr = run()
    assert len(calls) == 1
    for actual, expected in zip(with_lines, with_csr):
        assert torch.equal(actual, expected)
    conv._line_layouts.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):   # float32 out, as the CSR op's autocast
        autocast_lines = conv(x)
        assert len(calls) == 2
        conv._line_layouts["cpu"] = None
        autocast_csr = conv(x)
    assert autocast_lines.dtype == autocast_csr.dtype and torch.equal(autocast_lines, autocast_csr)
    with pytest.raises(ValueError, match="runs on the CPU"):
        ops.disco_transpose_contraction_lines(grad.to("meta").unsqueeze(2), *conv._psi_tensors(),
                                              *in_shape, conv._line_layout(torch.device("cpu")))


# ---------------------------------------------------------------- the line-blocked ops

def _rel_error(actual, expected) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


def _lines_problem(grid="down"):
    psi, csr = _csr(grid)
    return psi, csr, regroup(csr.troff, csr.tcol, csr.tvals, native.line_block())


@pytest.mark.parametrize("grid", ["down", "stride3"])
def test_line_blocked_ops_match_the_dense_reference_in_outputs_and_gradients(grid):
    """Both ops, their gradients (each the other op) and their gradients' gradients against
    the float64 reference."""
    psi, csr, layout = _lines_problem(grid)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, *psi.in_shape, generator=generator)
    y = torch.randn(2, 3, psi.kernel_size, *psi.out_shape, generator=generator)
    grad_y = torch.randn(2, 3, psi.kernel_size, *psi.out_shape, generator=generator)
    grad_x = torch.randn(2, 3, *psi.in_shape, generator=generator)
    cases = (  # op, its input, the reference, the gradient it is given
        (lambda t: ops.disco_lines_contraction(t, *csr.tensors(), *layout.tensors(),
                                               psi.kernel_size, *psi.out_shape),
         x, lambda t: reference.disco_contraction(t, psi, psi.out_shape[1]), grad_y),
        (lambda t: ops.disco_lines_transpose_contraction(t, *csr.tensors(), *layout.tensors(),
                                                         *psi.in_shape),
         y, lambda t: reference.disco_transpose_contraction(t, psi, psi.in_shape[1]), grad_x),
    )
    for op, value, exact, grad in cases:
        ours_in, ref_in = value.clone().requires_grad_(), value.double().requires_grad_()
        ours_grad, ref_grad = grad.clone().requires_grad_(), grad.double().requires_grad_()
        ours, ref = op(ours_in), exact(ref_in)
        assert ours.shape == ref.shape and ours.dtype == torch.float32
        assert _rel_error(ours, ref) < 1e-5
        ours_dx, = torch.autograd.grad(ours, ours_in, ours_grad, create_graph=True)
        ref_dx, = torch.autograd.grad(ref, ref_in, ref_grad, create_graph=True)
        assert _rel_error(ours_dx, ref_dx) < 1e-5
        # the gradient's gradient with respect to the incoming gradient: the op again
        ours_dx.backward(value)
        ref_dx.backward(value.double())
        assert _rel_error(ours_grad.grad, ref_grad.grad) < 1e-5


def test_line_blocked_gradients_run_the_line_blocked_kernel(monkeypatch):
    psi, csr, layout = _lines_problem()
    calls = []
    original = native.transpose_lines
    monkeypatch.setattr(native, "transpose_lines", lambda *a: calls.append(1) or original(*a))
    x = torch.randn(1, 2, *psi.in_shape, requires_grad=True)
    out = ops.disco_lines_contraction(x, *csr.tensors(), *layout.tensors(), psi.kernel_size,
                                      *psi.out_shape)
    assert calls == []
    out.backward(torch.randn_like(out))
    assert calls == [1]
    expected = native.transpose_contraction(torch.ones_like(out), csr.troff, csr.tcol, csr.tvals,
                                            *psi.in_shape)
    x.grad = None
    ops.disco_lines_contraction(x, *csr.tensors(), *layout.tensors(), psi.kernel_size,
                                *psi.out_shape).sum().backward()
    assert torch.equal(x.grad, expected)   # bit for bit the CSR transpose


def test_opcheck_line_blocked_ops():
    psi, csr, layout = _lines_problem()
    x = torch.randn(2, 3, *psi.in_shape, requires_grad=True)
    y = torch.randn(2, 3, psi.kernel_size, *psi.out_shape, requires_grad=True)
    torch.library.opcheck(ops.disco_lines_contraction,
                          (x, *csr.tensors(), *layout.tensors(), psi.kernel_size, *psi.out_shape))
    torch.library.opcheck(ops.disco_lines_transpose_contraction,
                          (y, *csr.tensors(), *layout.tensors(), *psi.in_shape))


def test_line_blocked_ops_autocast_in_float32_as_the_csr_ops():
    psi, csr, layout = _lines_problem()
    x = torch.randn(1, 2, *psi.in_shape).bfloat16()
    y = torch.randn(1, 2, psi.kernel_size, *psi.out_shape).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pairs = ((ops.disco_lines_contraction(x, *csr.tensors(), *layout.tensors(),
                                              psi.kernel_size, *psi.out_shape),
                  ops.disco_contraction(x, *csr.tensors(), psi.kernel_size, *psi.out_shape)),
                 (ops.disco_lines_transpose_contraction(y, *csr.tensors(), *layout.tensors(),
                                                        *psi.in_shape),
                  ops.disco_transpose_contraction(y, *csr.tensors(), *psi.in_shape)))
    for lines_out, csr_out in pairs:
        assert lines_out.dtype == csr_out.dtype == torch.float32
        assert torch.equal(lines_out, csr_out)


def test_line_blocked_ops_refuse_a_layout_of_another_psi():
    psi, csr, _ = _lines_problem("down")
    _, other_csr, other = _lines_problem("same")
    x = torch.randn(1, 2, *psi.in_shape)
    y = torch.randn(1, 2, psi.kernel_size, *psi.out_shape)
    with pytest.raises(ValueError, match=r"line-blocked layout does not fit psi's transpose of "
                                         r"48 lines"):
        ops.disco_lines_contraction(x, *csr.tensors(), *other.tensors(), psi.kernel_size,
                                    *psi.out_shape)
    with pytest.raises(ValueError, match="line-blocked layout does not fit"):
        ops.disco_lines_transpose_contraction(y, *csr.tensors(), *other.tensors(), *psi.in_shape)
    with pytest.raises(ValueError, match="psi does not fit"):
        ops.disco_lines_transpose_contraction(y, *other_csr.tensors(), *other.tensors(),
                                              *psi.in_shape)
