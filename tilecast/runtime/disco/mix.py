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
"""
from __future__ import annotations

import statistics
import time
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


def _check_choice(gemm: Any) -> None:
    if gemm is None:
        return
    names = [gemm] if isinstance(gemm, str) else list(gemm) if isinstance(gemm, (list, tuple)) else []
    if names and all(isinstance(name, str) and name for name in names):
        from tilecast.core.family import FamilyError
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

    def __repr__(self) -> str:
        times = ", ".join(f"{side} {median * 1e3:.3g} ms" for side, median in self.medians().items())
        return f"Race({times}; winner {self.winner})"


class Mixer:
    """The mix's products: torch's, or the GEMM kernel `gemm` names or chooses, raced
    against torch per product shape unless race=False (module docstring). `kernels` records
    the kernel the choice gives for each product shape, `races` each shape's race (whose
    winner runs the shape once it is decided).

    in_kernel (with no `gemm`, or a raced one): the fused forward may run the contraction and
    the mix as one kernel (tilecast.runtime.disco.fused, kpacked_mix), raced against the contraction
    and the mix's products block by block per input shape (its race is in `races` too), or
    on every call with race=False and no `gemm`."""

    def __init__(self, gemm: Any = None, race: bool = True, in_kernel: bool = True):
        _check_choice(gemm)
        self.gemm = gemm
        self.race = bool(race)
        self.in_kernel = bool(in_kernel)
        self.kernels: dict[tuple, str] = {}
        self.races: dict[tuple, Race] = {}

    def __deepcopy__(self, memo) -> "Mixer":
        # a module's copy shares the kernel choice (a dispatcher holds a loaded model)
        return Mixer(self.gemm, self.race, self.in_kernel)

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
            on_kernel(side)
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
