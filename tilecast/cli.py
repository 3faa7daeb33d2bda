"""The `tilecast` command line: library subcommands (no Prefect). `flows.cli` adds `run`."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tilecast.core.config import ConfigError
from tilecast.core.dataset import DatasetError
from tilecast.families.base import FamilyError
from tilecast.registry import api as registry
from tilecast.runtime.dispatch import Dispatcher, parse_problem_string
from tilecast.stages import layout
from tilecast.stages.convert import convert_raw
from tilecast.stages.convert_ck import convert_ck_csv
from tilecast.stages.train import ModelArtifactError
from tilecast.workflows.rebench import RebenchError, rebench
from tilecast.workflows.repeatability import report
from tilecast.workflows.user_eval import dump, evaluate_published, summary_line


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _cmd_select(args) -> int:
    dispatcher = Dispatcher.from_registry(args.registry, args.model, args.alias)
    problem = parse_problem_string(args.problem)
    if args.json:
        print(json.dumps(dispatcher.select_json(problem)))
    else:
        print(dispatcher.select(problem))
    return 0


def _cmd_convert(args) -> int:
    inputs = [Path(p) for p in args.inputs]
    if args.source == "ck-csv":
        summary = convert_ck_csv(inputs, Path(args.out), problem_set=args.problem_set)
    else:
        summary = convert_raw(inputs, Path(args.out))
    print(f"wrote {summary.out_path}: {summary.rows} rows, {summary.problems} problems, "
          f"{summary.kernels} kernels, statuses {summary.statuses}")
    return 0


def _version_summary(root, model: str, version: int) -> dict:
    """What `registry list/show` print for one version: headline metrics, promotion, lineage."""
    path = registry.version_path(root, model, version)
    summary: dict = {"version": version, "path": str(path)}
    for name, keys in ((registry.METRICS_FILE, ("mean_efficiency", "median_efficiency",
                                                 "p10_efficiency", "top1", "top5", "n_problems")),
                       (registry.PROMOTION_FILE, ("promoted", "reason", "published_at")),
                       (layout.MANIFEST_FILE, ("created", "git_sha", "data_hash", "rows",
                                               "lineage"))):
        try:
            document = json.loads(registry.read_version_file(root, model, version, name))
        except (registry.RegistryError, ValueError) as err:
            summary[name] = f"unreadable: {err}"
            continue
        summary.update({k: document[k] for k in keys if k in document})
    return summary


def _cmd_repeatability(args) -> int:
    print(report(args.runs[0], args.runs[1], args.family, args.tie_threshold_pct))
    return 0


def _cmd_registry(args) -> int:
    root = args.registry
    if args.action == "list":
        models = [args.model] if args.model else registry.list_models(root)
        if not models:
            raise CliError(f"registry {root} holds no model")
        for model in models:
            aliases = registry.list_aliases(root, model)
            print(f"{model}: versions {registry.list_versions(root, model) or 'none'}; aliases "
                  + (", ".join(f"{a} -> {v}" for a, v in aliases.items()) or "none"))
        return 0
    if not args.model:
        raise CliError(f"registry {args.action} needs MODEL")
    if args.action == "show":
        number = registry.resolve_version(root, args.model, args.version or args.alias)
        aliases = [a for a, v in registry.list_aliases(root, args.model).items() if v == number]
        print(json.dumps({"model": args.model, "aliases": aliases,
                          **_version_summary(root, args.model, number)}, indent=2))
        return 0
    if args.action == "promote":
        if not args.version:
            raise CliError("registry promote needs VERSION")
        previous = registry.promote(root, args.model, args.version, args.alias)
        print(f"{args.model}: alias {args.alias} -> version {int(args.version)} "
              f"(was {previous if previous is not None else 'unset'})")
        return 0
    version = registry.rollback(root, args.model, args.alias)
    print(f"{args.model}: alias {args.alias} rolled back to version {version}")
    return 0


def _cmd_evaluate(args) -> int:
    metrics = evaluate_published(args.registry, args.model, args.problems, args.workdir,
                                 alias=args.alias, config=args.config)
    print(dump(metrics))
    print(summary_line(metrics), file=sys.stderr)
    return 0


def _cmd_rebench(args) -> int:
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    if args.families is not None and not families:
        raise CliError(f"--families {args.families!r} names no family; e.g. --families gemm")
    result = rebench(args.config, args.workdir, args.history, families=families,
                     problems=args.problems, git_ref=args.git_ref, repo=args.repo,
                     alpha=args.alpha, min_effect=args.min_effect, samples=args.samples)
    print(result.markdown)
    for family, path in result.reports.items():
        print(f"rebench {family}: report {path}", file=sys.stderr)
    return result.exit_status


REBENCH_EPILOG = """\
exit status:
  0  nothing regressed (also a first run, which has no baseline yet)
  1  regression(s) found: a kernel slower on its problems, or broken where it worked
  2  usage error or bad input (unknown family or problem, bad git ref, unreadable history)
  3  not comparable: the hardware differs from the baseline's, or no pair was measured
     validly in both runs (1 wins when another family regressed)

A verdict needs a significant test (Mann-Whitney U per kernel and problem, Wilcoxon
signed-rank per kernel across problems, Benjamini-Hochberg q <= ALPHA) and a practical
effect (a time ratio of at least 1 + MIN_EFFECT, or at most 1 / (1 + MIN_EFFECT)).
"""


REGISTRY_HELP = ("a directory (default ./registry) or an fsspec URL such as s3://bucket/prefix; "
                 "S3 credentials and endpoint come from the environment (AWS_*)")


def build_parser() -> argparse.ArgumentParser:
    """The parser with every library subcommand; callers may add more."""
    parser = argparse.ArgumentParser(prog="tilecast", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    select = sub.add_parser("select", help="print the kernel the published model chooses")
    select.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    select.add_argument("--model", required=True)
    select.add_argument("--alias", default="production")
    select.add_argument("--problem", required=True, help="e.g. 'm=512,n=512,k=512'")
    select.add_argument("--json", action="store_true")
    select.set_defaults(func=_cmd_select)

    convert = sub.add_parser("convert", help="raw benchmark records (JSONL) or CK tile-engine "
                                             "CSVs -> parquet")
    convert.add_argument("inputs", nargs="+")
    convert.add_argument("--out", required=True)
    convert.add_argument("--from", dest="source", choices=("raw", "ck-csv"), default="raw",
                         help="input format: tilecast raw JSONL (default) or CK tile-engine CSV")
    convert.add_argument("--problem-set", default="train", choices=("train", "holdout"),
                         help="problem set of ck-csv rows (default train)")
    convert.set_defaults(func=_cmd_convert)

    evaluate = sub.add_parser("evaluate", help="measure the oracle on your own problems and "
                                                "score the published model's choices on them")
    evaluate.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    evaluate.add_argument("--model", required=True)
    evaluate.add_argument("--alias", default="production", help="alias or version number")
    evaluate.add_argument("--problems", required=True,
                          help="YAML/JSON file: 'problems:' + list / grid / random entries")
    evaluate.add_argument("--workdir", required=True)
    evaluate.add_argument("--config", default="quick",
                          help="config whose measurement protocol is used (default quick)")
    evaluate.set_defaults(func=_cmd_evaluate)

    repeat = sub.add_parser(
        "repeatability", help="how well two runs of one config agree: one run's winners "
                              "scored on the other, per problem set and runtime bin",
        description="Each run is a workdir (its data/<family>.parquet) or a converted parquet "
                    "file. Prints, both ways, the mean / P10 / min efficiency of one run's "
                    "winners measured in the other, the share of winners in the other's "
                    "practical-tie set and within 2 %% of its best: the ceiling any model's "
                    "figures are judged under.")
    repeat.add_argument("runs", nargs=2, metavar="RUN")
    repeat.add_argument("--family", default="gemm")
    repeat.add_argument("--tie-threshold-pct", type=float, default=1.0)
    repeat.set_defaults(func=_cmd_repeatability)

    reg = sub.add_parser("registry", help="list, show, promote or roll back model versions")
    reg.add_argument("action", choices=("list", "show", "promote", "rollback"))
    reg.add_argument("model", nargs="?", help="model name (all models for list)")
    reg.add_argument("version", nargs="?", help="version number (show, promote)")
    reg.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    reg.add_argument("--alias", default="production",
                     help="alias to show, move or roll back (default production)")
    reg.set_defaults(func=_cmd_registry)

    rebench = sub.add_parser(
        "rebench", help="re-measure the sentinel problems with every kernel and report "
                        "regressions against the previous rebenchmark",
        description="Build every candidate kernel of the config, measure it on each family's "
                    "sentinel problems, store the run in the history and compare it with the "
                    "previous run there. Writes WORKDIR/report/rebench_<family>.json and "
                    "WORKDIR/report/rebench.md; prints the markdown.",
        epilog=REBENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    rebench.add_argument("--config", default="quick", help="a YAML path or a name in configs/")
    rebench.add_argument("--workdir", required=True)
    rebench.add_argument("--history", required=True,
                         help="directory of past rebenchmarks (<family>/<run_id>.jsonl, latest.json)")
    rebench.add_argument("--families", default=None,
                         help="comma-separated families (default: every family of the config)")
    rebench.add_argument("--problems", nargs="+", default=None, metavar="P",
                         help="only these sentinel problems: dims keys or 'm=40,n=70,k=90'")
    rebench.add_argument("--git-ref", default=None,
                         help="build the kernels from this commit instead of the working tree")
    rebench.add_argument("--repo", default=None,
                         help="repository of --git-ref (default: this project's)")
    rebench.add_argument("--alpha", type=float, default=0.01,
                         help="false discovery rate of the tests (default 0.01)")
    rebench.add_argument("--min-effect", type=float, default=0.05,
                         help="smallest change that counts, as a fraction (default 0.05 = 5%%)")
    rebench.add_argument("--samples", type=int, default=None,
                         help="samples per kernel and problem (default: the protocol's, raised "
                              "to what the tests need)")
    rebench.set_defaults(func=_cmd_rebench)
    return parser


# Errors a user can cause: printed as a message, never as a traceback.
USER_ERRORS = (CliError, ConfigError, DatasetError, FamilyError, FileNotFoundError,
               ModelArtifactError, RebenchError, registry.RegistryError)


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    for chatty in ("httpx", "httpcore"):  # one line per API call of the embedded server
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        print(f"tilecast {args.command}: error: {err}", file=sys.stderr)
        return 2
