"""The channel mix's matrix products, on torch's matmul or on a tilecast GEMM kernel.

A DISCO convolution spends most of its FLOPs in the channel/basis mix: per batch element and
group, weight (M, C * K) @ slab (C * K, rows * nlon). `Mixer` runs those products. Without a
GEMM choice it calls torch (torch.mm with out=, addmm_), as before. With one (a GEMM kernel
name, a list of them, or a dispatcher of the gemm family such as
`Dispatcher.from_registry("registry", "gemm")`), float32 products on the CPU may run on that
kernel: the dispatcher is asked once per product shape (m, n, k and the operands' layouts),
and the product is written straight into the output's rows (tilecast.runtime.ops.gemm_into).
Other dtypes and devices stay on torch.

Whether a kernel beats torch's sgemm at a shape depends on the machine (on the AVX-512 Xeon
MKL ran 1.1-1.3x the kernel at the mix's shapes) and on how well the dispatcher's model knows
the shape, so by default each shape's first products are a race (`Race`): torch and the
kernels (those named, or the dispatcher's RACE_KERNELS best) take turns, one untimed call
each and then RACE_SAMPLES timed calls each, and the shape stays on the one with the lowest
median from then on. The race's calls are the convolution's own products, so it costs no
extra work and every product is exact whoever runs it. `race=False` runs the chosen kernel
(the first named, or the dispatcher's choice) on every product, to time it alone.

`Mixer.default()`, DiscoConvS2's mixer when no mix_gemm is given, races DEFAULT_KERNELS for
the CPU's vector ISA: on the Zen 4 EPYC three AVX-512 variants ran the mix's products 5-20 %
faster than torch's sgemm (MKL takes its AVX2 path on AMD CPUs); on the AVX2 EPYC torch won
every race, so there are none and the products stay on torch. The kernels compile on their
first product (about 5 s each, once per machine: the build cache), and one that cannot be
built or run on this CPU leaves the race with a warning instead of failing the convolution.
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

#: timed calls of each contender before a shape's race is decided (after one untimed call each)
RACE_SAMPLES = 3
#: how many of a dispatcher's best-ranked kernels race beside torch
RACE_KERNELS = 3
#: the race's clock (a module attribute, so that a test can drive the race)
clock: Callable[[], float] = time.perf_counter
#: the contender that is torch's own product
TORCH_SIDE = "torch"
#: the GEMM kernels Mixer.default() races against torch, per vector ISA (module docstring):
#: the best three of the nightly's AVX-512 variants at the mix's shapes of self_512 and
#: down_73 (512x720x4608, 4608x512x720 with B column-major, 512x8640x720, 720x8640x512 with
#: A column-major; docs/results.md, 2026-12-05 Zen 4, second session)
DEFAULT_KERNELS = {
    "avx512": ("gemm_fp32_avx512_8x32_mc192_nc512_kc256_park_pa1_pf0",
               "gemm_fp32_avx512_4x64_mc96_nc2048_kc512_parm_pa0_pf0",
               "gemm_fp32_avx512_16x16_mc96_nc512_kc512_parm_pa1_pf0"),
    "avx2": (),
}


def default_kernels() -> tuple[str, ...]:
    """DEFAULT_KERNELS for this CPU: AVX-512's where it has AVX-512F, else AVX2's."""
    from tilecast.runtime import kernel_library

    return DEFAULT_KERNELS["avx512" if "avx512f" in kernel_library.cpu_flags() else "avx2"]


def _check_choice(gemm: Any) -> None:
    if gemm is None:
        return
    names = [gemm] if isinstance(gemm, str) else list(gemm) if isinstance(gemm, (list, tuple)) else []
    if names and all(isinstance(name, str) and name for name in names):
        from tilecast.families.base import FamilyError
        from tilecast.runtime.ops.gemm_ops import GEMM

        for name in names:
            try:
                GEMM.parse_name(name)
            except FamilyError as error:
                raise ValueError(f"mix_gemm {name!r} is not a GEMM kernel name: {error}") from None
        return
    if not callable(getattr(gemm, "select", None)):
        raise TypeError("mix_gemm must be None, a GEMM kernel name, a list of them or a gemm "
                        f"dispatcher (with .select), got {gemm!r}")
    family = getattr(gemm, "family", None)
    if family is not None and family.name != "gemm":
        raise ValueError(f"mix_gemm's dispatcher picks {family.name} kernels; the mix needs "
                         "a gemm dispatcher")


class Race:
    """One product shape's race between torch and `kernels`: `side()` names who runs the next
    call (TORCH_SIDE or a kernel name), `record(side, seconds)` keeps its time; `winner` is
    None until every contender has RACE_SAMPLES timed calls, then the one with the lowest
    median (the earlier contender on a tie, torch first). Each contender's first call is
    untimed (a first call loads the kernel and touches fresh buffers); after that the
    contenders take turns in an order rotated each round, so none always follows the same
    one."""

    def __init__(self, kernels: Sequence[str]):
        self.contenders = (TORCH_SIDE, *dict.fromkeys(kernels))
        self.seconds: dict[str, list[float]] = {side: [] for side in self.contenders}
        self._calls = 0
        self.winner: Optional[str] = None

    def side(self) -> str:
        count = len(self.contenders)
        if self._calls < count:
            return self.contenders[self._calls]
        turn, place = divmod(self._calls - count, count)
        return self.contenders[(place + turn) % count]

    def record(self, side: str, seconds: float) -> None:
        if self._calls >= len(self.contenders):
            self.seconds[side].append(seconds)
        self._calls += 1
        if all(len(times) >= RACE_SAMPLES for times in self.seconds.values()):
            medians = self.medians()
            self.winner = min(self.contenders, key=medians.__getitem__)

    def medians(self) -> dict[str, float]:
        """Each contender's median seconds over its timed calls (nan where none yet)."""
        return {side: statistics.median(times) if times else float("nan")
                for side, times in self.seconds.items()}

    def drop(self, side: str) -> None:
        """Takes a kernel out of the race (it cannot run here); the race goes on without it."""
        if side == TORCH_SIDE or side not in self.contenders:
            raise ValueError(f"{side!r} is not a kernel of this race")
        self.contenders = tuple(c for c in self.contenders if c != side)
        del self.seconds[side]
        if all(len(times) >= RACE_SAMPLES for times in self.seconds.values()):
            medians = self.medians()
            self.winner = min(self.contenders, key=medians.__getitem__)

    def __repr__(self) -> str:
        times = ", ".join(f"{side} {median * 1e3:.3g} ms" for side, median in self.medians().items())
        return f"Race({times}; winner {self.winner})"


class Mixer:
    """The mix's products: torch's, or the GEMM kernel `gemm` names or chooses, raced
    against torch per product shape unless race=False (module docstring). `kernels` records
    the kernel the choice gives for each product shape, `races` each shape's race (whose
    winner runs the shape once it is decided).

    in_kernel (with no `gemm`, or a raced one): the fused forward may run the contraction and
    the mix as one kernel (tilecast.disco.fused, kpacked_mix), raced against the contraction
    and the mix's products block by block per input shape (its race is in `races` too), or
    on every call with race=False and no `gemm`.

    optional: a raced kernel that cannot be built or run here (KernelBuildError) leaves its
    race with a warning, where otherwise the error reaches the caller (Mixer.default)."""

    def __init__(self, gemm: Any = None, race: bool = True, in_kernel: bool = True,
                 optional: bool = False):
        _check_choice(gemm)
        self.gemm = gemm
        self.race = bool(race)
        self.in_kernel = bool(in_kernel)
        self.optional = bool(optional)
        self.kernels: dict[tuple, str] = {}
        self.races: dict[tuple, Race] = {}

    @classmethod
    def default(cls) -> "Mixer":
        """The mix DiscoConvS2 runs without a mix_gemm: default_kernels() raced against torch
        (optional ones), or torch alone where the ISA has none."""
        kernels = default_kernels()
        return cls(list(kernels), optional=True) if kernels else cls()

    def __deepcopy__(self, memo) -> "Mixer":
        # a module's copy shares the kernel choice (a dispatcher holds a loaded model)
        return Mixer(self.gemm, self.race, self.in_kernel, self.optional)

    def __repr__(self) -> str:
        if self.gemm is None:
            return "Mixer(torch)" if self.in_kernel else "Mixer(torch, never in the kernel)"
        return f"Mixer({self.gemm!r}{', raced against torch' if self.race else ''})"

    def _key(self, a: Tensor, b: Tensor) -> Optional[tuple]:
        if (self.gemm is None or a.dtype != torch.float32 or b.dtype != torch.float32
                or a.device.type != "cpu" or b.device.type != "cpu"):
            return None
        from tilecast.runtime.ops import gemm_ops  # the ops import this package

        return (a.shape[0], b.shape[1], a.shape[1], gemm_ops.operand_layout(a),
                gemm_ops.operand_layout(b))

    def kernel_for(self, a: Tensor, b: Tensor) -> Optional[str]:
        """The GEMM kernel the choice gives for a @ b, or None where torch runs it (no
        choice, another dtype or device; a lost race does not change this answer)."""
        key = self._key(a, b)
        return None if key is None else self._chosen(key)

    def _chosen(self, key: tuple) -> str:
        """The kernel the choice gives at `key` (asked once per key)."""
        if key not in self.kernels:
            if isinstance(self.gemm, str):
                self.kernels[key] = self.gemm
            elif isinstance(self.gemm, (list, tuple)):
                self.kernels[key] = self.gemm[0]
            else:
                self.kernels[key] = self.gemm.select(self._problem(key))
        return self.kernels[key]

    def _contenders(self, key: tuple, kernel: str) -> list[str]:
        """The kernels that race torch at `key`: those named, or the dispatcher's RACE_KERNELS
        best (its choice first)."""
        if isinstance(self.gemm, (list, tuple)):
            return list(self.gemm)
        rank = getattr(self.gemm, "rank", None)
        if isinstance(self.gemm, str) or not callable(rank):
            return [kernel]
        return [kernel] + [name for name, _ in rank(self._problem(key), RACE_KERNELS)]

    @staticmethod
    def _problem(key: tuple):
        from tilecast.runtime.ops import gemm_ops

        m, n, k, layout_a, layout_b = key
        return gemm_ops.GEMM.problem({"m": m, "n": n, "k": k, "dtype": "fp32",
                                      "layout_a": layout_a, "layout_b": layout_b})

    def _run(self, a: Tensor, b: Tensor, on_torch: Callable[[], None],
             on_kernel: Callable[[str], None]) -> None:
        """One product: on torch, on the kernel, or the shape's race's next call."""
        key = self._key(a, b)
        if key is None:
            on_torch()
            return
        kernel = self._chosen(key)
        if not self.race:
            on_kernel(kernel)
            return
        if key not in self.races:
            self.races[key] = Race(self._contenders(key, kernel))
        race = self.races[key]
        side = race.winner or race.side()
        start = clock()
        if side == TORCH_SIDE:
            on_torch()
        else:
            from tilecast.runtime.kernel_library import KernelBuildError

            try:
                on_kernel(side)
            except KernelBuildError as error:
                if not self.optional:
                    raise
                warnings.warn(f"the channel mix races torch's sgemm without GEMM kernel "
                              f"{side!r}, which cannot run here: {error}", RuntimeWarning)
                race.drop(side)
                on_torch()
                return
        if race.winner is None:
            race.record(side, clock() - start)

    def mm(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        """out = a @ b, out a matrix of rows with unit column stride (written in place)."""
        if out.dtype != torch.float32:
            torch.mm(a, b, out=out)
            return
        from tilecast.runtime.ops import gemm_ops

        self._run(a, b, lambda: torch.mm(a, b, out=out),
                  lambda kernel: gemm_ops.gemm_into(out, a, b, kernel))

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """a (G, M, K) @ b (B, G, K, N) -> (B, G, M, N), as torch.matmul broadcasts them."""
        if self.kernel_for(a[0], b[0, 0]) is None:
            return torch.matmul(a, b)
        batch, groups = b.shape[:2]
        out = torch.empty(batch, groups, a.shape[1], b.shape[-1], dtype=torch.float32)
        for i in range(batch):
            for g in range(groups):
                self.mm(a[g], b[i, g], out[i, g])
        return out

    def addmm_(self, total: Tensor, a: Tensor, b: Tensor) -> None:
        """total += a @ b (the kernels write, so the kernel's product goes through a buffer)."""
        if total.dtype != torch.float32:
            total.addmm_(a, b)
            return
        from tilecast.runtime.ops import gemm_ops

        def on_kernel(kernel: str) -> None:
            product = torch.empty(total.shape, dtype=torch.float32)
            gemm_ops.gemm_into(product, a, b, kernel)
            total.add_(product)

        self._run(a, b, lambda: total.addmm_(a, b), on_kernel)


#: the mix on torch's matmul
TORCH = Mixer()
