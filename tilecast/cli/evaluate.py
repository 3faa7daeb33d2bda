"""`tilecast evaluate`: measure the oracle on your own problems and score a published model's
choices on them. Its old second mode, `evaluate --dataset`, is `tilecast transfer` now; the
old spelling still runs it, after a one-line deprecation notice on stderr."""
from __future__ import annotations

import sys

from tilecast.cli.errors import CliError
from tilecast.cli.options import CONFIG_HELP, REGISTRY_HELP, add_command
from tilecast.cli.paths import config_arg, registry_root, user_dir, user_file
from tilecast.cli.table import add_transfer_options, cmd_transfer

#: The options of each spelling (argparse dests; None = not given): the command's own, and
#: the deprecated `evaluate --dataset` that `transfer` replaced.
EVALUATE_MODES = {"--model": ("model", "problems", "registry", "alias", "config"),
                  "--dataset": ("dataset", "split", "devices", "rounds", "default_config",
                                "threads", "formulation")}
EVALUATE_USAGE = ("give --model M --problems FILE (score a published model on your own "
                  "problems); to evaluate a table model across devices, use `tilecast "
                  "transfer --dataset DIR`")
DEPRECATED = ("tilecast evaluate: --dataset is deprecated and will be removed; use `tilecast "
              "transfer --dataset ...` (same options)")


def add_parser(subparsers) -> None:
    """Add `evaluate` (with the deprecated --dataset spelling's options, hidden)."""
    evaluate = add_command(
        subparsers, "evaluate", help="measure the oracle on your own problems and score the "
                                     "published model's choices on them",
        description="Measure every candidate of the published model --model on the problems "
                    "of --problems and score its choices against the measured best. "
                    "(`evaluate --dataset` is now `tilecast transfer`.)")
    evaluate.add_argument("--registry", default=None, help=REGISTRY_HELP)
    evaluate.add_argument("--model")
    evaluate.add_argument("--alias", default=None,
                          help="alias or version number (default production)")
    evaluate.add_argument("--problems",
                          help="YAML/JSON file: 'problems:' + list / grid / random entries")
    evaluate.add_argument("--workdir", required=True)
    evaluate.add_argument("--config", default=None,
                          help="config whose measurement protocol is used (default quick; "
                               + CONFIG_HELP + ")")
    evaluate.add_argument("--dataset", help="deprecated: use `tilecast transfer --dataset`")
    add_transfer_options(evaluate, hidden=True)
    evaluate.set_defaults(func=_cmd_evaluate)


def _option(dest: str) -> str:
    return "--" + {"default_config": "default"}.get(dest, dest)


def _evaluate_mode(args) -> str:
    """'--model' or '--dataset' (the deprecated spelling): the one the given options belong
    to; CliError when they mix the two or lack what their spelling needs."""
    given = {mode: [d for d in dests if getattr(args, d) is not None]
             for mode, dests in EVALUATE_MODES.items()}
    if given["--model"] and given["--dataset"]:
        raise CliError(f"{', '.join(map(_option, given['--model']))} and "
                       f"{', '.join(map(_option, given['--dataset']))} belong to different "
                       f"modes of evaluate; {EVALUATE_USAGE}, not both")
    if given["--dataset"]:
        if args.dataset is None:
            raise CliError(f"{', '.join(map(_option, given['--dataset']))} need(s) --dataset "
                           "DIR (an imported dataset to evaluate across devices; "
                           "`tilecast transfer --dataset DIR` is the command for it)")
        return "--dataset"
    missing = [_option(d) for d in ("model", "problems") if getattr(args, d) is None]
    if missing:
        raise CliError(f"{' and '.join(missing)} missing; {EVALUATE_USAGE}")
    return "--model"


def _cmd_evaluate(args) -> int:
    """Score the published model on the user's problems; the old --dataset spelling runs
    `transfer` after saying so."""
    if _evaluate_mode(args) == "--dataset":
        print(DEPRECATED, file=sys.stderr)
        return cmd_transfer(args)
    from tilecast.workflows.user_eval import dump, evaluate_published, summary_line

    user_file(args.problems, "problems file", text=True)
    metrics = evaluate_published(registry_root(args.registry or "registry"), args.model,
                                 args.problems, user_dir(args.workdir, "workdir", writable=True),
                                 alias=args.alias or "production",
                                 config=config_arg(args.config or "quick"))
    print(dump(metrics))
    print(summary_line(metrics), file=sys.stderr)
    return 0
