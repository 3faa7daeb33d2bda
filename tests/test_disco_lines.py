"""The line-blocked transpose (kernels/cpu/disco_lines_transpose.hpp, tilecast.disco.lines):
its layout against the transpose CSR it regroups, the kernel bit for bit against the CSR
transpose in three precisions, its bad input refused, and the fused backward's use of it."""
from __future__ import annotations

import pytest
import torch

from tilecast.disco import DiscoConvS2, compute_psi, csr_from_psi, fused, native, reference
from tilecast.disco.lines import MIN_FILL, line_blocked, regroup

GRIDS = {  # (in_shape, out_shape, theta_cutoff): strides 1, 2, 3; tiles wider than nlon_out
    "same": ((12, 24), (12, 24), 0.4),
    "down": ((24, 48), (12, 24), None),
    "stride3": ((13, 36), (7, 12), None),
    "wide_down": ((16, 200), (8, 100), 0.5),
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
