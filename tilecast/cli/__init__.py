"""The `tilecast` command line: library subcommands (no Prefect). `tilecast.flows.cli` adds
`run`, `fleet` and `worker`, and is the console script.

One module per command group, each with an `add_parser(subparsers)`: dispatch (select,
export), table (import, train, publish, transfer), evaluate, records (convert,
repeatability), store (store, plan, replay), registry, rebench, config; `main` builds the
parser from them and runs one command.

Every error a user can cause ends the command with one line on stderr, `tilecast <command>:
error: <message>`, and exit status 2; any other exception is a bug and keeps its traceback.
The errors a user can cause are the classes of USER_ERRORS (tilecast.cli.errors), raised
where input is parsed or read; the paths given on the command line are checked first
(tilecast.cli.paths), so that a missing, unreadable or binary file, or a directory given as a
file, is named before any work starts. Subcommands import what they run when they run it:
a mistyped command fails in a fraction of a second.
"""
from tilecast.cli.errors import USER_ERRORS, CliError, one_line, user_errors
from tilecast.cli.main import build_parser, main, subparsers
from tilecast.cli.options import CONFIG_HELP, REGISTRY_HELP, add_command
from tilecast.cli.paths import (config_arg, default_workdir, registry_root, user_dir, user_file,
                                user_output)

__all__ = ["CONFIG_HELP", "CliError", "REGISTRY_HELP", "USER_ERRORS", "add_command",
           "build_parser", "config_arg", "default_workdir", "main", "one_line", "registry_root",
           "subparsers", "user_dir", "user_errors", "user_file", "user_output"]
