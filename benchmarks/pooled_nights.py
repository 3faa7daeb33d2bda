"""What pooling nights buys, from two stores holding two independent series of nights of one
config on one hardware class: for K = 1 .. N,

- labels: series A's winners pooled over its first K nights scored on B's pooled labels over
  its first K nights, and the other way (what `tilecast repeatability A B` prints, summed up);
- model: a model trained on A's labels pooled over K nights (the config's model spec),
  scored on B's held-out problems pooled over all of B's nights, and the other way, against
  the static best.

    .venv/bin/python benchmarks/pooled_nights.py storeA storeB --config repeat

Nothing is measured here: both stores are read as they are.
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
from tilecast.workflows.repeatability import (  # noqa: E402
    RUNTIME_BINS_US, common_class, series_agreement, summarize)


def holdout_keys(config, family) -> set[str]:
    fc = config.families[family.name]
    return {family.dims_key(family.problem(v)) for v in fc.problems["holdout"]}


def model_figures(family, config, train_records, truth_final, holdout, work: Path) -> dict:
    """A model trained on `train_records`' pooled labels, scored on `truth_final`'s
    held-out problems."""
    fc = config.families[family.name]
    pooled = labels.pooled_final(train_records)
    train = pooled[~pooled["dims_key"].isin(holdout)]
    truth_holdout = truth_final[truth_final["dims_key"].isin(holdout)]
    truth_train = truth_final[~truth_final["dims_key"].isin(holdout)]
    spec = ModelSpec.from_mapping({"seed": fc.seed, **fc.model})
    profile = hardware.profile(config.protocol.threads)
    engine = family.feature_engine(profile)
    train_model(family, engine, dataset.valid(train), spec, work, profile)
    kernels = sorted(set(train["kernel"]))
    result = evaluate(family, engine, load_predictor(work), truth_holdout, truth_train, kernels,
                      config.tie_threshold_pct)
    return result.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stores", nargs=2)
    parser.add_argument("--config", default="repeat")
    parser.add_argument("--family", default="gemm")
    parser.add_argument("--nights", type=int, default=None)
    args = parser.parse_args()
    config = load_config(args.config)
    family = get_family(args.family)
    stores = [Store(s).require() for s in args.stores]
    chosen = common_class(stores, None, args.family)
    records = [nights.read_frame(s, chosen, args.family) for s in stores]
    orders = [labels.nights_in_order(r) for r in records]
    most = min(map(len, orders)) if args.nights is None else args.nights
    holdout = holdout_keys(config, family)
    truths = [labels.pooled_final(r) for r in records]   # each series pooled over all its nights
    print(f"class {chosen}; nights: A {len(orders[0])}, B {len(orders[1])}; "
          f"{len(holdout)} held-out problems of config {config.name}")
    print("\nlabels: one series' pooled winners on the other's pooled labels (both ways), "
          "mean / P10 / within 2 %, overall and worst runtime bin")
    for k in range(1, most + 1):
        cells = []
        for name, table in series_agreement(*records, k, config.tie_threshold_pct).items():
            overall = summarize(table)
            worst = min((summarize(table[(table["best_us"] >= lo) & (table["best_us"] < hi)])
                         for lo, hi, _ in RUNTIME_BINS_US
                         if ((table["best_us"] >= lo) & (table["best_us"] < hi)).any()),
                        key=lambda a: a.mean)
            cells.append(f"{overall.mean:.4f} / {overall.p10:.4f} / {overall.within_2pct:.2f} "
                         f"(worst bin {worst.mean:.4f} / {worst.p10:.4f} / "
                         f"{worst.within_2pct:.2f})")
        print(f"  K = {k}: A on B {cells[0]};  B on A {cells[1]}")
    print("\nmodel: trained on one series' first K nights, scored on the other's held-out "
          "problems pooled over all its nights: mean / P10 / top-1 / top-5 (static best mean)")
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(1, most + 1):
            cells = []
            for pick, truth in ((0, 1), (1, 0)):
                first = records[pick][records[pick]["run_id"].isin(orders[pick][:k])]
                m = model_figures(family, config, first, truths[truth], holdout,
                                  Path(scratch) / f"k{k}-{pick}")
                cells.append(f"{m['mean_efficiency']:.4f} / {m['p10_efficiency']:.4f} / "
                             f"{m['top1']:.3f} / {m['top5']:.3f} "
                             f"({m['static_best']['mean_efficiency']:.4f})")
            print(f"  K = {k}: A's model on B {cells[0]};  B's model on A {cells[1]}")


if __name__ == "__main__":
    main()
