"""How a model learns from the nights of one store: for K = 1 .. N (the store's nights of one
class, in the order they ran), a model of the config's spec trained on the labels pooled over
the first K nights (every training shape they measured), scored on the config's held-out
shapes with their labels pooled over all N nights, against the static best.

    .venv/bin/python benchmarks/nights_learning.py STORE --config nightly

Nothing is measured here: the store is read as it is.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import dataset, hardware  # noqa: E402
from tilecast.core.config import load_config  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.stages.evaluate import evaluate  # noqa: E402
from tilecast.stages.train import ModelSpec, load_predictor, train_model  # noqa: E402
from tilecast.store import labels, nights  # noqa: E402
from tilecast.store.store import Store  # noqa: E402
from tilecast.workflows.repeatability import common_class  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--config", default="nightly")
    parser.add_argument("--family", default="gemm")
    parser.add_argument("--hardware-class", default=None)
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


if __name__ == "__main__":
    main()
