"""What every command shares: `-v` wherever it is typed, `--version`, the common help texts."""
from __future__ import annotations

import argparse

REGISTRY_HELP = ("a directory (default ./registry) or an fsspec URL such as s3://bucket/prefix; "
                 "S3 credentials and endpoint come from the environment (AWS_*)")
CONFIG_HELP = "a YAML path, or the name of a shipped config (tiny, quick, nightly, ...)"
VERBOSE_HELP = "debug logging (and the traceback behind an error message)"


def add_verbose(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """-v/--verbose on `parser`. On a subcommand its default is SUPPRESS: a subcommand's
    namespace is copied over the top level's, and an unset flag there must not overwrite a
    `-v` typed before the subcommand."""
    parser.add_argument("-v", "--verbose", action="store_true",
                        default=False if top else argparse.SUPPRESS, help=VERBOSE_HELP)


def add_command(subparsers, name: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand of `subparsers` that takes -v like every other (before or after its name)."""
    command = subparsers.add_parser(name, **kwargs)
    add_verbose(command)
    return command


def version_line() -> str:
    """`tilecast <version>`, and the commit when this code runs from a git checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("tilecast")
    except PackageNotFoundError:   # run from a tree that was never installed
        from tilecast import __version__ as installed
    from tilecast.core.artifact import git_sha   # ~0.4 s: only when --version is asked for

    sha = git_sha()
    return f"tilecast {installed}" + ("" if sha == "unknown" else f" (git {sha[:12]})")


class VersionAction(argparse.Action):
    """--version: prints version_line and exits; the version is looked up only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print tilecast's version (and commit, in a checkout) and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())   # on stdout, as argparse's own version action prints
        parser.exit()
