"""The serial kernel work of each shard of DistributedDiscoConvS2, with mock communicators:
the floor of a distributed step's kernel time.

    python benchmarks/disco_distributed.py --scale 0.25               # all configs and splits
    python benchmarks/disco_distributed.py --configs self_256x360x720 --h-split 1,4 --w-split 2
    python benchmarks/disco_distributed.py --scale 0.25 --fused --precisions fp32,bf16

Every shard of a P x Q split (--h-split, --w-split: comma lists, every pair is run) is built
as its rank would build it, with ShardPosition standing in for the process groups, and is
given the input the rank holds after the exchanges of tilecast/runtime/disco/distributed.py (its
latitude band, its slice of each group's input channels, whole rings), cut from one full
input: the communication itself is not run or timed. Per config (seed_configs, --scale as in
benchmarks/disco.py), split and precision: each shard's local `_contract_and_mix` forward and
forward+backward (median of --reps after a warm-up), ms and GFLOP/s, its bytes exchanged per
forward (band halo, all-to-all, reduce-scatter), then the max over shards (the floor), that
floor's speedup over the 1x1 split and the worst shard's relative error of bf16/fp16 against
its fp32 output. Figures, not a test.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disco import median_seconds, rel_error, scaled  # noqa: E402
from tilecast.runtime.disco.distributed import DistributedDiscoConvS2  # noqa: E402
from tilecast.runtime.disco.exchange import ShardPosition  # noqa: E402
from tilecast.disco.seed_configs import CONFIGS, PRECISIONS  # noqa: E402


@dataclass
class Shard:
    """One rank's module and the input its local kernels see after the exchanges."""
    polar_rank: int
    azimuth_rank: int
    module: DistributedDiscoConvS2
    local_input: torch.Tensor       # fp32 (B, groups * channel slice, band, nlon_in)

    @property
    def forward_flops(self) -> float:
        return self.contraction_flops + self.mix_flops

    @property
    def train_flops(self) -> float:
        return 2 * self.contraction_flops + 3 * self.mix_flops

    @property
    def contraction_flops(self) -> float:
        local = self.module.local
        return 2.0 * local.in_channels * local.psi.nnz * local.psi.out_shape[1]

    @property
    def mix_flops(self) -> float:
        local = self.module.local
        rows, nlon_out = local.psi.out_shape
        return 2.0 * local.out_channels * local.groupsize * local.kernel_size * rows * nlon_out

    def exchanged_bytes(self, element_size: int) -> int:
        """Bytes this rank receives per forward: the band rows it does not own, the other
        ranks' longitudes of its channels, the other ranks' partial sums of its longitudes."""
        module, batch = self.module, self.local_input.shape[0]
        channels, band, nlon_in = self.local_input.shape[1:]
        layout = module.layout
        (lat0, lat1), (band0, band1) = layout.lat_in[self.polar_rank], layout.bands[self.polar_rank]
        owned = max(0, min(lat1, band1) - max(lat0, band0))
        _, lon = module.shard_shape("in")
        rows_out, lon_out = module.shard_shape("out")
        halo = (band - owned) * lon * module.in_channels
        all_to_all = channels * band * (nlon_in - lon)
        reduce_scatter = (module.azimuth.size - 1) * module.out_channels * rows_out * lon_out
        return batch * element_size * (halo + all_to_all + reduce_scatter)


def build_shards(config: dict, n_polar: int, n_azimuth: int, fused: bool,
                 x: torch.Tensor) -> list[Shard]:
    """Every shard of the split, with the same weights (rank 0's initialisation)."""
    shards = []
    for p in range(n_polar):
        for q in range(n_azimuth):
            torch.manual_seed(0)
            module = DistributedDiscoConvS2(**config, fused=fused,
                                            polar_group=ShardPosition(p, n_polar),
                                            azimuth_group=ShardPosition(q, n_azimuth))
            layout = module.layout
            (c0, c1), (b0, b1) = layout.channels[q], layout.bands[p]
            grouped = x.reshape(x.shape[0], module.groups, module.groupsize, *x.shape[-2:])
            local = grouped[:, :, c0:c1, b0:b1].reshape(x.shape[0], -1, b1 - b0, x.shape[-1])
            shards.append(Shard(p, q, module, local.contiguous()))
    return shards


def time_shard(shard: Shard, dtype: torch.dtype, reps: int) -> tuple[float, float, torch.Tensor]:
    """(forward s, forward+backward s, forward output) of the shard's local kernels."""
    local = shard.module.local
    x = shard.local_input.to(dtype)
    weight = shard.module._local_weight().detach().to(dtype)
    with torch.no_grad():
        out = local(x, weight)
        forward = median_seconds(lambda: local(x, weight), reps)
    x_grad, weight_grad = x.clone().requires_grad_(), weight.clone().requires_grad_()
    grad = torch.randn_like(out)

    def forward_backward():
        x_grad.grad = weight_grad.grad = None
        local(x_grad, weight_grad).backward(grad)

    return forward, median_seconds(forward_backward, reps), out


def bench_split(name: str, config: dict, split: tuple[int, int], precisions: list[str],
                fused: bool, reps: int, x: torch.Tensor, baseline: dict) -> None:
    start = time.perf_counter()
    try:
        shards = build_shards(config, *split, fused, x)
    except ValueError as error:
        print(f"  split {split[0]}x{split[1]}: not possible ({error})")
        return
    print(f"  split {split[0]}x{split[1]}: {len(shards)} shards, kpacked K_PAD "
          f"{shards[0].module.psi_kpacked_K_pad} (setup {time.perf_counter() - start:.1f} s)")
    reference = {}
    for precision in precisions:
        dtype = PRECISIONS[precision]
        floor_forward = floor_both = worst_error = 0.0
        for shard in shards:
            forward, both, out = time_shard(shard, dtype, reps)
            key = (shard.polar_rank, shard.azimuth_rank)
            if precision == "fp32":
                reference[key] = out.double()
            error = rel_error(out, reference[key]) if key in reference and precision != "fp32" else 0.0
            worst_error = max(worst_error, error)
            floor_forward, floor_both = max(floor_forward, forward), max(floor_both, both)
            rows, lons = shard.module.shard_shape("out")
            print(f"    {precision:5s} shard ({key[0]},{key[1]}) out {rows}x{lons} "
                  f"band {shard.local_input.shape[2]:4d} ch {shard.local_input.shape[1]:4d} "
                  f"nnz {shard.module.local.psi.nnz:9d}  fwd {forward * 1e3:8.2f} ms "
                  f"({shard.forward_flops / forward / 1e9:6.1f} GFLOP/s)  fwd+bwd {both * 1e3:8.2f} ms "
                  f"({shard.train_flops / both / 1e9:6.1f} GFLOP/s)  "
                  f"recv {shard.exchanged_bytes(x.new_empty(0, dtype=dtype).element_size()) / 1e6:7.2f} MB")
        baseline.setdefault(precision, (f"{split[0]}x{split[1]}", floor_forward, floor_both))
        base_split, base_forward, base_both = baseline[precision]
        error_text = f"{worst_error:.2e}" if precision != "fp32" and reference else "-"
        print(f"    {precision:5s} floor (max over shards): fwd {floor_forward * 1e3:8.2f} ms "
              f"({base_forward / floor_forward:4.2f}x vs {base_split}), fwd+bwd {floor_both * 1e3:8.2f} ms "
              f"({base_both / floor_both:4.2f}x vs {base_split}); worst shard error vs fp32 {error_text}")


def _int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"split sizes must be positive, got {text!r}")
    return values


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--h-split", type=_int_list, default=[1, 4],
                        help="polar group sizes (comma list)")
    parser.add_argument("--w-split", type=_int_list, default=[1, 2],
                        help="azimuth group sizes (comma list)")
    parser.add_argument("--fused", action="store_true", help="the fused path (default unfused)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    names, precisions = args.configs.split(","), args.precisions.split(",")
    for value, valid, what in ((names, CONFIGS, "config"), (precisions, PRECISIONS, "precision")):
        unknown = [v for v in value if v not in valid]
        if unknown:
            parser.error(f"unknown {what} {unknown}; valid: {', '.join(valid)}")
    if not args.scale > 0:
        parser.error(f"--scale must be positive, got {args.scale}")
    # fp32 first: the 16-bit errors are measured against it
    precisions = sorted(precisions, key=lambda p: p != "fp32")
    splits = [(p, q) for q in args.w_split for p in args.h_split]
    if (1, 1) in splits:
        splits.remove((1, 1))
        splits.insert(0, (1, 1))

    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, {args.threads} threads, {'fused' if args.fused else 'unfused'}, "
          f"batch 1, median of {args.reps}")
    for name in names:
        config = scaled(CONFIGS[name], args.scale)
        print(f"\n{name} scale {args.scale:g}: C_in {config['in_channels']} C_out "
              f"{config['out_channels']} in {config['in_shape']} out {config['out_shape']} "
              f"theta_cutoff {config['theta_cutoff']:.4g}")
        x = torch.randn(1, config["in_channels"], *config["in_shape"],
                        generator=torch.Generator().manual_seed(0))
        baseline: dict = {}
        for split in splits:
            bench_split(name, config, split, precisions, args.fused, args.reps, x, baseline)


if __name__ == "__main__":
    main()
