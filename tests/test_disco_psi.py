"""tilecast.disco against torch-harmonics: grids, the psi tensor entry for entry, and the
reference convolutions against DiscreteContinuousConvS2 / ...TransposeS2 (optimized_kernel=False)."""
from __future__ import annotations

import itertools

import pytest
import torch

try:
    import torch_harmonics as th
    from torch_harmonics.disco.convolution import _precompute_convolution_tensor_s2
    from torch_harmonics.filter_basis import get_filter_basis
    from torch_harmonics.quadrature import (compute_theta_cutoff, precompute_latitudes,
                                            precompute_longitudes)
except ImportError:
    th = None

from tilecast.disco import (compute_psi, default_theta_cutoff, disco_contraction, disco_conv,
                            disco_transpose_contraction, disco_transpose_conv, latitudes, longitudes)

#: torch-harmonics 0.9.3 needs Python >= 3.11 and torch 2.14: the README's set-up installs it with
#: --no-deps; where it is not installed (Python 3.10, a slim install) its comparisons skip
NO_TORCH_HARMONICS = ("torch-harmonics is not installed (it needs Python >= 3.11; the README's "
                      "set-up installs it with --no-deps)")
needs_torch_harmonics = pytest.mark.skipif(th is None, reason=NO_TORCH_HARMONICS)

# torch-harmonics warns that its default cutoff changed for non-equiangular grids
pytestmark = pytest.mark.filterwarnings("ignore:Default theta_cutoff changed")

GRID_PAIRS = [("equiangular", "equiangular"), ("legendre-gauss", "legendre-gauss"),
              ("equiangular", "legendre-gauss"), ("legendre-gauss", "equiangular")]
BASES = [("piecewise linear", (3, 3)), ("piecewise linear", 3), ("piecewise linear", (4, 3)),
         ("harmonic", (3, 3))]
NORM_MODES = ["none", "mean", "support", "nodal", "geometric"]
SAME, DOWN = ((12, 24), (12, 24)), ((24, 48), (12, 24))


def reference_psi(in_shape, out_shape, kernel_shape, basis_type, norm_mode, grid_in, grid_out,
                  theta_cutoff, transpose_normalization, merge_quadrature=True):
    """torch-harmonics' psi, called as its conv modules call it, sorted like ours."""
    if theta_cutoff is None:
        theta_cutoff = compute_theta_cutoff(out_shape[0], grid=grid_out)
    idx, vals, _ = _precompute_convolution_tensor_s2(
        in_shape, out_shape, get_filter_basis(kernel_shape=kernel_shape, basis_type=basis_type),
        grid_in=grid_in, grid_out=grid_out, theta_cutoff=theta_cutoff,
        transpose_normalization=transpose_normalization, basis_norm_mode=norm_mode,
        merge_quadrature=merge_quadrature)
    key = (idx[0] * out_shape[0] + idx[1]) * (in_shape[0] * in_shape[1]) + idx[2]
    order = torch.argsort(key)
    return idx[:, order], vals[order]


@needs_torch_harmonics
@pytest.mark.parametrize("grid", ["equiangular", "legendre-gauss"])
@pytest.mark.parametrize("nlat", [2, 3, 12, 25, 181])
def test_grids_match_torch_harmonics(grid, nlat):
    colatitudes, weights = latitudes(nlat, grid)
    their_colatitudes, their_weights = precompute_latitudes(nlat, grid=grid)
    assert torch.equal(colatitudes, their_colatitudes)
    torch.testing.assert_close(weights, their_weights, rtol=1e-12, atol=0)
    assert default_theta_cutoff(nlat, grid) == compute_theta_cutoff(nlat, grid=grid)


@pytest.mark.parametrize("grid", ["equiangular", "legendre-gauss"])
def test_grid_weights_integrate_polynomials_in_cos_theta(grid):
    colatitudes, weights = latitudes(9, grid)
    x = torch.cos(colatitudes)
    assert float(weights.sum()) == pytest.approx(2.0, abs=1e-14)
    assert float((weights * x**2).sum()) == pytest.approx(2.0 / 3.0, abs=1e-14)
    assert float((weights * x**3).sum()) == pytest.approx(0.0, abs=1e-14)


def test_equiangular_default_cutoff_is_one_latitude_step():
    assert default_theta_cutoff(13, "equiangular") == pytest.approx(torch.pi / 12, rel=1e-13)


@needs_torch_harmonics
@pytest.mark.parametrize("nlon", [1, 24, 1440])
def test_longitudes_match_torch_harmonics(nlon):
    assert torch.equal(longitudes(nlon), precompute_longitudes(nlon))


def _psi_case(shapes, grids, basis, norm_mode, theta_cutoff, transpose):
    label = "-".join([f"{shapes[0][0]}to{shapes[1][0]}", f"{grids[0]}>{grids[1]}",
                      f"{basis[0].replace(' ', '_')}{basis[1]}", norm_mode, f"cutoff{theta_cutoff}",
                      "transpose" if transpose else "forward"])
    return pytest.param(shapes, grids, basis, norm_mode, theta_cutoff, transpose, id=label.replace(" ", ""))


PSI_CASES = (
    # every grid pair x basis x normalisation, downsampling with the default cutoff
    [_psi_case(DOWN, grids, basis, norm, None, False)
     for grids, basis, norm in itertools.product(GRID_PAIRS, BASES, NORM_MODES)]
    # shapes, an explicit cutoff and transpose normalisation, on a mixed grid
    + [_psi_case(shapes, ("equiangular", "legendre-gauss"), basis, norm, cutoff, transpose)
       for shapes, basis, norm, cutoff, transpose in itertools.product(
           [SAME, DOWN], [BASES[0], BASES[3]], ["mean", "support"], [None, 0.4], [False, True])]
)


@needs_torch_harmonics
@pytest.mark.parametrize("shapes, grids, basis, norm_mode, theta_cutoff, transpose", PSI_CASES)
def test_psi_matches_torch_harmonics(shapes, grids, basis, norm_mode, theta_cutoff, transpose):
    (in_shape, out_shape), (grid_in, grid_out), (basis_type, kernel_shape) = shapes, grids, basis
    psi = compute_psi(in_shape, out_shape, kernel_shape, basis_type=basis_type,
                      basis_norm_mode=norm_mode, grid_in=grid_in, grid_out=grid_out,
                      theta_cutoff=theta_cutoff, transpose_normalization=transpose)
    their_idx, their_vals = reference_psi(in_shape, out_shape, kernel_shape, basis_type, norm_mode,
                                          grid_in, grid_out, theta_cutoff, transpose)
    assert psi.idx.dtype == torch.int64 and psi.vals.dtype == torch.float64
    assert torch.equal(psi.idx, their_idx)
    scale = float(their_vals.abs().max())
    torch.testing.assert_close(psi.vals, their_vals, rtol=1e-10, atol=1e-10 * scale)


@needs_torch_harmonics
@pytest.mark.parametrize("norm_mode", ["none", "mean", "nodal"])
@pytest.mark.parametrize("transpose", [False, True])
def test_psi_without_merged_quadrature_matches_torch_harmonics(norm_mode, transpose):
    psi = compute_psi(*DOWN, (3, 3), basis_norm_mode=norm_mode, grid_in="legendre-gauss",
                      transpose_normalization=transpose, merge_quadrature=False)
    their_idx, their_vals = reference_psi(*DOWN, (3, 3), "piecewise linear", norm_mode, "legendre-gauss",
                                          "equiangular", None, transpose, merge_quadrature=False)
    assert torch.equal(psi.idx, their_idx)
    torch.testing.assert_close(psi.vals, their_vals, rtol=1e-10, atol=1e-10 * float(their_vals.abs().max()))


def test_psi_rows_are_csr_ordered():
    psi = compute_psi(*DOWN, (3, 3), basis_type="harmonic", grid_out="legendre-gauss")
    nlat_out, n_inputs = psi.out_shape[0], psi.in_shape[0] * psi.in_shape[1]
    rows = psi.idx[0] * nlat_out + psi.idx[1]
    assert bool(((rows * n_inputs + psi.idx[2]).diff() > 0).all())
    assert psi.roff.shape == (psi.kernel_size * nlat_out + 1,)
    assert torch.equal(psi.roff.diff(), torch.bincount(rows, minlength=psi.kernel_size * nlat_out))
    assert int(psi.roff[-1]) == psi.nnz


def test_nodal_filters_have_unit_l1_norm_with_quadrature_merged():
    psi = compute_psi(*DOWN, (3, 3), basis_norm_mode="nodal")
    rows = psi.idx[0] * psi.out_shape[0] + psi.idx[1]
    l1 = torch.zeros(psi.kernel_size * psi.out_shape[0], dtype=torch.float64)
    l1.index_add_(0, rows, psi.vals.abs())
    assert torch.allclose(l1[psi.roff.diff() > 0], torch.tensor(1.0, dtype=torch.float64), atol=1e-12)


def _module_kwargs(basis, grids, groups):
    basis_type, kernel_shape = basis
    return dict(kernel_shape=kernel_shape, basis_type=basis_type, basis_norm_mode="mean", groups=groups,
                grid_in=grids[0], grid_out=grids[1], optimized_kernel=False)


@needs_torch_harmonics
@pytest.mark.parametrize("shapes", [SAME, DOWN], ids=["same", "down"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("basis", [BASES[0], BASES[3]], ids=["piecewise", "harmonic"])
def test_disco_conv_matches_torch_harmonics_module(shapes, groups, basis):
    in_shape, out_shape = shapes
    grids = ("equiangular", "legendre-gauss")
    torch.manual_seed(0)
    conv = th.DiscreteContinuousConvS2(4, 6, in_shape, out_shape, **_module_kwargs(basis, grids, groups)).double()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 4, *in_shape, dtype=torch.float64)
    psi = compute_psi(in_shape, out_shape, basis[1], basis_type=basis[0], basis_norm_mode="mean",
                      grid_in=grids[0], grid_out=grids[1])
    out = disco_conv(x, psi, conv.weight.detach(), out_shape[1], groups=groups, bias=conv.bias.detach())
    expected = conv(x).detach()
    assert out.shape == (2, 6, *out_shape)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@needs_torch_harmonics
@pytest.mark.parametrize("shapes", [SAME, DOWN], ids=["same", "up"])
@pytest.mark.parametrize("groups", [1, 2])
def test_disco_transpose_conv_matches_torch_harmonics_module(shapes, groups):
    fine_shape, coarse_shape = shapes
    grids = ("legendre-gauss", "equiangular")   # of the transpose conv: coarse in, fine out
    torch.manual_seed(0)
    conv = th.DiscreteContinuousConvTransposeS2(
        4, 6, coarse_shape, fine_shape, **_module_kwargs(BASES[3], grids, groups)).double()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 4, *coarse_shape, dtype=torch.float64)
    psi = compute_psi(fine_shape, coarse_shape, BASES[3][1], basis_type=BASES[3][0], basis_norm_mode="mean",
                      grid_in=grids[1], grid_out=grids[0], transpose_normalization=True)
    out = disco_transpose_conv(x, psi, conv.weight.detach(), fine_shape[1], groups=groups,
                               bias=conv.bias.detach())
    torch.testing.assert_close(out, conv(x).detach(), rtol=1e-10, atol=1e-12)


def test_transpose_contraction_is_the_adjoint_of_the_contraction():
    psi = compute_psi(*DOWN, (3, 3), basis_type="harmonic")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, *psi.in_shape, dtype=torch.float64, generator=generator)
    y = torch.randn(2, 3, psi.kernel_size, *psi.out_shape, dtype=torch.float64, generator=generator)
    forward = (disco_contraction(x, psi, psi.out_shape[1]) * y).sum()
    adjoint = (x * disco_transpose_contraction(y, psi, psi.in_shape[1])).sum()
    assert float(forward) == pytest.approx(float(adjoint), rel=1e-12)


def test_contraction_in_float32_follows_float64():
    psi = compute_psi(*SAME, 3)
    x = torch.randn(1, 2, *psi.in_shape, dtype=torch.float64)
    out32 = disco_contraction(x.float(), psi, psi.out_shape[1])
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), disco_contraction(x, psi, psi.out_shape[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, bad_value", [
    (dict(grid_in="gaussian"), "gaussian"),
    (dict(grid_out="lobato"), "lobato"),
    (dict(basis_type="zernike"), "zernike"),
    (dict(basis_norm_mode="individual"), "individual"),
    (dict(theta_cutoff=-0.1), "-0.1"),
    (dict(kernel_shape=(3, 0)), "(3, 0)"),
])
def test_bad_psi_arguments_name_the_bad_value(kwargs, bad_value):
    arguments = dict(in_shape=(12, 24), out_shape=(12, 24), kernel_shape=(3, 3)) | kwargs
    with pytest.raises(ValueError, match=bad_value.replace("(", r"\(").replace(")", r"\)")):
        compute_psi(**arguments)


def test_nlon_in_not_a_multiple_of_nlon_out_is_rejected():
    with pytest.raises(ValueError, match=r"nlon_in \(48\).*nlon_out \(20\)"):
        compute_psi((24, 48), (12, 20), (3, 3))


def test_disco_conv_rejects_a_weight_of_the_wrong_shape():
    psi = compute_psi(*SAME, (3, 3))
    x = torch.randn(1, 4, *psi.in_shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(6, 4, 4\)"):
        disco_conv(x, psi, torch.randn(6, 4, psi.kernel_size), psi.out_shape[1], groups=2)
