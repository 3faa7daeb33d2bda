"""tilecast.measurement.probe: the FMA peak that the DISCO benchmark's mix bound divides by, and the
read bandwidth that GEMV-class kernels are judged against (benchmarks/gemm_peers.py).

How the peak compares with torch's sgemm beside it is a timing against a timing, so it is a
benchmark (benchmarks/fma_probe.py), not a test here.
"""
from __future__ import annotations

import pytest

from tilecast.measurement import probe

#: no x86 core tilecast runs on clocks above this (GHz); with 2 FMA ports per core it caps
#: what a correct flop count can read
MAX_GHZ = 6.0
FMA_PORTS = 2


def test_the_probe_reads_a_rate_a_core_can_reach():
    rate = probe.fma_peak_gflops(1)
    # 2 flops per lane per FMA; an overstated flop count (2x) passes this cap on any core
    # slower than 3 GHz per FMA port pair
    assert 0 < rate <= FMA_PORTS * 2 * probe.lanes() * MAX_GHZ


@pytest.mark.parametrize("threads, iterations, named", [(0, 10, "threads.*got 0"),
                                                        (1, 0, "iterations.*got 0"),
                                                        (-2, 100, "threads.*got -2")])
def test_bad_arguments_are_refused(threads, iterations, named):
    with pytest.raises(ValueError, match=named):
        probe.fma_peak_gflops(threads, iterations)


def test_the_bf16_dot_probe_reads_a_rate_a_core_can_reach_or_says_there_is_none(hw):
    rate = probe.bf16_dot_peak_gflops(1, iterations=2_000_000)
    if "avx512_bf16" not in hw["flags"]:
        assert rate is None
        return
    # 4 flops a lane a vdpbf16ps, 16 lanes; an overstated count (2x) passes this cap on any
    # core slower than 3 GHz per port pair
    assert rate is not None and 0 < rate <= FMA_PORTS * 4 * 16 * MAX_GHZ
    with pytest.raises(ValueError, match="iterations.*got 0"):
        probe.bf16_dot_peak_gflops(1, 0)


#: two 32-byte loads per cycle per core at MAX_GHZ: no core reads its L1 faster, let alone memory
MAX_READ_GBPS_PER_THREAD = 2 * 32 * MAX_GHZ


def test_the_bandwidth_probe_reads_a_rate_a_core_can_reach():
    rate = probe.read_bandwidth_gbps(1, mib=64, passes=2)
    # a byte count overstated by a vector width (8x or 16x) passes this cap
    assert 0 < rate <= MAX_READ_GBPS_PER_THREAD


@pytest.mark.parametrize("threads, mib, passes, named", [(0, 64, 1, "threads.*got 0"),
                                                         (1, 0, 1, "mib and passes.*0 and 1"),
                                                         (1, 64, 0, "mib and passes.*64 and 0")])
def test_bad_bandwidth_arguments_are_refused(threads, mib, passes, named):
    with pytest.raises(ValueError, match=named):
        probe.read_bandwidth_gbps(threads, mib, passes)

