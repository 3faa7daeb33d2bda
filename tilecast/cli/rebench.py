"""`tilecast rebench`: re-measure the sentinel problems with every kernel and report the
regressions against the previous rebenchmark (tilecast.workflows.rebench, .regression)."""
from __future__ import annotations

import argparse
import sys

from tilecast.cli.errors import CliError
from tilecast.cli.options import CONFIG_HELP, add_command
from tilecast.cli.paths import config_arg, user_dir

#: The tests named as tilecast.workflows.regression computes them (`test` of each pair and
#: kernel in the report: welch-log-rounds, mann-whitney, welch-log-rounds-by-problem,
#: wilcoxon-problems).
REBENCH_EPILOG = """\
exit status:
  0  nothing regressed (also a first run, which has no baseline yet)
  1  regression(s) found: a kernel slower on its problems, or broken where it worked
  2  usage error or bad input (unknown family or problem, bad git ref, unreadable history)
  3  not comparable: the hardware differs from the baseline's, or no pair was measured
     validly in both runs (1 wins when another family regressed)

A verdict needs a significant test and a practical effect. The tests: per kernel and problem,
a two-sided Welch t-test on the logs of the two runs' per-round medians (each round is a
process of its own; records without rounds fall back to a Mann-Whitney U test on their
samples); per kernel, a Welch test on the logs of its per-round medians stratified by problem
(each problem's difference of mean logs, averaged over its problems; where records have no
rounds, a Wilcoxon signed-rank test on the logs of its time ratios across problems); every
test of a run corrected with Benjamini-Hochberg, significant at q <= ALPHA.
The effect: a time ratio of at least 1 + MIN_EFFECT, or at most 1 / (1 + MIN_EFFECT).
"""


def add_parser(subparsers) -> None:
    """Add `rebench`."""
    rebench = add_command(
        subparsers, "rebench", help="re-measure the sentinel problems with every kernel and "
                                    "report regressions against the previous rebenchmark",
        description="Build every candidate kernel of the config, measure it on each family's "
                    "sentinel problems, store the run in the history and compare it with the "
                    "previous run there. Writes WORKDIR/report/rebench_<family>.json and "
                    "WORKDIR/report/rebench.md; prints the markdown.",
        epilog=REBENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    rebench.add_argument("--config", default="quick", help=CONFIG_HELP)
    rebench.add_argument("--workdir", required=True)
    rebench.add_argument("--history", required=True,
                         help="directory of past rebenchmarks (<family>/<run_id>.jsonl, "
                              "latest.json)")
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


def _cmd_rebench(args) -> int:
    from tilecast.workflows.rebench import rebench

    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    if args.families is not None and not families:
        raise CliError(f"--families {args.families!r} names no family; e.g. --families gemm")
    result = rebench(config_arg(args.config), user_dir(args.workdir, "workdir", writable=True),
                     user_dir(args.history, "history", writable=True), families=families,
                     problems=args.problems, git_ref=args.git_ref, repo=args.repo,
                     alpha=args.alpha, min_effect=args.min_effect, samples=args.samples)
    print(result.markdown)
    for family, path in result.reports.items():
        print(f"rebench {family}: report {path}", file=sys.stderr)
    return result.exit_status

