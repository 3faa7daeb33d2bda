"""Bring your own measurements: `tilecast import`, `train`, `publish` and `transfer` (a table
model trained on an imported dataset, evaluated on what it never saw)."""
from __future__ import annotations

import argparse
import sys

from tilecast.cli.errors import CliError
from tilecast.cli.options import REGISTRY_HELP, add_command
from tilecast.cli.paths import registry_root, user_dir, user_file

TRANSFER_DESCRIPTION = (
    "Hold each device of an imported dataset out in turn (or, with --split, problem folds or "
    "each imported file's problems), train on the rest and score the picks against the "
    "held-out measurements and the baselines; writes WORKDIR/report/transfer.json and "
    "transfer.md. Was `tilecast evaluate --dataset`.")


def add_parser(subparsers) -> None:
    """Add `import`, `train`, `publish` and `transfer`."""
    _add_import(subparsers)
    _add_train(subparsers)
    _add_publish(subparsers)
    transfer = add_command(
        subparsers, "transfer", description=TRANSFER_DESCRIPTION,
        help="evaluate a table model across the devices of an imported dataset: each held "
             "out in turn, model vs baselines (was `evaluate --dataset`)")
    transfer.add_argument("--dataset", required=True,
                          help="an imported dataset directory (tilecast import)")
    transfer.add_argument("--workdir", required=True)
    add_transfer_options(transfer)
    transfer.set_defaults(func=cmd_transfer)


def add_transfer_options(parser, *, hidden: bool = False) -> None:
    """The options of `transfer` besides --dataset and --workdir, all defaulting to None (so
    that `evaluate` can tell its deprecated spelling by them); `hidden` leaves them out of
    the help."""
    def shown(text: str) -> str:
        return argparse.SUPPRESS if hidden else text

    parser.add_argument("--split", help=shown(
        "leave-one-device-out (default): each device held out in turn; problems: problem "
        "folds held out on every device; sources: each imported file's problems held out in "
        "turn (an unseen workload)"))
    parser.add_argument("--devices", action="append", default=None, metavar="DEVICES.yaml",
                        help=shown("a hardware table adding to or replacing the shipped "
                                   "devices (repeatable)"))
    parser.add_argument("--rounds", type=int, help=shown("boosting rounds (default 300)"))
    parser.add_argument("--formulation", default=None, metavar="NAME",
                        help=shown("the model's formulation, as tilecast train --formulation"))
    parser.add_argument("--default", dest="default_config", metavar="KEY", help=shown(
        "a configuration to report as the 'default' baseline (e.g. a vendor library's "
        "choice), as name=value,..."))
    parser.add_argument("--threads", type=int, help=shown("training threads (default: all)"))


def _add_import(subparsers) -> None:
    from tilecast.table.formats import READERS

    imports = add_command(
        subparsers, "import",
        help="other tools' measurements (Kernel Tuner, AutoHeuristic, CK tile-engine "
             "CSVs, any table + mapping) -> a dataset directory",
        description="Read FILEs as --from's format, resolve each file's device in the hardware "
                    "table, and write DATASET_DIR (measurements.parquet + dataset.json) whole; "
                    "an existing dataset there gains the new rows (same columns). Bad input "
                    "writes nothing.")
    imports.add_argument("inputs", nargs="+", metavar="FILE")
    imports.add_argument("--from", dest="source", required=True, choices=tuple(READERS),
                         help="the files' format")
    imports.add_argument("--mapping", metavar="MAP.yaml",
                         help="--from table: which columns are problem, config, time (unit), "
                              "device, status")
    imports.add_argument("--device", metavar="NAME",
                         help="the device of files that name none (CK CSVs, AutoHeuristic, "
                              "an empty Kernel Tuner device_name)")
    imports.add_argument("--devices", action="append", default=[], metavar="DEVICES.yaml",
                         help="a hardware table adding to the shipped devices (repeatable)")
    imports.add_argument("--out", required=True, metavar="DATASET_DIR")
    imports.set_defaults(func=_cmd_import)


def _add_train(subparsers) -> None:
    train = add_command(
        subparsers, "train", help="train a table model on an imported dataset (tilecast import)",
        description="Train a model that chooses a configuration per problem and device from "
                    "an imported dataset, calibrate its confidence on out-of-fold picks and "
                    "write WORKDIR/models/table/; prints a one-line summary.")
    train.add_argument("--dataset", required=True, help="an imported dataset directory")
    train.add_argument("--workdir", required=True)
    train.add_argument("--devices", action="append", default=[], metavar="DEVICES.yaml",
                       help="a hardware table adding to or replacing the shipped devices "
                            "(repeatable)")
    train.add_argument("--exclude-device", action="append", default=None, metavar="NAME",
                       help="leave this device's measurements out (repeatable)")
    train.add_argument("--rounds", type=int, default=300, help="boosting rounds (default 300)")
    train.add_argument("--formulation", default=None, metavar="NAME",
                       help="efficiency (default: regression on each choice's efficiency), "
                            "log_efficiency, or lambdarank (each problem's choices ranked; "
                            "better within a device's problems, worse on a new workload: "
                            "docs/results.md)")
    train.add_argument("--threads", type=int, default=None, help="training threads (default 2)")
    train.set_defaults(func=_cmd_train)


def _add_publish(subparsers) -> None:
    publish = add_command(
        subparsers, "publish", help="publish WORKDIR/models/table/ to a registry, promoted if "
                                    "the gate passes")
    publish.add_argument("--workdir", required=True)
    publish.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    publish.add_argument("--model", required=True, help="the registry model name")
    publish.set_defaults(func=_cmd_publish)


def _cmd_import(args) -> int:
    from tilecast.table.importing import import_files

    paths = [user_file(path, "input") for path in args.inputs]
    mapping = user_file(args.mapping, "mapping", text=True) if args.mapping else None
    devices = [user_file(path, "devices file", text=True) for path in args.devices]
    out = user_dir(args.out, "--out", writable=True)
    summary = import_files(args.source, paths, out, mapping_path=mapping, device=args.device,
                           devices_files=devices)
    print(summary.line())
    return 0


def _cmd_train(args) -> int:
    from tilecast.table.train import train_table

    if args.rounds < 1:
        raise CliError(f"--rounds {args.rounds} must be a positive number of boosting rounds")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads {args.threads} must be a positive number")
    summary = train_table(user_dir(args.dataset, "dataset", must_exist=True),
                          user_dir(args.workdir, "workdir", writable=True),
                          devices_files=[user_file(path, "devices file", text=True)
                                         for path in args.devices],
                          exclude_devices=args.exclude_device or (), rounds=args.rounds,
                          **({"formulation": args.formulation} if args.formulation else {}),
                          threads=args.threads)
    print(summary.line())
    return 0


def _cmd_publish(args) -> int:
    from tilecast.table.train import publish_table

    workdir = user_dir(args.workdir, "workdir", must_exist=True)
    result = publish_table(workdir, registry_root(args.registry, must_exist=False), args.model)
    print(f"{args.model}: version {result.version} "
          f"{'promoted' if result.promoted else 'not promoted'} "
          f"(aliases {', '.join(result.aliases)}): {result.reason}")
    return 0


def cmd_transfer(args) -> int:
    """`tilecast transfer` (and the deprecated `tilecast evaluate --dataset`)."""
    from tilecast.table.dataset import read_dataset
    from tilecast.table.devices import DeviceTable
    from tilecast.table.transfer import run_transfer
    from tilecast.table.transfer_report import overall_line, write_report

    if args.rounds is not None and args.rounds < 1:
        raise CliError(f"--rounds {args.rounds} must be a positive number of boosting rounds")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads {args.threads} must be a positive number")
    dataset = read_dataset(user_dir(args.dataset, "dataset", must_exist=True))
    workdir = user_dir(args.workdir, "workdir", writable=True)
    extra = [user_file(path, "devices file", text=True) for path in args.devices or ()]
    devices = DeviceTable.load(extra=extra)
    options = {"rounds": args.rounds} if args.rounds is not None else {}
    result = run_transfer(dataset, devices, split=args.split or "leave-one-device-out",
                          threads=args.threads, default=args.default_config,
                          formulation=args.formulation, **options)
    for path in write_report(workdir, result):
        print(f"{args.command}: wrote {path}", file=sys.stderr)
    print(overall_line(result.report))
    return 0

