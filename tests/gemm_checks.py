"""One check the GEMM kernel tests share: built variants run problems through the benchmark
path (`run_binary`) and each output matches torch within the family's tolerance."""
from __future__ import annotations

import math
from pathlib import Path

from tilecast.measurement.protocol import Protocol, run_binary
from tilecast.families import get_family
from tilecast.stages.bench import _validate

GEMM = get_family("gemm")


def expect_gemm_matches_torch(builts, problems, directory: Path, protocol: Protocol,
                              dtype: str = "fp32") -> None:
    """Every (m, n, k, layout_a, layout_b) of `problems`, run by every built variant."""
    prepared = {}
    for number, (m, n, k, la, lb) in enumerate(problems):
        problem = GEMM.problem({"m": m, "n": n, "k": k, "dtype": dtype, "layout_a": la,
                                "layout_b": lb})
        prepared[f"j{number}"] = GEMM.prepare(problem, directory / f"p{number}", seed=number)
    jobs = [(job_id, prep.job_args) for job_id, prep in prepared.items()]
    for b in builts:
        outcomes = run_binary(b.binary, jobs, protocol)
        for job_id, prep in prepared.items():
            outcome, error = _validate(GEMM, prep, outcomes[job_id])
            assert outcome.status == "ok", (b.kernel, prep.problem, outcome.reason)
            assert math.isfinite(error) and error < GEMM.tolerance(prep.problem), \
                (b.kernel, prep.problem, error)
