"""The CPU DISCO kernels, the tilecast:: custom ops and the DiscoConvS2 modules: the ops against
tilecast.disco.reference in float64, the modules against torch-harmonics' modules
(optimized_kernel=False) with the same weights."""
from __future__ import annotations

import pytest
import torch

try:
    import torch_harmonics as th
except ImportError:
    th = None

from tilecast.disco import compute_psi, csr_from_psi, native, ops, reference
from tilecast.runtime.disco import DiscoConvS2, DiscoConvTransposeS2

#: torch-harmonics 0.9.3 needs Python >= 3.11 and torch 2.14: the README's set-up installs it with
#: --no-deps; where it is not installed (Python 3.10, a slim install) its comparisons skip
NO_TORCH_HARMONICS = ("torch-harmonics is not installed (it needs Python >= 3.11; the README's "
                      "set-up installs it with --no-deps)")
needs_torch_harmonics = pytest.mark.skipif(th is None, reason=NO_TORCH_HARMONICS)

# torch-harmonics warns that its default cutoff changed for non-equiangular grids
pytestmark = pytest.mark.filterwarnings("ignore:Default theta_cutoff changed")

# (in_shape, out_shape, theta_cutoff): same grid, downsampling (stride 2), stride 3 with odd
# latitude counts, and grids wider than a register tile (full tiles, tails, the wrap path)
GRIDS = {
    "same": ((12, 24), (12, 24), None),
    "down": ((24, 48), (12, 24), None),
    "stride3": ((13, 36), (7, 12), None),
    "wide": ((8, 100), (8, 100), 0.6),
    "wide_down": ((16, 200), (8, 100), 0.5),
}
# C across the transpose kernel's channel tiles (1, 4, 8) and their remainders
BATCH_CHANNELS = [(1, 1), (2, 3), (1, 4), (1, 5), (1, 8), (2, 9), (1, 17)]


def _psi(name, basis=("harmonic", (3, 3))):
    in_shape, out_shape, cutoff = GRIDS[name]
    return compute_psi(in_shape, out_shape, basis[1], basis_type=basis[0], basis_norm_mode="mean",
                       grid_in="equiangular", grid_out="legendre-gauss", theta_cutoff=cutoff)


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


def _contract(x, psi, csr):
    return ops.disco_contraction(x, *csr.tensors(), psi.kernel_size, *psi.out_shape)


def _transpose(y, psi, csr):
    return ops.disco_transpose_contraction(y, *csr.tensors(), *psi.in_shape)


@pytest.mark.parametrize("batch, channels", BATCH_CHANNELS)
@pytest.mark.parametrize("grid", list(GRIDS))
def test_contractions_match_float64_reference(grid, batch, channels):
    psi = _psi(grid)
    csr = csr_from_psi(psi)
    generator = torch.Generator().manual_seed(channels)
    x = torch.randn(batch, channels, *psi.in_shape, dtype=torch.float64, generator=generator)
    y = torch.randn(batch, channels, psi.kernel_size, *psi.out_shape, dtype=torch.float64,
                    generator=generator)
    out = _contract(x.float(), psi, csr)
    assert out.dtype == torch.float32 and out.shape == (batch, channels, psi.kernel_size, *psi.out_shape)
    assert _rel_error(out, reference.disco_contraction(x, psi, psi.out_shape[1])) < 1e-5
    back = _transpose(y.float(), psi, csr)
    assert back.shape == x.shape
    assert _rel_error(back, reference.disco_transpose_contraction(y, psi, psi.in_shape[1])) < 1e-5


def test_piecewise_linear_basis_rows_with_different_supports():
    psi = _psi("down", basis=("piecewise linear", (4, 3)))
    x = torch.randn(2, 3, *psi.in_shape, dtype=torch.float64)
    out = _contract(x.float(), psi, csr_from_psi(psi))
    assert _rel_error(out, reference.disco_contraction(x, psi, psi.out_shape[1])) < 1e-5


def test_contraction_of_a_point_source_is_psi_itself():
    """A unit impulse at input (hi, 0) gives y[k, ho, wo] = psi[k, ho, hi * nlon_in - wo * s mod nlon_in]."""
    psi = _psi("down")
    (nlat_in, nlon_in), (nlat_out, nlon_out) = psi.in_shape, psi.out_shape
    x = torch.zeros(1, 1, nlat_in, nlon_in)
    x[0, 0, 5, 0] = 1.0
    out = _contract(x, psi, csr_from_psi(psi))[0, 0]
    dense = torch.zeros(psi.kernel_size, nlat_out, nlat_in, nlon_in, dtype=torch.float64)
    dense[psi.idx[0], psi.idx[1], psi.idx[2] // nlon_in, psi.idx[2] % nlon_in] = psi.vals
    stride = nlon_in // nlon_out
    expected = torch.stack([dense[:, :, 5, (-wo * stride) % nlon_in] for wo in range(nlon_out)], dim=-1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grid", ["same", "wide_down"])
def test_op_gradients_match_reference_autograd(grid):
    psi = _psi(grid)
    csr = csr_from_psi(psi)
    x = torch.randn(2, 5, *psi.in_shape, dtype=torch.float64)
    y = torch.randn(2, 5, psi.kernel_size, *psi.out_shape, dtype=torch.float64)

    ours_x = x.float().requires_grad_()
    (_contract(ours_x, psi, csr) * y.float()).sum().backward()
    ref_x = x.clone().requires_grad_()
    (reference.disco_contraction(ref_x, psi, psi.out_shape[1]) * y).sum().backward()
    assert _rel_error(ours_x.grad, ref_x.grad) < 1e-5

    ours_y = y.float().requires_grad_()
    (_transpose(ours_y, psi, csr) * x.float()).sum().backward()
    ref_y = y.clone().requires_grad_()
    (reference.disco_transpose_contraction(ref_y, psi, psi.in_shape[1]) * x).sum().backward()
    assert _rel_error(ours_y.grad, ref_y.grad) < 1e-5


def test_opcheck_both_ops():
    psi = _psi("down")
    csr = csr_from_psi(psi)
    x = torch.randn(2, 3, *psi.in_shape, requires_grad=True)
    y = torch.randn(2, 3, psi.kernel_size, *psi.out_shape, requires_grad=True)
    torch.library.opcheck(ops.disco_contraction, (x, *csr.tensors(), psi.kernel_size, *psi.out_shape))
    torch.library.opcheck(ops.disco_transpose_contraction, (y, *csr.tensors(), *psi.in_shape))


def _assert_half_precision_follows_float32(dtype, bound, grid, channels):
    """16-bit input: within `bound` of the float32 result, and exactly the float32 result of
    the same (widened) input rounded to the input's dtype."""
    psi = _psi(grid)
    csr = csr_from_psi(psi)
    x = torch.randn(1, channels, *psi.in_shape)
    y = torch.randn(1, channels, psi.kernel_size, *psi.out_shape)
    out = _contract(x.to(dtype), psi, csr)
    assert out.dtype == dtype
    assert _rel_error(out, _contract(x, psi, csr)) < bound
    assert torch.equal(out, _contract(x.to(dtype).float(), psi, csr).to(dtype))
    back = _transpose(y.to(dtype), psi, csr)
    assert back.dtype == dtype
    assert _rel_error(back, _transpose(y, psi, csr)) < bound
    assert torch.equal(back, _transpose(y.to(dtype).float(), psi, csr).to(dtype))


@pytest.mark.parametrize("grid, channels", [("wide_down", 9), ("wide", 5), ("stride3", 1)])
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 2**-6), (torch.float16, 2**-9)])
def test_half_precision_inputs_compute_in_float32_and_keep_their_dtype(dtype, bound, grid, channels):
    _assert_half_precision_follows_float32(dtype, bound, grid, channels)


def test_autocast_runs_the_ops_in_float32():
    psi = _psi("same")
    csr = csr_from_psi(psi)
    x = torch.randn(1, 4, *psi.in_shape).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _contract(x, psi, csr)
        back = _transpose(out.bfloat16(), psi, csr)
    assert out.dtype == torch.float32 and back.dtype == torch.float32
    torch.testing.assert_close(out, _contract(x.float(), psi, csr))


def test_float64_is_refused_with_a_pointer_to_the_reference():
    psi = _psi("same")
    with pytest.raises(ValueError, match="float64.*reference"):
        _contract(torch.randn(1, 1, *psi.in_shape, dtype=torch.float64), psi, csr_from_psi(psi))


@pytest.mark.parametrize("shape, message", [
    ((4, 12, 24), r"\(B, C, nlat_in, nlon_in\), got shape \(4, 12, 24\)"),
    ((1, 4, 12, 30), r"nlon_in \(30.*multiple of nlon_out \(24\)"),
    ((1, 4, 24, 48), r"psi does not fit x of shape \(1, 4, 24, 48\)"),
])
def test_bad_input_to_the_contraction_names_the_shapes(shape, message):
    psi = _psi("same")
    with pytest.raises(ValueError, match=message):
        _contract(torch.randn(*shape), psi, csr_from_psi(psi))


def test_bad_input_to_the_transpose_names_the_shapes():
    psi = _psi("down")
    csr = csr_from_psi(psi)
    with pytest.raises(ValueError, match=r"\(B, C, K, nlat_out, nlon_out\), got shape \(1, 9, 12, 24\)"):
        _transpose(torch.randn(1, 9, 12, 24), psi, csr)
    with pytest.raises(ValueError, match=r"multiple of y's nlon_out \(20, shape \(1, 2, 9, 12, 20\)\)"):
        _transpose(torch.randn(1, 2, 9, 12, 20), psi, csr)


def test_kernel_rejects_psi_columns_outside_the_grid():
    psi = _psi("same")
    csr = csr_from_psi(psi)
    tensors = list(csr.tensors())
    tensors[1] = tensors[1].clone()
    tensors[1][-1] = psi.in_shape[0] * psi.in_shape[1]
    with pytest.raises(ValueError, match="outside the grid"):
        ops.disco_contraction(torch.randn(1, 1, *psi.in_shape), *tensors, psi.kernel_size, *psi.out_shape)


def _cpu_flags() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return cpuinfo.read()


# the kernels' other instruction-set paths, built (once, cached) and run on this machine: AVX2
# (the #else of every AVX-512 choice) and AVX-512 without the bfloat16 conversion instructions
ISA_BUILDS = {"avx2": ("avx2", ("-march=haswell",)),
              "avx512-no-bf16": ("avx512f", ("-march=native", "-mno-avx512bf16"))}


@pytest.mark.parametrize("isa", list(ISA_BUILDS))
def test_other_isa_builds_match_reference(isa, monkeypatch):
    needed, march = ISA_BUILDS[isa]
    if needed not in _cpu_flags().split():
        pytest.skip(f"needs a CPU with {needed}")
    flags = tuple(f for f in native.FLAGS if f != "-march=native") + march
    monkeypatch.setattr(native, "_library", native.load_library(native.compile_library(flags=flags)))
    for grid, channels in [("wide", 1), ("wide", 5), ("wide_down", 9), ("stride3", 17)]:
        psi = _psi(grid)
        csr = csr_from_psi(psi)
        x = torch.randn(1, channels, *psi.in_shape, dtype=torch.float64)
        y = torch.randn(1, channels, psi.kernel_size, *psi.out_shape, dtype=torch.float64)
        assert _rel_error(_contract(x.float(), psi, csr), reference.disco_contraction(x, psi, psi.out_shape[1])) < 1e-5
        assert _rel_error(_transpose(y.float(), psi, csr),
                          reference.disco_transpose_contraction(y, psi, psi.in_shape[1])) < 1e-5
    _assert_half_precision_follows_float32(torch.bfloat16, 2**-6, "wide_down", 9)
    _assert_half_precision_follows_float32(torch.float16, 2**-9, "wide", 5)


def test_build_error_names_the_compiler_and_quotes_its_errors(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("int main() { return undeclared_name; }\n")
    with pytest.raises(native.DiscoBuildError, match=r"(?s)'g\+\+'.*undeclared_name"):
        native.compile_library(source, "g++", tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so")) and not list((tmp_path / "cache").glob(".*tmp"))


# ---------------------------------------------------------------- modules vs torch-harmonics

MODULE_CASES = {
    "same-default": dict(in_shape=(12, 24), out_shape=(12, 24), kernel_shape=(3, 3)),
    "down-harmonic": dict(in_shape=(24, 48), out_shape=(12, 24), kernel_shape=(3, 3), basis_type="harmonic",
                          basis_norm_mode="mean", grid_in="equiangular", grid_out="legendre-gauss"),
    "wide-piecewise": dict(in_shape=(8, 100), out_shape=(8, 100), kernel_shape=(3, 4), theta_cutoff=0.6),
}


def _copy_parameters(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    with torch.no_grad():
        theirs.bias.normal_()
        ours.weight.copy_(theirs.weight)
        ours.bias.copy_(theirs.bias)


def _assert_same_module_results(ours, theirs, in_channels, in_shape):
    x = torch.randn(2, in_channels, *in_shape)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_theirs = ours(x_ours), theirs(x_theirs)
    assert out_ours.shape == out_theirs.shape
    assert _rel_error(out_ours, out_theirs) < 1e-5
    grad = torch.randn_like(out_theirs)
    out_ours.backward(grad)
    out_theirs.backward(grad)
    assert _rel_error(x_ours.grad, x_theirs.grad) < 1e-5
    assert _rel_error(ours.weight.grad, theirs.weight.grad) < 1e-5
    assert _rel_error(ours.bias.grad, theirs.bias.grad) < 1e-6


@needs_torch_harmonics
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_conv_module_matches_torch_harmonics(case, groups):
    kwargs = MODULE_CASES[case]
    torch.manual_seed(0)
    theirs = th.DiscreteContinuousConvS2(4, 6, groups=groups, optimized_kernel=False, **kwargs)
    ours = DiscoConvS2(4, 6, groups=groups, **kwargs)
    assert ours.weight.shape == theirs.weight.shape and ours.theta_cutoff == theirs.theta_cutoff
    _copy_parameters(ours, theirs)
    _assert_same_module_results(ours, theirs, 4, kwargs["in_shape"])


@needs_torch_harmonics
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("shapes", [((12, 24), (12, 24)), ((12, 24), (24, 48))], ids=["same", "up"])
def test_transpose_module_matches_torch_harmonics(shapes, groups):
    in_shape, out_shape = shapes
    kwargs = dict(in_shape=in_shape, out_shape=out_shape, kernel_shape=(3, 3), basis_type="harmonic",
                  basis_norm_mode="mean", grid_in="legendre-gauss", grid_out="equiangular")
    torch.manual_seed(0)
    theirs = th.DiscreteContinuousConvTransposeS2(4, 6, groups=groups, optimized_kernel=False, **kwargs)
    ours = DiscoConvTransposeS2(4, 6, groups=groups, **kwargs)
    _copy_parameters(ours, theirs)
    _assert_same_module_results(ours, theirs, 4, in_shape)


@needs_torch_harmonics
def test_weight_initialisation_scale_matches_torch_harmonics():
    torch.manual_seed(3)
    theirs = th.DiscreteContinuousConvS2(16, 32, (12, 24), (12, 24), (3, 3), groups=2, optimized_kernel=False)
    torch.manual_seed(3)
    ours = DiscoConvS2(16, 32, (12, 24), (12, 24), (3, 3), groups=2)
    torch.testing.assert_close(ours.weight, theirs.weight)
    assert ours.bias is not None and not ours.bias.any()
    assert DiscoConvS2(4, 4, (12, 24), (12, 24), 3, bias=False).bias is None


@needs_torch_harmonics
def test_module_in_float64_runs_the_reference():
    torch.manual_seed(0)
    theirs = th.DiscreteContinuousConvS2(3, 4, (24, 48), (12, 24), (3, 3), optimized_kernel=False).double()
    ours = DiscoConvS2(3, 4, (24, 48), (12, 24), (3, 3)).double()
    _copy_parameters(ours, theirs)
    x = torch.randn(1, 3, 24, 48, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-12)


def test_module_cast_to_bfloat16_keeps_psi_exact():
    conv = DiscoConvS2(4, 4, (12, 24), (12, 24), (3, 3))
    vals = conv.csr().vals.clone()
    conv = conv.bfloat16()
    assert conv.weight.dtype == torch.bfloat16
    assert torch.equal(conv.csr().vals, vals)
    x = torch.randn(1, 4, 12, 24)
    out = conv(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert _rel_error(out, conv.float()(x)) < 2**-5


def test_module_bad_input_names_the_shapes():
    conv = DiscoConvS2(4, 6, (24, 48), (12, 24), (3, 3))
    with pytest.raises(ValueError, match=r"expects x of shape \(B, 4, 24, 48\), got \(1, 4, 12, 24\)"):
        conv(torch.randn(1, 4, 12, 24))
    with pytest.raises(ValueError, match=r"expects x of shape \(B, 4, 24, 48\), got \(1, 3, 24, 48\)"):
        conv(torch.randn(1, 3, 24, 48))
    with pytest.raises(ValueError, match=r"nlon_in \(50\) must be an integer multiple of nlon_out \(24\)"):
        DiscoConvS2(4, 6, (24, 50), (12, 24), (3, 3))
    with pytest.raises(ValueError, match=r"nlon_out \(50\) must be a multiple of nlon_in \(24\)"):
        DiscoConvTransposeS2(4, 6, (12, 24), (24, 50), (3, 3))
    with pytest.raises(ValueError, match=r"multiples of groups \(4\)"):
        DiscoConvS2(6, 6, (12, 24), (12, 24), (3, 3), groups=4)


@pytest.mark.parametrize("batch, channels", BATCH_CHANNELS)
def test_every_transpose_channel_tile_matches_the_reference_at_its_boundaries(batch, channels):
    """BC_TILE boundaries: each instantiated channel tile (1, 4, 8; the automatic choice may
    use only some of them on this ISA) on channel counts below, at and past its size, against
    the float64 reference."""
    psi = _psi("stride3")
    csr = csr_from_psi(psi)
    y = torch.randn(batch, channels, psi.kernel_size, *psi.out_shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(batch * 31 + channels))
    expected = reference.disco_transpose_contraction(y, psi, psi.in_shape[1])
    tiles = native.variant_tiles("transpose")
    assert {bt for bt, _ in tiles} >= {1, 4, 8}
    for bt, nv in tiles:
        back = native.transpose_contraction(y.float(), csr.troff, csr.tcol, csr.tvals,
                                            *psi.in_shape, tile=(bt, nv, 2))
        assert _rel_error(back, expected) < 1e-5, (bt, nv)
