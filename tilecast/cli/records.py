"""`tilecast convert` and `tilecast repeatability`: a run's records as parquet, and how far
two runs (or two stores' series of nights) of one config agree."""
from __future__ import annotations

from pathlib import Path

from tilecast.cli.errors import CliError
from tilecast.cli.options import add_command
from tilecast.cli.paths import user_file, user_output


def add_parser(subparsers) -> None:
    """Add `convert` and `repeatability`."""
    convert = add_command(subparsers, "convert",
                          help="raw benchmark records (JSONL), a team's own records (JSONL or "
                               "CSV) or CK tile-engine CSVs -> parquet")
    convert.add_argument("inputs", nargs="+")
    convert.add_argument("--out", required=True)
    convert.add_argument("--from", dest="source", choices=("raw", "records", "ck-csv"),
                         default="raw",
                         help="input format: tilecast's raw JSONL (default); `records`: a "
                              "team's own measurements, JSONL or CSV in the schema of "
                              "docs/guide/records.md, checked row by row; or CK tile-engine CSV")
    convert.add_argument("--problem-set", default="train", choices=("train", "holdout"),
                         help="problem set of ck-csv rows (default train)")
    convert.set_defaults(func=_cmd_convert)

    repeat = add_command(
        subparsers, "repeatability",
        help="how well two runs of one config agree: one run's winners scored on the other, "
             "per problem set and runtime bin",
        description="Each run is a workdir (its data/<family>.parquet) or a converted parquet "
                    "file. Prints, both ways, the mean / P10 / min efficiency of one run's "
                    "winners measured in the other, the share of winners in the other's "
                    "practical-tie set and within 2 %% of its best: the ceiling any model's "
                    "figures are judged under.")
    repeat.add_argument("runs", nargs=2, metavar="RUN")
    repeat.add_argument("--family", default="gemm")
    repeat.add_argument("--tie-threshold-pct", type=float, default=1.0)
    repeat.add_argument("--nights", type=int, default=None,
                        help="two stores: print K = 1 .. this many nights (default: all both have)")
    repeat.add_argument("--hardware-class", default=None,
                        help="two stores: the class to compare (default: the one both hold)")
    repeat.set_defaults(func=_cmd_repeatability)


def _cmd_convert(args) -> int:
    inputs = [user_file(p, "input", text=True) for p in args.inputs]
    out = user_output(args.out, "--out")
    if args.source == "ck-csv":
        from tilecast.stages.convert_ck import convert_ck_csv

        summary = convert_ck_csv(inputs, out, problem_set=args.problem_set)
    elif args.source == "records":
        from tilecast.stages.convert import convert_records

        summary = convert_records(inputs, out)
    else:
        from tilecast.stages.convert import convert_raw

        summary = convert_raw(inputs, out)
    print(f"wrote {summary.out_path}: {summary.rows} rows, {summary.problems} problems, "
          f"{summary.kernels} kernels, statuses {summary.statuses}")
    return 0


def _cmd_repeatability(args) -> int:
    from tilecast.workflows.repeatability import is_store, report, store_report

    if not 0.0 <= args.tie_threshold_pct < 100.0:
        raise CliError(f"--tie-threshold-pct {args.tie_threshold_pct:g} must be a percentage "
                       "from 0 to 100, e.g. 1")
    stores = [is_store(run) for run in args.runs]
    if any(stores):
        if not all(stores):
            raise CliError("compare two stores (two series of nights) or two runs, not one "
                           f"of each: {args.runs[stores.index(False)]} is not a store")
        if args.nights is not None and args.nights < 1:
            raise CliError(f"--nights {args.nights} must be at least 1")
        print(store_report(args.runs[0], args.runs[1], args.family, args.tie_threshold_pct,
                           args.hardware_class, args.nights))
        return 0
    for run in args.runs:
        path = Path(run)
        if not path.is_dir():
            with user_file(path, "run").open("rb") as handle:
                if handle.read(4) != b"PAR1":
                    raise CliError(f"run {path} is neither a workdir, a store nor a parquet "
                                   "dataset (`tilecast convert` writes one)")
    print(report(args.runs[0], args.runs[1], args.family, args.tie_threshold_pct))
    return 0

