"""tilecast.stages.roofline and the report's roofline section: hand-computed rooflines of GEMM
problems under given ceilings (no probe), and one real reading of the ceilings.

Square fp32 GEMMs of side s do 2 s^3 FLOPs on 12 s^2 compulsory bytes: s / 6 FLOP per byte.
Under a 100 GFLOP/s peak and 10 GB/s the ridge is at 10 FLOP/byte, i.e. s = 60.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from tilecast.families import get_family
from tilecast.stages import layout, roofline
from tilecast.stages.evaluate import Evaluation
from tilecast.stages.report import write_report

GEMM = get_family("gemm")
CEILINGS = {"fma_peak_gflops": 100.0, "read_bandwidth_gbps": 10.0, "threads": 2,
            "buffer_mib": 1024}
# side -> (chosen TFLOP/s, best TFLOP/s, peer TFLOP/s or None)
MEASURED = {60: (0.05, 0.08, 0.06), 12: (0.015, 0.03, 0.02), 120: (0.09, 0.09, None)}


def key(side: int) -> str:
    return GEMM.dims_key(GEMM.problem({"m": side, "n": side, "k": side}))


def per_problem() -> pd.DataFrame:
    rows = []
    for side, (chosen, best, _) in MEASURED.items():
        problem = GEMM.problem({"m": side, "n": side, "k": side})
        rows.append({"dims_key": key(side), **GEMM.problem_dict(problem),
                     "chosen_kernel": "k_chosen", "chosen_tflops": chosen,
                     "best_kernel": "k_best", "best_tflops": best, "efficiency": chosen / best,
                     "static_best_efficiency": 0.5, "winner_rank": 1})
    return pd.DataFrame(rows)


def peer_per_problem() -> pd.DataFrame:
    rows = [{"dims_key": key(side), "problem_set": "holdout", "peer": "torch.matmul",
             "peer_tflops": peer, "best_tflops": best, "ratio": best / peer}
            for side, (_, best, peer) in MEASURED.items() if peer is not None]
    # a training problem's peer row is not a held-out problem's
    rows.append({"dims_key": key(7), "problem_set": "train", "peer": "torch.matmul",
                 "peer_tflops": 1.0, "best_tflops": 1.0, "ratio": 1.0})
    return pd.DataFrame(rows)


def test_table_matches_hand_computed_rooflines():
    table = roofline.table(GEMM, per_problem(), peer_per_problem(), CEILINGS).set_index("dims_key")
    assert list(table.index) == [key(60), key(12), key(120)]
    assert table.loc[key(12), "flops"] == 2 * 12 ** 3 and table.loc[key(12), "bytes"] == 12 * 144
    assert table["intensity"].tolist() == pytest.approx([10.0, 2.0, 20.0])
    # s = 60 sits on the ridge: bandwidth x intensity equals the peak, so compute-bound
    assert table["roof_gflops"].tolist() == pytest.approx([100.0, 20.0, 100.0])
    assert table["bound"].tolist() == ["compute", "memory", "compute"]
    assert table["chosen_gflops"].tolist() == pytest.approx([50.0, 15.0, 90.0])
    assert table["chosen_of_roof"].tolist() == pytest.approx([0.5, 0.75, 0.9])
    assert table.loc[key(60), "peer_gflops"] == pytest.approx(60.0)
    assert math.isnan(table.loc[key(120), "peer_gflops"])


def test_summary_figures_are_json_able():
    table = roofline.table(GEMM, per_problem(), peer_per_problem(), CEILINGS)
    summary = roofline.summary(table, CEILINGS)
    assert summary == {
        "n_problems": 3, "memory_bound": 1, "median_chosen_of_roof": pytest.approx(0.75),
        "p10_chosen_of_roof": pytest.approx(0.55),       # 0.5 + 0.2 * (0.75 - 0.5)
        "median_best_of_roof": pytest.approx(0.9),       # of 0.8, 1.5 (in cache), 0.9
        "median_peer_of_roof": pytest.approx(0.8),       # of 0.6, 1.0
        **CEILINGS}
    assert json.loads(json.dumps(summary)) == summary


def test_without_peer_the_peer_column_is_nan_and_its_median_none():
    table = roofline.table(GEMM, per_problem(), None, CEILINGS)
    assert table["peer_gflops"].isna().all()
    assert roofline.summary(table, CEILINGS)["median_peer_of_roof"] is None


@pytest.mark.parametrize("ceilings", [{**CEILINGS, "read_bandwidth_gbps": 0.0},
                                      {**CEILINGS, "fma_peak_gflops": float("nan")},
                                      {"fma_peak_gflops": 100.0, "read_bandwidth_gbps": 10.0}])
def test_bad_ceilings_are_refused(ceilings):
    with pytest.raises(ValueError, match="ceilings need positive finite"):
        roofline.table(GEMM, per_problem(), None, ceilings)


def test_plot_is_a_png():
    table = roofline.table(GEMM, per_problem(), peer_per_problem(), CEILINGS)
    assert roofline.plot("gemm", table, CEILINGS)[:8] == b"\x89PNG\r\n\x1a\n"


def evaluation() -> Evaluation:
    table = per_problem()
    metrics = {"n_problems": 3, "mean_efficiency": float(table["efficiency"].mean()),
               "static_best": {"kernel": "k_static", "mean_efficiency": 0.5},
               "margin_over_static_best": float(table["efficiency"].mean()) - 0.5}
    return Evaluation(metrics=metrics, per_problem=table)


def test_write_report_adds_the_roofline_section_plot_and_entry(tmp_path):
    table = roofline.table(GEMM, per_problem(), peer_per_problem(), CEILINGS)
    directory = write_report(tmp_path, {"gemm": (evaluation(), {})}, {},
                             rooflines={"gemm": (table, CEILINGS)})
    assert sorted(p.name for p in directory.iterdir()) == [
        "efficiency_gemm.png", "evaluation.json", "report.md", "roofline_gemm.png"]
    assert layout.Workdir(tmp_path).roofline_plot("gemm").read_bytes()[:4] == b"\x89PNG"
    entry = json.loads((directory / "evaluation.json").read_text())["models"]["gemm"]
    assert entry["roofline"] == roofline.summary(table, CEILINGS)
    section = (directory / "report.md").read_text().split("### Roofline (held-out problems)")[1]
    assert "measured at report time on this machine's CPU with 2 threads" in section
    assert "| chosen / roof, median | 0.7500 |" in section
    assert "| problems (memory-bound) | 3 (1) |" in section
    assert "![roofline of `gemm`](roofline_gemm.png)" in section


def test_write_report_without_rooflines_has_no_roofline(tmp_path):
    directory = write_report(tmp_path, {"gemm": (evaluation(), {})}, {})
    assert "roofline" not in json.loads((directory / "evaluation.json").read_text())["models"]["gemm"]
    assert "Roofline" not in (directory / "report.md").read_text()
    with pytest.raises(ValueError, match=r"rooflines for \['conv'\]"):
        write_report(tmp_path, {"gemm": (evaluation(), {})}, {},
                     rooflines={"conv": (roofline.table(GEMM, per_problem(), None, CEILINGS),
                                         CEILINGS)})


@pytest.mark.parametrize("l3_bytes, mib", [(0, 256), (8 << 20, 256), (260 << 20, 1040),
                                           (1 << 30, 2048)])
def test_the_bandwidth_buffer_is_past_the_last_level_cache(l3_bytes, mib):
    assert roofline.buffer_mib(l3_bytes) == mib


def test_measured_ceilings_are_positive_and_finite():
    ceilings = roofline.measure_ceilings(1, l3_bytes=8 << 20)
    assert ceilings["threads"] == 1 and ceilings["buffer_mib"] == 256
    for name in ("fma_peak_gflops", "read_bandwidth_gbps"):
        assert np.isfinite(ceilings[name]) and ceilings[name] > 0, name


@pytest.mark.parametrize("threads, l3_bytes, named", [(0, 0, "threads.*got 0"),
                                                      (True, 0, "threads.*got True"),
                                                      (1, -1, "l3_bytes.*got -1")])
def test_bad_ceiling_arguments_are_refused(threads, l3_bytes, named):
    with pytest.raises(ValueError, match=named):
        roofline.measure_ceilings(threads, l3_bytes)
