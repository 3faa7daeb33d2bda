"""`tilecast config check` and `tilecast config schema`: a run config checked without running
anything, and the JSON Schema configs follow."""
from __future__ import annotations

import json
from pathlib import Path

from tilecast.cli.options import CONFIG_HELP, add_command
from tilecast.cli.paths import config_arg


def add_parser(subparsers) -> None:
    """Add `config` and its actions `check` and `schema`."""
    config = add_command(subparsers, "config",
                         help="check a run config without running anything, or print the JSON "
                              "Schema configs follow")
    actions = config.add_subparsers(dest="action", metavar="{check,schema}", required=True)
    check = add_command(actions, "check",
                        help="validate FILE: 'ok: ...' and a one-line summary, or the first "
                             "error (exit status 2)")
    check.add_argument("file", metavar="FILE", help=CONFIG_HELP)
    check.set_defaults(func=_cmd_config_check)
    schema = add_command(actions, "schema", help="print the JSON Schema of a run config")
    schema.set_defaults(func=_cmd_config_schema)


def _config_summary(config) -> str:
    """One line on a valid config: its name and each family's problems per set."""
    families = "; ".join(
        f"{name} " + " + ".join(f"{len(problems)} {problem_set}"
                                for problem_set, problems in family.problems.items())
        + " problems" for name, family in config.families.items())
    count = len(config.families)
    return (f"{config.path}: config {config.name!r}, {count} "
            f"{'family' if count == 1 else 'families'} ({families})")


def _cmd_config_check(args) -> int:
    # the schema module is imported only by the command that needs it
    from tilecast.config import check_config_file

    config = check_config_file(Path(config_arg(args.file)))
    print(f"ok: {_config_summary(config)}")
    return 0


def _cmd_config_schema(args) -> int:
    from tilecast.config.schema import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return 0

