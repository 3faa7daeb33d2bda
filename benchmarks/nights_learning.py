"""How a model learns from the nights of one store: for K = 1 .. N (the store's nights of one
class, in the order they ran), a model of the config's spec trained on the labels pooled over
the first K nights (every training shape they measured), scored on the config's held-out
shapes with their labels pooled over all N nights, against the static best.

    .venv/bin/python benchmarks/nights_learning.py STORE --config nightly [--ceiling]

--ceiling adds, on all N nights, a few tree sizes and learning rates at fixed rounds, each
scored twice: on the held-out shapes as above, and in-sample (the held-out shapes' labels
added to the training set): what separates the model from the labels, capacity or shapes.
Nothing is measured here: the store is read as it is.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import dataset, hardware  # noqa: E402
from tilecast.config import load_config  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.stages.evaluate import evaluate  # noqa: E402
from tilecast.stages.train import ModelSpec, load_predictor, train_model  # noqa: E402
from tilecast.store import labels, nights  # noqa: E402
from tilecast.store.store import Store  # noqa: E402
from tilecast.workflows.replay import fit_predictor  # noqa: E402
from tilecast.workflows.repeatability import common_class  # noqa: E402

# (name, spec changes, rounds): the config's spec, bigger trees, a faster rate for longer
CEILING = [("the config's spec, 500 rounds", {}, 500),
           ("63 leaves, 3 rows a leaf", {"num_leaves": 63, "min_data_in_leaf": 3}, 500),
           ("127 leaves, 5 rows a leaf", {"num_leaves": 127, "min_data_in_leaf": 5}, 500),
           ("rows unweighted (top_weight 0)", {"top_weight": 0.0}, 500),
           ("top_weight 6", {"top_weight": 6.0}, 500),
           ("learning rate 0.05, 1500 rounds", {"learning_rate": 0.05}, 1500)]


def ceiling(family, engine, truth, holdout, spec, kernels, tie_pct, threads) -> None:
    """Each CEILING variant on every training shape: held-out and in-sample figures."""
    from dataclasses import replace

    train = truth[~truth["dims_key"].isin(holdout)]
    held = truth[truth["dims_key"].isin(holdout)]
    print("variant | held-out: mean / P10 / top-1 | in-sample: mean / P10 / top-1")
    for name, changes, rounds in CEILING:
        cells = []
        for rows in (train, truth):
            predictor = fit_predictor(family, engine, rows, replace(spec, **changes), rounds,
                                      threads)
            m = evaluate(family, engine, predictor, held, train, kernels, tie_pct).metrics
            cells.append(f"{m['mean_efficiency']:.4f} / {m['p10_efficiency']:.4f} / "
                         f"{m['top1']:.3f}")
        print(f"{name} | {cells[0]} | {cells[1]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--config", default="nightly")
    parser.add_argument("--family", default="gemm")
    parser.add_argument("--hardware-class", default=None)
    parser.add_argument("--ceiling", action="store_true",
                        help="also tree sizes and rates, held-out and in-sample")
    args = parser.parse_args()
    config = load_config(args.config)
    family, fc = get_family(args.family), config.families[args.family]
    store = Store(args.store).require()
    chosen = common_class([store], args.hardware_class, args.family)
    records = nights.read_frame(store, chosen, args.family)
    order = labels.nights_in_order(records)
    holdout = {family.dims_key(family.problem(v)) for v in fc.problems["holdout"]}
    truth = labels.pooled_final(records)
    truth_holdout = truth[truth["dims_key"].isin(holdout)]
    spec = ModelSpec.from_mapping({"seed": fc.seed, **fc.model})
    profile = hardware.profile(config.protocol.threads)
    engine = family.feature_engine(profile)
    print(f"class {chosen}; {len(order)} nights; {truth_holdout['dims_key'].nunique()} held-out "
          f"shapes of config {config.name}, labels pooled over all nights")
    print("K | night | training shapes | mean | P10 | top-1 | top-5 | static best")
    for k in range(1, len(order) + 1):
        pooled = labels.series_labels(records, order[:k])
        train = pooled[~pooled["dims_key"].isin(holdout)]
        with tempfile.TemporaryDirectory() as work:
            train_model(family, engine, dataset.valid(train), spec, work, profile)
            kernels = sorted(set(train["kernel"]))
            metrics = evaluate(family, engine, load_predictor(work), truth_holdout, train,
                               kernels, config.tie_threshold_pct).metrics
        print(f"{k} | {order[k - 1]} | {train['dims_key'].nunique()} | "
              f"{metrics['mean_efficiency']:.4f} | {metrics['p10_efficiency']:.4f} | "
              f"{metrics['top1']:.3f} | {metrics['top5']:.3f} | "
              f"{metrics['static_best']['mean_efficiency']:.4f}", flush=True)
    if args.ceiling:
        ceiling(family, engine, truth, holdout, spec, sorted(set(truth["kernel"])),
                config.tie_threshold_pct, int(profile.get("threads") or 2))


if __name__ == "__main__":
    main()
