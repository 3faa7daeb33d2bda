"""PyTorch AutoHeuristic's real mm measurements (A100, H100): per-device and cross-device
table models against the defaults a user would otherwise run.

    python benchmarks/autoheuristic.py ../shared/data/autoheuristic OUT [--rounds 300]

Unzips the zips of DATA into OUT/raw, imports them (`tilecast import --from autoheuristic`;
the files name no device: A100-SXM4-80GB and H100-SXM5-80GB, the parts the data's README
names), and evaluates as `tilecast transfer --dataset` does, every choice among the ones each
problem was offered:

  per device, problem folds      a{100,h100}_mm.txt, --split problems
  per device, unseen workload    {hf,timm}_train_mm.txt of one device, --split sources
  across devices                 both mm files, --split leave-one-device-out

and prints, per device, the model's mean / P10 efficiency, top-1, top-5, the shortlist of 5,
"unsure" (coverage, confident-wrong), and the baselines (always extern_mm: cuBLAS; the best on
average; plain LightGBM), and the model's own top predictions without the incumbent guard.
Writes OUT/<evaluation>/report/transfer.json (and .md) as the command does.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEVICES = {"a100": "A100-SXM4-80GB", "h100": "H100-SXM5-80GB"}
DEFAULT = "choice=extern_mm"


def unzip(data: Path, raw: Path) -> None:
    for archive in sorted(data.glob("*.zip")):
        with zipfile.ZipFile(archive) as z:
            z.extractall(raw)


def dataset(raw: Path, out: Path, files: dict[str, list[str]]) -> Path:
    """A dataset of `files` ({device key: file names}), imported once."""
    from tilecast.table.importing import import_files

    if (out / "dataset.json").is_file():
        return out
    for key, names in files.items():
        summary = import_files("autoheuristic", [raw / key / n for n in names], out,
                               device=DEVICES[key])
        print(f"  {summary.line()}", flush=True)
    return out


def evaluate(path: Path, split: str, workdir: Path, rounds: int, threads: int | None) -> dict:
    from tilecast.table.dataset import read_dataset
    from tilecast.table.devices import DeviceTable
    from tilecast.table.transfer import run_transfer
    from tilecast.table.transfer_report import write_report

    started = time.monotonic()
    result = run_transfer(read_dataset(path), DeviceTable.load(), split=split, rounds=rounds,
                          threads=threads, default=DEFAULT)
    write_report(workdir, result)
    result.report["wall_s"] = time.monotonic() - started
    return result.report


def line(name: str, device: str, block: dict) -> str:
    base = block["baselines"]
    unsure = block["unsure"]
    return (f"{name} | {device} | {block['n_problems']} | {block['mean_efficiency']:.4f} | "
            f"{block['p10_efficiency']:.4f} | {block['top1']:.3f} | {block['top5']:.3f} | "
            f"{block['shortlist'].get('5', float('nan')):.4f} | {unsure['coverage']:.3f} / "
            f"{unsure['confident_wrong']:.3f} | {base['default']['mean_efficiency']:.4f} | "
            f"{base['best_on_average']['mean_efficiency']:.4f} | "
            f"{base['plain_lightgbm']['mean_efficiency']:.4f} | "
            f"{block['incumbent']['model_alone']:.4f} | {block['incumbent']['share']:.3f}")


def ablate(args) -> None:
    """The ablation switches: features left out, LightGBM parameters overridden."""
    import json
    import re

    from tilecast.table import features, model

    if args.params:
        params, base = json.loads(args.params), model.lgb_params
        model.lgb_params = lambda *a, **k: {**base(*a, **k), **params}
    if args.blank:
        pattern = re.compile(args.blank)
        engine = features.TableFeatures
        for name in ("rows", "grid"):
            method = getattr(engine, name)

            def blanked(self, *a, _method=method, **k):
                matrix = _method(self, *a, **k)
                matrix[:, [i for i, n in enumerate(self.names) if pattern.search(n)]] = float("nan")
                return matrix
            setattr(engine, name, blanked)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="the directory of a100_mm.zip and h100_mm.zip")
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gpus", default="a100,h100", help="per-device evaluations of these")
    parser.add_argument("--formulation", default=None,
                        help="train with this formulation (tilecast.table.model.FORMULATIONS)")
    parser.add_argument("--no-parts", action="store_true",
                        help="without the choice-part features (what they give)")
    parser.add_argument("--params", default=None,
                        help="LightGBM parameters over the model's, as JSON (an ablation)")
    parser.add_argument("--blank", default=None,
                        help="a regular expression: features whose names match it are left "
                             "missing in every row (an ablation, e.g. '^choice$' or 'stride')")
    parser.add_argument("--only", default=None,
                        help="comma-separated evaluations: problems, workloads, devices")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    if args.no_parts:
        from tilecast.table import features

        features.CHOICE_PARTS = False
    ablate(args)
    if args.formulation:
        from tilecast.table import model

        fit = model.TableModel.fit.__func__
        model.TableModel.fit = classmethod(
            lambda cls, *a, **k: fit(cls, *a, **{**k, "formulation": args.formulation}))
    raw = args.out / "raw"
    if not (raw / "a100").is_dir():
        unzip(args.data, raw)
    wanted = set((args.only or "problems,workloads,devices").split(","))
    runs = []
    gpus = [g for g in args.gpus.split(",") if g in DEVICES]
    if "problems" in wanted:
        for key in gpus:
            runs.append((f"{key} problem folds", "problems",
                         {key: [f"{key}_mm.txt"]}))
    if "workloads" in wanted:
        for key in gpus:
            runs.append((f"{key} hf <-> timm", "sources",
                         {key: [f"{key}_hf_train_mm.txt", f"{key}_timm_train_mm.txt"]}))
    if "devices" in wanted:
        runs.append(("A100 <-> H100", "leave-one-device-out",
                     {key: [f"{key}_mm.txt"] for key in DEVICES}))
    rows = []
    for name, split, files in runs:
        slug = name.replace(" ", "_").replace("<->", "x")
        print(f"{name}: importing", flush=True)
        path = dataset(raw, args.out / "datasets" / slug, files)
        report = evaluate(path, split, args.out / slug, args.rounds, args.threads)
        print(f"{name}: {report['wall_s']:.0f} s", flush=True)
        rows += [line(name, device, block) for device, block in report["devices"].items()]
    print("evaluation | device | problems | mean | P10 | top-1 | top-5 | shortlist 5 | "
          "sure coverage / confident-wrong | always extern_mm | best on average | "
          "plain LightGBM | model alone | guarded share")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
