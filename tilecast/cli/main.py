"""The parser built from each command group's `add_parser`, and `main`, which runs one command
behind the error boundary (tilecast.cli.errors)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from tilecast.cli import config, dispatch, evaluate, rebench, records, registry, store, table
from tilecast.cli.errors import one_line, user_errors
from tilecast.cli.options import VersionAction, add_verbose

log = logging.getLogger("tilecast.cli")

#: The library's command groups, in the order `tilecast --help` lists their commands. The
#: Prefect commands (run, fleet, worker) are added by tilecast.flows.cli.
GROUPS = (dispatch, table, evaluate, records, store, registry, rebench, config)

DESCRIPTION = ("learn, publish and dispatch the fastest kernel variant per problem shape; "
               "every command takes --help and -v")


def build_parser() -> argparse.ArgumentParser:
    """The parser with every library subcommand; callers may add more (`subparsers`)."""
    parser = argparse.ArgumentParser(prog="tilecast", description=DESCRIPTION)
    add_verbose(parser, top=True)
    parser.add_argument("--version", action=VersionAction)
    commands = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parser(commands)
    return parser


def subparsers(parser: argparse.ArgumentParser):
    """The subcommands action of a parser from build_parser, to add commands to."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Run one command; a user error (USER_ERRORS) is one line on stderr and exit status 2."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    for chatty in ("httpx", "httpcore"):  # one line per API call of the embedded server
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except user_errors() as err:  # the tuple is made only when an error arrives here
        log.debug("the error's traceback (a user error: shown with --verbose only)",
                  exc_info=True)
        print(f"tilecast {args.command}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout left (`tilecast config schema | head`): no traceback, and no
        # second one when Python flushes stdout at exit; the status a shell gives SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
