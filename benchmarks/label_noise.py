"""Where two runs' labels disagree, and how many race samples agreement would take.

    .venv/bin/python benchmarks/label_noise.py RUN_A RUN_B [--family gemm]

RUN_A and RUN_B are two workdirs (or converted parquet files) of one config. Prints:
1. the disagreeing problems (A's winner under 98 % of B's best) split by whether each run's
   winner was raced in the other run;
2. each raced kernel's label, A against B, centred per problem (a run-wide shift of a problem
   is not a disagreement): the between-run spread of one label;
3. within run A: the spread of single race samples of one kernel within one round, and of the
   round medians across rounds; if the between-run spread is no larger than what the samples'
   own scatter predicts, nothing persistent (layout, a state lasting the run) is left to
   remove, and only more samples help;
4. a simulation: run A's labels of the raced kernels taken as true speeds, both runs' labels
   drawn with noise sigma, the share of problems whose winner is within 2 % of the other
   run's best; the sigma that reaches 90 %, and the factor more samples that takes.
"""
from __future__ import annotations

import argparse

import numpy as np

from tilecast.core import dataset, stats
from tilecast.workflows.repeatability import dataset_path, per_problem, summarize

ROBUST = 1.4826   # MAD -> standard deviation of a normal


def raced(records) -> set[tuple[str, str]]:
    confirm = records[(records["phase"] == "confirm") & (records["status"] == "ok")]
    return set(zip(confirm["dims_key"], confirm["kernel"]))


def within_share(levels: list[np.ndarray], sigma: float, rng, trials: int = 20) -> float:
    """Share of problems whose noisy winner (one run) is within 2 % of the noisy best (other)."""
    hits = total = 0
    for _ in range(trials):
        for true in levels:
            a = true + rng.normal(0, sigma, true.size)
            b = true + rng.normal(0, sigma, true.size)
            hits += b[np.argmin(a)] - b.min() <= np.log(1.02)
            total += 1
    return hits / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--family", default="gemm")
    args = parser.parse_args()
    records = [dataset.load(dataset_path(run, args.family)) for run in (args.run_a, args.run_b)]
    finals = [dataset.final_table(r) for r in records]
    raced_a, raced_b = raced(records[0]), raced(records[1])

    table = per_problem(finals[0], finals[1])
    print("A's winners on B:", summarize(table).line())
    bad = table[table["efficiency"] < 0.98]
    both = sum((key, pick) in raced_b and (key, win) in raced_a
               for key, pick, win in zip(bad["dims_key"], bad["pick"], bad["truth_winner"]))
    print(f"1. {len(bad)} problems under 0.98; both winners raced in both runs: {both}")

    labels = [f[f["status"] == "ok"].set_index(["dims_key", "kernel"])["median_s"] for f in finals]
    pairs = sorted(raced_a & raced_b & set(labels[0].index) & set(labels[1].index))
    by_problem: dict[str, list[float]] = {}
    for key, kernel in pairs:
        by_problem.setdefault(key, []).append(np.log(labels[0][key, kernel] / labels[1][key, kernel]))
    centred = [x - np.median(v) for v in by_problem.values() if len(v) >= 3 for x in v]
    between = stats.mad(centred, scale=ROBUST)
    print(f"2. one label, A against B (log ratio centred per problem, {len(centred)} labels): "
          f"robust sd {between:.4f} -> one run's label {between / np.sqrt(2):.4f}")

    confirm = records[0][(records[0]["phase"] == "confirm") & (records[0]["status"] == "ok")]
    sample_sd, round_sd = [], []
    for samples, rounds in zip(confirm["samples_s"], confirm["round_medians_s"]):
        if len(rounds) < 2 or len(samples) % len(rounds):
            continue
        per_round = np.log(np.asarray(samples, dtype=float)).reshape(len(rounds), -1)
        sample_sd.append(np.median(per_round.std(axis=1, ddof=1)))
        round_sd.append(np.log(np.asarray(rounds, dtype=float)).std(ddof=1))
    if sample_sd:
        per_round_n = len(confirm["samples_s"].iloc[0]) // max(len(confirm["round_medians_s"].iloc[0]), 1)
        print(f"3. run A, {len(sample_sd)} raced kernels: one sample's sd within a round "
              f"{np.median(sample_sd):.4f}; round medians' sd {np.median(round_sd):.4f} "
              f"(samples alone predict ~{1.25 * np.median(sample_sd) / np.sqrt(per_round_n):.4f})")

    levels = []
    for key, group in finals[0][finals[0]["status"] == "ok"].groupby("dims_key"):
        contenders = [np.log(s) for k, s in zip(group["kernel"], group["median_s"]) if (key, k) in raced_a]
        if len(contenders) >= 2:
            levels.append(np.asarray(contenders))
    rng = np.random.default_rng(0)
    label_sd = between / np.sqrt(2)
    print(f"4. simulated on {len(levels)} problems' raced kernels (A's labels as true speeds):")
    for sigma in (label_sd, 0.012, 0.010, 0.008, 0.006, 0.004):
        share = within_share(levels, sigma, rng)
        print(f"   label sd {sigma:.4f}: within 2 % {share:.3f}  "
              f"(samples x {(label_sd / sigma) ** 2:.1f} of today's)")


if __name__ == "__main__":
    main()
