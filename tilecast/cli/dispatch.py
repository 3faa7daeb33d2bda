"""`tilecast select` and `tilecast export`: what a published model chooses, in Python or as C."""
from __future__ import annotations

import json
from pathlib import Path

from tilecast.cli.errors import CliError
from tilecast.cli.options import REGISTRY_HELP, add_command
from tilecast.cli.paths import registry_root, user_dir


def add_parser(subparsers) -> None:
    """Add `select` and `export`."""
    _add_select(subparsers)
    _add_export(subparsers)


def _add_select(subparsers) -> None:
    select = add_command(subparsers, "select",
                         help="print the kernel the published model chooses")
    select.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    select.add_argument("--model", required=True)
    select.add_argument("--alias", default="production")
    select.add_argument("--problem", required=True, help="e.g. 'm=512,n=512,k=512'")
    select.add_argument("--json", action="store_true")
    select.add_argument("--shortlist", type=int, default=None, metavar="K",
                        help="score only the (at most K) candidates of the version's "
                             "shortlist leaf for the problem (see tilecast.runtime.shortlist)")
    select.add_argument("--device", default=None,
                        help="table models: the device to choose for (a name or label of the "
                             "hardware table; default: the model's only training device)")
    select.add_argument("--candidates", default=None, metavar="KEYS",
                        help="table models: rank only these configurations, the ones offered "
                             "for this problem: keys separated by ';' (a one-column "
                             "configuration's bare values will do) or @FILE, one a line")
    select.set_defaults(func=_cmd_select)


def _add_export(subparsers) -> None:
    export = add_command(
        subparsers, "export",
        help="write a published model as a C selector (or JSON) that picks what "
             "`tilecast select` picks, without Python",
        description="Write version V (or the version --alias names) of model M as "
                    "tilecast_<model>.h + tilecast_<model>.c (--format c: a function "
                    "tilecast_<model>_select(problem fields) returning a kernel index, and a "
                    "name lookup) or tilecast_<model>.json (--format json: the same tables "
                    "for other runtimes). The version's checksums are verified first. "
                    "Families: gemm, grouped_conv_forward, grouped_conv_bwd_data, "
                    "grouped_conv_bwd_weight, and table models (tilecast train --dataset), "
                    "one device per export (--device): tilecast_<model>_<device>.h + .c, "
                    "tilecast_<model>_<device>_select(problem columns) picking what "
                    "`tilecast select --device` picks.")
    export.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    export.add_argument("--model", required=True)
    which = export.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, default=None, help="a version number")
    which.add_argument("--alias", default="production", help="an alias (default production)")
    export.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    export.add_argument("--format", choices=("c", "json"), default="c")
    export.add_argument("--shortlist", type=int, default=None, metavar="K",
                        help="score only the (at most K) candidates of the version's "
                             "shortlist leaf, as `tilecast select --shortlist K` does: a "
                             "query costs trees x K instead of trees x candidates (the "
                             "version's evaluation says what each K costs in efficiency)")
    export.add_argument("--device", default=None,
                        help="table models: the device to export the selector of (a name or "
                             "label the model or the hardware tables know; default: the "
                             "model's only training device)")
    export.set_defaults(func=_cmd_export)


def _cmd_select(args) -> int:
    from tilecast.runtime.dispatch import Dispatcher, parse_problem_string

    parse_problem_string(args.problem)  # a malformed string fails before the model is loaded
    shortlist = _shortlist_size(args.shortlist)
    dispatcher = Dispatcher.from_registry(registry_root(args.registry), args.model, args.alias,
                                          **({"shortlist": shortlist} if shortlist else {}))
    # only some kinds answer per device (tilecast.core.kinds)
    per_device = dispatcher.kind.per_device
    if args.device is not None and not per_device:
        raise CliError(f"--device {args.device}: model {args.model!r} is a "
                       f"{dispatcher.family.name} model, which chooses for the machine it was "
                       "trained on; --device is for table models (tilecast train --dataset)")
    if args.candidates is not None and not per_device:
        raise CliError(f"--candidates: model {args.model!r} is a {dispatcher.family.name} "
                       "model, which ranks its own kernels; --candidates is for table models")
    options = {"device": args.device} if per_device else {}
    if args.candidates is not None:
        options["candidates"] = _candidates(args.candidates)
    if args.json:
        print(json.dumps(dispatcher.select_json(args.problem, **options)))
    else:
        print(dispatcher.select(args.problem, **options))
    return 0


def _candidates(text: str) -> list[str]:
    """--candidates: configuration keys separated by ';', or @FILE with one key a line."""
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            lines = path.read_text().splitlines()
        except OSError as err:
            raise CliError(f"--candidates {text}: cannot read {path}: "
                           f"{err.strerror or err}") from None
    else:
        lines = text.split(";")
    keys = [line.strip() for line in lines if line.strip()]
    if not keys:
        raise CliError(f"--candidates {text!r} names no configuration")
    return keys


def _shortlist_size(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise CliError(f"--shortlist {value} must be a number of kernels >= 1")
    return value


def _cmd_export(args) -> int:
    from tilecast.runtime import export

    out = user_dir(args.out, "--out", writable=True)
    alias = args.version if args.version is not None else args.alias
    selector = export.load(registry_root(args.registry), args.model, alias,
                           shortlist=_shortlist_size(args.shortlist), device=args.device)
    paths = export.write(selector, out, args.format)
    if isinstance(selector, export.TableSelector):
        print(f"{args.model} version {selector.version} for {selector.device}: "
              f"{len(selector.allowed)} of {len(selector.kernels)} configurations allowed, "
              f"{sum(len(f.roots) for f in selector.forests)} trees -> "
              + ", ".join(str(path) for path in paths))
        return 0
    shortlist = "" if selector.shortlist is None else \
        f", a shortlist of {args.shortlist} ({len(selector.shortlist_rows)} leaves)"
    print(f"{args.model} version {selector.version}: {selector.candidates} candidates, "
          f"{len(selector.forest.roots)} trees, {len(selector.forest.slot)} splits{shortlist} -> "
          + ", ".join(str(path) for path in paths))
    return 0
