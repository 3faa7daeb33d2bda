"""tilecast's DiscoConvS2 on the CPU against torch-harmonics' DiscreteContinuousConvS2 (the peer).

    python benchmarks/disco.py --scale 0.25                      # all configs, fp32/bf16/fp16
    python benchmarks/disco.py --configs self_256x360x720 --precisions fp32 --reps 3
    python benchmarks/disco.py --module-precisions fp32,bf16    # fp16 kernels only (CPU fp16
                                                                # einsum is very slow)

For each config and precision, batch 1, same weights and threads: forward and forward+backward
wall time (median of --reps after a warm-up) of torch-harmonics' module and of DiscoConvS2 on
each of its paths (--paths: csr, kpacked, fused, fused+kpacked; the kpacked ones where psi has
the layout), the ratio th/tilecast, GFLOP/s of the whole conv, and each module's forward error
against a float64 reference (tilecast.disco.reference on the same weights; "skipped" where that
would take too long or too much memory). Then each contraction kernel alone (the CSR and
kpacked forward, the transpose) against the peer's custom ops. Last, the bound the channel
mix sets (fp32): its GFLOP against this run's FMA peak (tilecast.measurement.probe) and torch's sgemm at
the fused path's block shape, both read in every round of the module timings, and the best
ratio th/tilecast any implementation could reach that spends at least that long on the mix,
with its sparse contractions for free. --mix-gemm runs the fused paths twice more: with their
mix on a tilecast GEMM kernel alone (+gemm; tilecast.runtime.disco.mix: the first of comma-separated
kernel names, or with registry:PATH the choice of the gemm model published there), and with
the kernels raced against torch's sgemm at each product shape (+raced, DiscoConvS2's
mix_gemm: every name given, or the model's best three, and the forward's one-kernel mix
raced against those products where it applies; each race's medians and winner printed); and
it reads the +gemm kernel's rate at the mix's block beside torch's sgemm.
--mix-torch times the fused paths once more with their mix on torch's sgemm only (+torch):
by default, where it can, DiscoConvS2 races the kpacked kernel that runs the contraction and
the mix as one (tilecast.runtime.disco.fused) against that, and the race is printed. The
configs are DISCO_KERNEL_DEV.md's. --scale s multiplies channels and grid sizes by s and divides theta_cutoff by s, so each filter keeps
about as many grid points. Figures, not a test.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.measurement import probe  # noqa: E402
from tilecast.disco import native, ops, reference  # noqa: E402
from tilecast.runtime.disco import DiscoConvS2  # noqa: E402
from tilecast.runtime.disco.fused import block_rows  # noqa: E402
from tilecast.disco.lines import regroup  # noqa: E402
from tilecast.runtime.disco.fused import KERNEL_SIDE  # noqa: E402
from tilecast.runtime.disco.mix import Mixer  # noqa: E402
from tilecast.runtime.dispatch import Dispatcher  # noqa: E402

from tilecast.disco.seed_configs import CONFIGS, PRECISIONS  # noqa: E402
# the float64 reference rolls the whole input once per output longitude: skip it beyond this
# many rolled elements (about a minute), or when its expanded tensor passes this many bytes
REFERENCE_MAX_ELEMENTS = 5e9
REFERENCE_MAX_BYTES = 4 << 30
AGREEMENT_CHANNELS = 8


def scaled(config: dict, scale: float) -> dict:
    """config with channels and grid sizes times `scale` (nlon_in stays a multiple of
    nlon_out) and theta_cutoff divided by it."""
    if scale == 1.0:
        return dict(config)
    (nlat_in, nlon_in), (nlat_out, nlon_out) = config["in_shape"], config["out_shape"]
    lon_out = max(4, round(nlon_out * scale))
    return dict(config,
                in_channels=max(1, round(config["in_channels"] * scale)),
                out_channels=max(1, round(config["out_channels"] * scale)),
                in_shape=(max(3, round(nlat_in * scale)), lon_out * (nlon_in // nlon_out)),
                out_shape=(max(3, round(nlat_out * scale)), lon_out),
                theta_cutoff=config["theta_cutoff"] / scale)


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of fn over `reps` calls, after one warm-up call."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_medians(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time of each fn over `reps` rounds, after one warm-up call each. Every
    round times every fn once, in turn, so that a slow spell of a shared machine falls on
    all of them rather than on whichever ran then (the ratios are what is quoted); the turn
    order rotates each round, so no fn always follows the same one (torch-harmonics'
    forward+backward allocates and frees gigabytes just before the next module's turn)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {label: [] for label in fns}
    labels = list(fns)
    for round_index in range(reps):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            start = time.perf_counter()
            fns[label]()
            samples[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in samples.items()}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


@dataclass
class Workload:
    """One config, built once: both modules with the same weights, and the FLOP counts."""
    name: str
    config: dict
    ours: DiscoConvS2
    peer: torch.nn.Module
    contraction_flops: float
    einsum_flops: float

    @classmethod
    def build(cls, name: str, config: dict) -> "Workload":
        import torch_harmonics as th
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peer = th.DiscreteContinuousConvS2(**config)
        ours = DiscoConvS2(**config)
        with torch.no_grad():
            peer.bias.normal_()
            ours.weight.copy_(peer.weight)
            ours.bias.copy_(peer.bias)
        (_, nlon_out), nlat_out = config["out_shape"], config["out_shape"][0]
        contraction = 2.0 * config["in_channels"] * ours.psi.nnz * nlon_out
        einsum = 2.0 * config["out_channels"] * ours.groupsize * ours.kernel_size * nlat_out * nlon_out
        return cls(name, config, ours, peer, contraction, einsum)

    def reference_fits(self) -> bool:
        (nlat_in, nlon_in), (nlat_out, nlon_out) = self.config["in_shape"], self.config["out_shape"]
        rolled = self.config["in_channels"] * nlat_in * nlon_in * nlon_out
        expanded_bytes = 8 * self.config["in_channels"] * self.ours.kernel_size * nlat_out * nlon_out
        return rolled <= REFERENCE_MAX_ELEMENTS and expanded_bytes <= REFERENCE_MAX_BYTES

    def reference_output(self, x: torch.Tensor) -> torch.Tensor:
        return reference.disco_conv(x.double(), self.ours.psi, self.ours.weight.detach().double(),
                                    self.config["out_shape"][1], groups=self.ours.groups,
                                    bias=self.ours.bias.detach().double())


def forward_only(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            module(x)
    return run


def forward_backward(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    x_grad = x.detach().clone().requires_grad_()

    def run():
        module.zero_grad(set_to_none=True)
        x_grad.grad = None
        module(x_grad).backward(grad)
    return run


def peer_kernels(peer: torch.nn.Module, config: dict):
    """The peer's contraction and transpose contraction ops, bound to its psi."""
    from torch_harmonics.disco.optimized.disco_optimized import (
        _disco_s2_contraction_optimized, _disco_s2_transpose_contraction_optimized)
    psi = (peer.psi_roff_idx, peer.psi_ker_idx, peer.psi_row_idx, peer.psi_col_idx, peer.psi_vals.float())
    (nlat_in, nlon_in), (nlat_out, nlon_out) = config["in_shape"], config["out_shape"]
    return (lambda x: _disco_s2_contraction_optimized(x, *psi, peer.kernel_size, nlat_out, nlon_out),
            lambda y: _disco_s2_transpose_contraction_optimized(y, *psi, peer.kernel_size, nlat_in, nlon_in))


def bench_precision(work: Workload, x32: torch.Tensor, precision: str, reps: int, reference_out,
                    modules: bool, paths: list[str], mixer: Mixer, mix_torch: bool = False) -> None:
    x = x32.to(PRECISIONS[precision])
    machine = (MachineRates(work, torch.get_num_threads(), mixer) if precision == "fp32"
               else None)
    peer_times = None
    if modules:
        peer_times = bench_modules(work, x, precision, reps, reference_out, paths, machine, mixer,
                                   mix_torch)
    bench_kernels(work, x, precision, reps)
    if machine is not None and peer_times is not None:
        print_mix_bound(work, machine, peer_times)


class MachineRates:
    """The FMA peak and torch's sgemm at the channel mix's block shape (and the mixer's
    tilecast GEMM kernel there, if it has one), read once per round of the module timings
    (`sample`, about 0.2 s) so that they see the same spells of the shared machine as the
    modules."""

    PROBES_PER_SAMPLE = 4
    GEMMS_PER_SAMPLE = 3

    def __init__(self, work: "Workload", threads: int, mixer: Mixer):
        config = work.config
        nlon_out = config["out_shape"][1]
        depth = work.ours.groupsize * work.ours.kernel_size
        rows = min(config["out_shape"][0], block_rows(work.ours.groupsize, work.ours.kernel_size, nlon_out))
        generator = torch.Generator().manual_seed(1)
        self.threads = threads
        self.mix = torch.randn(config["out_channels"] // work.ours.groups, depth, generator=generator)
        self.slab = torch.randn(depth, rows * nlon_out, generator=generator)
        self.out = torch.empty(self.mix.shape[0], self.slab.shape[1])
        self.gemm_flops = 2.0 * self.mix.shape[0] * depth * self.slab.shape[1]
        self.mixer = mixer
        self.peaks: list[float] = []
        self.sgemms: list[float] = []
        self.tilecast_gemms: list[float] = []

    def _rate(self, mm: Callable[[], object]) -> float:
        mm()
        start = time.perf_counter()
        for _ in range(self.GEMMS_PER_SAMPLE):
            mm()
        return self.GEMMS_PER_SAMPLE * self.gemm_flops / (time.perf_counter() - start) / 1e9

    def sample(self) -> None:
        self.peaks.extend(probe.fma_peak_gflops(self.threads) for _ in range(self.PROBES_PER_SAMPLE))
        self.sgemms.append(self._rate(lambda: torch.mm(self.mix, self.slab, out=self.out)))
        if self.mixer.gemm is not None:
            self.tilecast_gemms.append(self._rate(lambda: self.mixer.mm(self.mix, self.slab, self.out)))


#: DiscoConvS2's paths: (fused, kpacked)
PATHS = {"csr": (False, False), "kpacked": (False, True), "fused": (True, False),
         "fused+kpacked": (True, True)}


def on_path(module: DiscoConvS2, path: str) -> DiscoConvS2 | None:
    """A copy of `module` set to take `path`; None if psi has no kpacked layout for it."""
    fused, kpacked = PATHS[path]
    if kpacked and module.psi_kpacked_K_pad is None:
        return None
    copied = copy.deepcopy(module)
    copied.fused = fused
    if not kpacked and copied.psi_kpacked_K_pad is not None:
        copied.psi_kpacked_K_pad = 24   # ineligible: the CSR fallback
    return copied


def bench_modules(work: Workload, x: torch.Tensor, precision: str, reps: int, reference_out,
                  paths: list[str], machine: MachineRates | None = None,
                  mixer: Mixer | None = None, mix_torch: bool = False) -> tuple[float, float]:
    """torch-harmonics and each of our paths, forward and forward+backward, with their errors
    against float64, and the fused paths again with `mixer`'s mix where it has a GEMM
    kernel; `machine` sampled in every round. Returns torch-harmonics' forward and
    forward+backward seconds."""
    candidates = [(f"tc:{path}", on_path(work.ours, path)) for path in paths]
    if mix_torch:
        # the fused paths with their mix on torch's sgemm only, never in the kpacked kernel
        for path in paths:
            module = on_path(work.ours, path) if PATHS[path][0] else None
            if module is not None:
                module.mixer = Mixer(in_kernel=False)
                candidates.append((f"tc:{path}+torch", module))
    if mixer is not None and mixer.gemm is not None:
        # the mix on the kernel alone (+gemm), and raced against torch per shape (+raced)
        for path in paths:
            for suffix, race in (("gemm", False), ("raced", True)):
                module = on_path(work.ours, path) if PATHS[path][0] else None
                if module is not None:
                    module.mixer = Mixer(mixer.gemm, race=race)
                    candidates.append((f"tc:{path}+{suffix}", module))
    candidates.append(("th", work.peer))
    # copies, so that the fp32 weights survive the cast
    modules = {label: copy.deepcopy(module).to(x.dtype) for label, module in candidates
               if module is not None}
    errors = {}
    for label, module in modules.items():
        with torch.no_grad():
            out = module(x)
        errors[label] = "skipped" if reference_out is None else f"{rel_error(out, reference_out):.2e}"
        grad = torch.randn_like(out)
        del out
    extra = {} if machine is None else {"machine": machine.sample}
    forwards = interleaved_medians({**{label: forward_only(m, x) for label, m in modules.items()},
                                    **extra}, reps)
    boths = interleaved_medians({**{label: forward_backward(m, x, grad) for label, m in modules.items()},
                                 **extra}, reps)
    rows = {label: (forwards[label], boths[label], errors[label]) for label in modules}
    conv_flops = work.contraction_flops + work.einsum_flops
    train_flops = 2 * work.contraction_flops + 3 * work.einsum_flops
    for label, (forward, both, error) in rows.items():
        print(f"  {precision:5s} {label:21s} fwd {forward * 1e3:9.1f} ms ({conv_flops / forward / 1e9:6.1f} GFLOP/s)"
              f"  fwd+bwd {both * 1e3:9.1f} ms ({train_flops / both / 1e9:6.1f} GFLOP/s)  err vs fp64 {error}")
    for label, module in modules.items():
        for key, race in getattr(module, "mixer", Mixer()).races.items():
            times = ", ".join(f"{side} {median * 1e3:.2f} ms" for side, median in race.medians().items())
            if key[0] == KERNEL_SIDE:   # the forward's blocks: the kernel against torch's mix
                where = f"the forward's blocks of x {key[1]}"
            else:
                m, n, k, layout_a, layout_b = key
                where = f"{m}x{n}x{k}:{layout_a}:{layout_b}"
            print(f"  {precision:5s} {label} race at {where}: {times} -> {race.winner}")
    peer = rows["th"]
    for label, (forward, both, _) in rows.items():
        if label != "th":
            print(f"  {precision:5s} ratio th/{label}: fwd {peer[0] / forward:.2f}x, fwd+bwd {peer[1] / both:.2f}x")
    return peer[0], peer[1]


def bench_kernels(work: Workload, x: torch.Tensor, precision: str, reps: int) -> None:
    """Each contraction kernel alone, tilecast against the peer, GFLOP/s of the contraction."""
    config, ours = work.config, work.ours
    psi = ours._psi_tensors()
    (nlat_out, nlon_out) = config["out_shape"]
    ours_fwd = lambda inp: ops.disco_contraction(inp, *psi, ours.kernel_size, *config["out_shape"])  # noqa: E731
    ours_bwd = lambda y: ops.disco_transpose_contraction(y, *psi, *config["in_shape"])  # noqa: E731
    peer_fwd, peer_bwd = peer_kernels(work.peer, config)
    packed = ours._kpacked()
    with torch.no_grad():
        y = ours_fwd(x)
        kernels = {"tilecast": lambda: ours_fwd(x), "th": lambda: peer_fwd(x)}
        if packed is not None:
            kp_fwd = lambda inp: ops.disco_kpacked_contraction(  # noqa: E731
                inp, *packed.tensors(), ours.kernel_size, nlat_out, nlon_out, 0, nlat_out)
            kernels["kpacked"] = lambda: kp_fwd(x)
        forwards = interleaved_medians(kernels, reps)
        transpose_kernels = {"tilecast": lambda: ours_bwd(y), "th": lambda: peer_bwd(y)}
        # the line-blocked transpose on the whole grid, whatever its fill (the fused backward
        # uses it on the bands whose fill reaches tilecast.disco.lines.MIN_FILL)
        lines = regroup(psi[3], psi[4], psi[5], native.line_block())
        ours_lines = lambda y: native.transpose_lines(y, *lines.tensors(), *config["in_shape"])  # noqa: E731
        transpose_kernels["lines"] = lambda: ours_lines(y)
        transposes = interleaved_medians(transpose_kernels, reps)
        lines_time = transposes["lines"]
        times = {label: (forwards[label], transposes[label]) for label in ("tilecast", "th")}
        if packed is not None:
            kp_time = forwards["kpacked"]
            kp_error = rel_error(kp_fwd(x[:, :AGREEMENT_CHANNELS]), ours_fwd(x[:, :AGREEMENT_CHANNELS]).double())
        # on a few channels: at full scale a float64 copy of the whole output would not fit
        few = x[:, :AGREEMENT_CHANNELS]
        agreement = rel_error(peer_fwd(few), ours_fwd(few).double())
        del y
    flops = work.contraction_flops
    for label, (forward, transpose) in times.items():
        print(f"  {precision:5s} {label:9s} contraction {forward * 1e3:8.1f} ms ({flops / forward / 1e9:6.1f} GFLOP/s)"
              f"  transpose {transpose * 1e3:8.1f} ms ({flops / transpose / 1e9:6.1f} GFLOP/s)")
    print(f"  {precision:5s} tc:lines  transpose {lines_time * 1e3:8.1f} ms ({flops / lines_time / 1e9:6.1f} GFLOP/s)"
          f", fill {lines.fill:.2f}")
    if packed is not None:
        print(f"  {precision:5s} tc:kpacked contraction {kp_time * 1e3:8.1f} ms ({flops / kp_time / 1e9:6.1f} GFLOP/s)"
              f", differs from the CSR kernel by {kp_error:.1e}")
    print(f"  {precision:5s} kernel ratio th/tilecast: contraction {times['th'][0] / times['tilecast'][0]:.2f}x"
          + (f" (kpacked {times['th'][0] / kp_time:.2f}x)" if packed is not None else "")
          + f", transpose {times['th'][1] / times['tilecast'][1]:.2f}x (lines {times['th'][1] / lines_time:.2f}x)"
          f"; outputs differ by {agreement:.1e} "
          f"(first {min(AGREEMENT_CHANNELS, x.shape[1])} channels)")


def print_mix_bound(work: Workload, machine: MachineRates, peer_times: tuple[float, float]) -> None:
    """The channel mix's bound on th/tilecast (module docstring): the mix runs once in a
    forward and three times in a forward+backward (the output, the input's and the weight's
    gradients), at best at this run's FMA peak (the highest probe of the run, the most
    generous bound) or at the sgemm's median rate. The contractions count for nothing: their
    whole-grid kernel times above include the first touch of a fresh output, which the fused
    path does not pay, so adding them would understate the bound."""
    mix_gflop = work.einsum_flops / 1e9
    peak, peak_median = max(machine.peaks), statistics.median(machine.peaks)
    sgemm = statistics.median(machine.sgemms)
    th_forward, th_both = peer_times
    print(f"  fp32  mix bound: {mix_gflop:.4g} GFLOP per pass; this run's FMA peak {peak:.0f} GFLOP/s "
          f"(max of {len(machine.peaks)} probes, median {peak_median:.0f}), torch sgemm at the mix's "
          f"block {machine.mix.shape[0]}x{machine.mix.shape[1]}x{machine.slab.shape[1]} "
          f"{sgemm:.0f} GFLOP/s (median of {len(machine.sgemms)})"
          + (f", tilecast's GEMM there {statistics.median(machine.tilecast_gemms):.0f} GFLOP/s "
             f"({machine.mixer.kernel_for(machine.mix, machine.slab)})"
             if machine.tilecast_gemms else ""))
    for label, passes, th_time in (("fwd", 1, th_forward), ("fwd+bwd", 3, th_both)):
        at_peak, at_sgemm = passes * mix_gflop / peak, passes * mix_gflop / sgemm
        print(f"  fp32  {label:7s} mix alone {at_peak * 1e3:8.1f} ms at the peak, {at_sgemm * 1e3:8.1f} ms at "
              f"the sgemm; th {th_time * 1e3:8.1f} ms: th/tilecast at most {th_time / at_peak:.2f}x "
              f"with the mix at the peak, {th_time / at_sgemm:.2f}x at the sgemm (contractions free)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--module-precisions", default=None,
                        help="precisions to time the modules in (default: --precisions); the "
                             "kernels are timed in all of --precisions")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"DiscoConvS2 paths to time (default all: {', '.join(PATHS)})")
    parser.add_argument("--mix-gemm", default=None, metavar="KERNEL[,KERNEL...]|registry:PATH",
                        help="also time the fused paths with their mix on tilecast GEMM kernels "
                             "(or on the choices of the gemm model published in PATH): the "
                             "first alone, and all raced against torch's sgemm")
    parser.add_argument("--mix-torch", action="store_true",
                        help="also time the fused paths with their mix on torch's sgemm only "
                             "(+torch), never in the kpacked kernel that DiscoConvS2 races "
                             "against it by default")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    names, precisions = args.configs.split(","), args.precisions.split(",")
    module_precisions = precisions if args.module_precisions is None else args.module_precisions.split(",")
    for value, valid, what in ((names, CONFIGS, "config"), (precisions, PRECISIONS, "precision"),
                               (paths, PATHS, "path"),
                               (module_precisions, precisions, "module precision (not in --precisions)")):
        unknown = [v for v in value if v not in valid]
        if unknown:
            parser.error(f"unknown {what} {unknown}; valid: {', '.join(valid)}")
    if not args.scale > 0:
        parser.error(f"--scale must be positive, got {args.scale}")

    mixer = Mixer()
    if args.mix_gemm is not None:
        spec = args.mix_gemm
        mixer = Mixer(Dispatcher.from_registry(spec[len("registry:"):], "gemm")
                      if spec.startswith("registry:") else spec.split(","), race=False)
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, {args.threads} threads, forward tile "
          f"{native.forward_tile_width(720)} longitudes at nlon_out 720")
    for name in names:
        config = scaled(CONFIGS[name], args.scale)
        start = time.perf_counter()
        work = Workload.build(name, config)
        print(f"\n{name} scale {args.scale:g}: C_in {config['in_channels']} C_out {config['out_channels']} "
              f"in {config['in_shape']} out {config['out_shape']} K {work.ours.kernel_size} "
              f"theta_cutoff {config['theta_cutoff']:.4g} nnz {work.ours.psi.nnz} "
              f"(setup {time.perf_counter() - start:.1f} s)")
        x32 = torch.randn(1, config["in_channels"], *config["in_shape"],
                          generator=torch.Generator().manual_seed(0))
        reference_out = work.reference_output(x32) if work.reference_fits() else None
        for precision in precisions:
            bench_precision(work, x32, precision, args.reps, reference_out, precision in module_precisions,
                            paths, mixer, args.mix_torch)
        del work, reference_out


if __name__ == "__main__":
    main()
