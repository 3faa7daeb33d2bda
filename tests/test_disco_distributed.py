"""DistributedDiscoConvS2 / DistributedDiscoConvTransposeS2 against the serial modules.

One torch.multiprocessing spawn per process count (gloo over 127.0.0.1): 2 ranks run the
latitude (2x1) and the longitude (1x2) split, 4 ranks the 2x2 grid. Every rank runs every case
of its splits: the serial module and the distributed one with the same weights, the same full
input and output gradient; the rank compares its shard of the output and of the input's
gradient, and (after reduce_gradients) the whole weight and bias gradients, and saves the
relative errors. The parametrized tests below check them, one test per (split, case).
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tilecast.runtime.disco import DiscoConvS2, DiscoConvTransposeS2
from tilecast.runtime.disco.distributed import DistributedDiscoConvS2, DistributedDiscoConvTransposeS2
from tilecast.runtime.disco.exchange import ShardPosition

# (name, serial class, distributed class, constructor arguments)
DOWN = dict(in_channels=4, out_channels=6, in_shape=(16, 32), out_shape=(8, 16),
            kernel_shape=(3, 3), basis_type="harmonic", basis_norm_mode="mean",
            grid_in="equiangular", grid_out="legendre-gauss")
SELF_PL = dict(in_channels=4, out_channels=6, in_shape=(11, 20), out_shape=(11, 20),
               kernel_shape=(2, 3), basis_type="piecewise linear", groups=2)
UP = dict(in_channels=4, out_channels=3, in_shape=(8, 16), out_shape=(16, 32),
          kernel_shape=(3, 3), basis_type="harmonic", basis_norm_mode="mean")
CONV, TRANSPOSE = (DiscoConvS2, DistributedDiscoConvS2), (DiscoConvTransposeS2, DistributedDiscoConvTransposeS2)

# name -> (classes, arguments, dtype, extra module arguments, forced K_PAD or None)
CASES = {
    "down_harmonic_fp32": (CONV, DOWN, torch.float32, dict(fused=False), None),
    "down_harmonic_fp32_fused": (CONV, DOWN, torch.float32, dict(fused=True), None),
    "self_pl_groups_fp32": (CONV, SELF_PL, torch.float32, dict(fused=False), None),
    "self_pl_groups_fp32_fused": (CONV, SELF_PL, torch.float32, dict(fused=True), None),
    "down_harmonic_bf16_kpacked": (CONV, DOWN, torch.bfloat16, dict(fused=False), None),
    "down_harmonic_bf16_kpacked_fused": (CONV, DOWN, torch.bfloat16, dict(fused=True), None),
    "kpacked_fallback_bf16_unfused": (CONV, DOWN, torch.bfloat16, dict(fused=False), 24),
    "kpacked_fallback_bf16_fused": (CONV, DOWN, torch.bfloat16, dict(fused=True), 24),
    "kpacked_fallback_fp16_unfused": (CONV, DOWN, torch.float16, dict(fused=False), 24),
    "transpose_up_fp32": (TRANSPOSE, UP, torch.float32, {}, None),
    "transpose_self_pl_fp32": (TRANSPOSE, SELF_PL, torch.float32, {}, None),
}
SPLITS = {2: [(2, 1), (1, 2)], 4: [(2, 2)]}
# relative (norm-wise) error allowed against the serial module in the same dtype: the
# distributed sums run in another order (and, split over channels, add rounded partial sums)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def _run_case(classes, arguments, dtype, extra, k_pad, polar, azimuth) -> dict:
    serial_cls, distributed_cls = classes
    torch.manual_seed(0)
    serial = serial_cls(**arguments, **extra)
    with torch.no_grad():
        serial.bias.normal_()
    module = distributed_cls(**arguments, **extra, polar_group=polar, azimuth_group=azimuth)
    module.load_state_dict(serial.state_dict())
    serial, module = serial.to(dtype), module.to(dtype)
    if k_pad is not None:
        serial.psi_kpacked_K_pad = module.psi_kpacked_K_pad = k_pad

    x = torch.randn(2, arguments["in_channels"], *arguments["in_shape"], dtype=dtype)
    x.requires_grad_()
    out = serial(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    p, q = module.polar.rank, module.azimuth.rank
    layout = module.layout
    (i0, i1), (j0, j1) = layout.lat_in[p], layout.lon_in[q]
    (o0, o1), (k0, k1) = layout.lat_out[p], layout.lon_out[q]
    shard = x.detach()[:, :, i0:i1, j0:j1].clone().requires_grad_()
    shard_out = module(shard)
    shard_out.backward(grad_out[:, :, o0:o1, k0:k1])
    module.reduce_gradients()
    return {
        "out": _rel_error(shard_out, out.detach()[:, :, o0:o1, k0:k1]),
        "x_grad": _rel_error(shard.grad, x.grad[:, :, i0:i1, j0:j1]),
        "weight_grad": _rel_error(module.weight.grad, serial.weight.grad),
        "bias_grad": _rel_error(module.bias.grad, serial.bias.grad),
        "dtype": str(out.dtype) == str(shard_out.dtype),
        "kpacked": module.local._kpacked() is not None,
        "serial_kpacked": serial._kpacked() is not None,
    }


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results = {}
    for n_polar, n_azimuth in SPLITS[world]:
        # rank = p * n_azimuth + q; every rank creates every group, in the same order
        polar_groups = [dist.new_group([p * n_azimuth + q for p in range(n_polar)])
                        for q in range(n_azimuth)]
        azimuth_groups = [dist.new_group([p * n_azimuth + q for q in range(n_azimuth)])
                          for p in range(n_polar)]
        p, q = divmod(rank, n_azimuth)
        polar = polar_groups[q] if n_polar > 1 else None
        azimuth = azimuth_groups[p] if n_azimuth > 1 else None
        for name, case in CASES.items():
            results[(n_polar, n_azimuth, name)] = _run_case(*case, polar, azimuth)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """(n_polar, n_azimuth, case) -> each rank's errors, from one spawn per world size."""
    merged = {}
    for world in SPLITS:
        out_dir = tmp_path_factory.mktemp(f"world{world}")
        mp.spawn(_rank_main, args=(world, _free_port(), str(out_dir)), nprocs=world, join=True)
        for rank in range(world):
            for key, errors in torch.load(out_dir / f"rank{rank}.pt").items():
                merged.setdefault(key, []).append(errors)
    return merged


@pytest.mark.parametrize("split", [split for splits in SPLITS.values() for split in splits],
                         ids=lambda split: f"{split[0]}x{split[1]}")
@pytest.mark.parametrize("case", list(CASES))
def test_matches_serial(results, split, case):
    _, _, dtype, _, k_pad = CASES[case]
    ranks = results[(*split, case)]
    assert len(ranks) == split[0] * split[1]
    for rank, errors in enumerate(ranks):
        for quantity in ("out", "x_grad", "weight_grad", "bias_grad"):
            assert errors[quantity] < TOLERANCE[dtype], (rank, quantity, errors)
        assert errors["dtype"]
        # the distributed module takes the serial module's path
        assert errors["kpacked"] == errors["serial_kpacked"]
        if k_pad is not None:
            assert not errors["kpacked"]


def test_kpacked_layout_on_harmonic_shards(results):
    """The harmonic basis keeps its kpacked layout on every shard; piecewise linear has none."""
    for split in ((2, 1), (1, 2), (2, 2)):
        assert all(errors["kpacked"] for errors in results[(*split, "down_harmonic_bf16_kpacked")])
        assert not any(errors["kpacked"] for errors in results[(*split, "self_pl_groups_fp32")])


def test_shards_cover_grid_without_process_group():
    """ShardPosition places shards by hand: their latitudes and longitudes tile both grids."""
    shards = [DistributedDiscoConvS2(**DOWN, polar_group=ShardPosition(p, 3),
                                     azimuth_group=ShardPosition(q, 2))
              for p in range(3) for q in range(2)]
    for grid, shape in (("in", DOWN["in_shape"]), ("out", DOWN["out_shape"])):
        assert sum(s.shard_shape(grid)[0] * s.shard_shape(grid)[1] for s in shards) == shape[0] * shape[1]
    assert [s.shard_shape("out")[0] for s in shards[::2]] == [3, 3, 2]
    # each shard's psi holds exactly its output latitudes' entries of the full psi
    assert sum(s.local.psi.nnz for s in shards[::2]) == DiscoConvS2(**DOWN).psi.nnz


def test_rejects_wrong_shard_shape():
    module = DistributedDiscoConvS2(**DOWN, polar_group=ShardPosition(0, 2))
    with pytest.raises(ValueError, match=r"expects its shard of x, \(B, 4, 8, 32\)"):
        module(torch.randn(1, 4, 16, 32))


def test_rejects_group_larger_than_grid():
    with pytest.raises(ValueError, match="cannot split 8 output latitudes over 9 polar ranks"):
        DistributedDiscoConvS2(**DOWN, polar_group=ShardPosition(0, 9))
    with pytest.raises(ValueError, match="input channels per group over 3 azimuth ranks"):
        DistributedDiscoConvS2(**SELF_PL, azimuth_group=ShardPosition(0, 3))
    with pytest.raises(TypeError, match="polar_group must be"):
        DistributedDiscoConvS2(**DOWN, polar_group=2)


def test_shard_position_cannot_communicate():
    module = DistributedDiscoConvS2(**DOWN, polar_group=ShardPosition(1, 2))
    with pytest.raises(RuntimeError, match="no process group"):
        module(torch.randn(1, 4, 8, 32))


@pytest.mark.parametrize("classes, arguments", [(CONV, DOWN), (TRANSPOSE, UP)], ids=["conv", "transpose"])
def test_no_split_is_the_serial_module(classes, arguments):
    """Without groups the distributed module is the serial one: same output and gradients."""
    torch.manual_seed(0)
    serial = classes[0](**arguments)
    torch.manual_seed(0)
    module = classes[1](**arguments)
    assert torch.equal(module.weight, serial.weight)    # same initialisation, same RNG draws
    x = torch.randn(2, arguments["in_channels"], *arguments["in_shape"], requires_grad=True)
    grad_out = torch.randn(2, arguments["out_channels"], *arguments["out_shape"])
    serial(x).backward(grad_out)
    expected = x.grad.clone()
    x.grad = None
    out = module(x)
    out.backward(grad_out)
    assert torch.allclose(out, serial(x), rtol=1e-6, atol=1e-6)
    assert torch.allclose(x.grad, expected, rtol=1e-6, atol=1e-6)
    assert torch.allclose(module.weight.grad, serial.weight.grad, rtol=1e-6, atol=1e-6)
