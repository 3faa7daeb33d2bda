"""tilecast.core.probe: the FMA peak that the DISCO benchmark's mix bound divides by."""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from tilecast.core import probe

#: no x86 core tilecast runs on clocks above this (GHz); with 2 FMA ports per core it caps
#: what a correct flop count can read
MAX_GHZ = 6.0
FMA_PORTS = 2


def test_the_probe_reads_a_rate_a_core_can_reach():
    rate = probe.fma_peak_gflops(1)
    # 2 flops per lane per FMA; an overstated flop count (2x) passes this cap on any core
    # slower than 3 GHz per FMA port pair
    assert 0 < rate <= FMA_PORTS * 2 * probe.lanes() * MAX_GHZ


def test_no_gemm_beats_the_probe_beside_it():
    """torch's sgemm on a cache-resident problem, interleaved with the probe: its median rate
    stays under the highest probe (a GEMM does the same FMAs, plus loads)."""
    threads = torch.get_num_threads()
    a, b = torch.randn(96, 256), torch.randn(256, 512)
    out = torch.empty(96, 512)
    flops = 2.0 * 96 * 256 * 512
    peaks, gemms = [], []
    torch.mm(a, b, out=out)
    for _ in range(5):
        peaks.append(probe.fma_peak_gflops(threads))
        start = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b, out=out)
        gemms.append(20 * flops / (time.perf_counter() - start) / 1e9)
    assert statistics.median(gemms) <= max(peaks), (gemms, peaks)


@pytest.mark.parametrize("threads, iterations", [(0, 10), (1, 0), (-2, 100)])
def test_bad_arguments_are_refused(threads, iterations):
    with pytest.raises(ValueError):
        probe.fma_peak_gflops(threads, iterations)
