"""The command line's shape (tilecast.cli, tilecast.flows.cli): `--version`, `-v` before or
after the command, `run`'s default workdir from the config's name, every command's help.
Nothing is built or measured: `run --plain` has its stages replaced."""
from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from faults import REPO_ROOT, run_cli
from tilecast.cli import default_workdir
from tilecast.flows import cli as flows_cli
from tilecast.workflows import pipeline

TINY = REPO_ROOT / "tests" / "configs" / "tiny.yaml"


def test_version_prints_the_installed_version_and_the_commit():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    line = result.stdout.decode().strip()
    assert line.startswith(f"tilecast {importlib.metadata.version('tilecast')}")
    if (REPO_ROOT / ".git").exists():   # a checkout: the commit, as git_sha gives it
        from tilecast.core.artifact import git_sha

        assert line.endswith(f"(git {git_sha()[:12]})")


@pytest.mark.parametrize("argv", [
    ["-v", "config", "check", "x.yaml"],
    ["config", "-v", "check", "x.yaml"],
    ["config", "check", "x.yaml", "-v"],
    ["config", "check", "--verbose", "x.yaml"],
    ["run", "--plain", "-v"],
    ["-v", "run", "--verbose"],
    ["worker", "--pool", "p", "--verbose"],
])
def test_verbose_is_taken_before_or_after_the_command(argv):
    assert flows_cli.build_parser().parse_args(argv).verbose is True


@pytest.mark.parametrize("argv", [["config", "check", "x.yaml"], ["run"],
                                  ["worker", "--pool", "p", "--", "-v"]])
def test_verbose_is_off_unless_given(argv):
    """Off by default, also where a subcommand leaves the flag unset; a `-v` after `--` is
    the Prefect worker's, not ours."""
    assert flows_cli.build_parser().parse_args(argv).verbose is False


def test_verbose_after_the_command_shows_a_user_error_s_traceback(tmp_path):
    quiet = run_cli("config", "check", tmp_path / "nowhere.yaml")
    loud = run_cli("config", "check", tmp_path / "nowhere.yaml", "-v")
    for result in (quiet, loud):
        assert result.returncode == 2
        assert result.stderr.decode().strip().splitlines()[-1].startswith(
            "tilecast config: error: config ")
    assert "Traceback" not in quiet.stderr.decode()
    assert "Traceback" in loud.stderr.decode()


@pytest.mark.parametrize("config, workdir", [
    ("nightly", "work/nightly"),
    ("quick", "work/quick"),
    ("configs/repeat.yaml", "work/repeat"),
    ("/abs/path/mine.yml", "work/mine"),
    ("dir/plain", "work/plain"),
])
def test_default_workdir_is_work_slash_the_config_s_name(config, workdir):
    assert default_workdir(config) == workdir


def _plain_run(monkeypatch, argv: list[str]) -> list[Path]:
    """`tilecast run --plain ARGV` with the stages replaced: the workdirs it would run in."""
    seen = []
    monkeypatch.setattr(pipeline.RunContext, "create", classmethod(
        lambda cls, config, workdir, registry, **options: seen.append(Path(workdir))
        or SimpleNamespace(run_id="r")))
    monkeypatch.setattr(pipeline, "run_all", lambda ctx, device=None: {})
    assert flows_cli.main(["run", "--plain", *argv]) == 0
    return seen


def test_run_writes_to_the_workdir_named_after_its_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY, tmp_path / "mine.yaml")
    assert _plain_run(monkeypatch, ["--config", "nightly"]) == [Path("work/nightly")]
    assert _plain_run(monkeypatch, ["--config", str(TINY)]) == [Path("work/tiny")]
    assert _plain_run(monkeypatch, ["--config", "mine.yaml"]) == [Path("work/mine")]
    assert _plain_run(monkeypatch, []) == [Path("work/quick")]   # the default config, quick
    assert _plain_run(monkeypatch, ["--config", "nightly", "--workdir", "elsewhere"]) == \
        [Path("elsewhere")]


COMMANDS = ["select", "export", "import", "train", "publish", "transfer", "evaluate", "convert",
            "repeatability", "store", "plan", "replay", "registry", "rebench", "config",
            "config check", "config schema", "run", "fleet", "worker"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_verbose(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        flows_cli.main([*command.split(), "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tilecast {command}") and "-v, --verbose" in out


def test_the_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        flows_cli.main(["--help"])
    listing = capsys.readouterr().out.split("\n", 3)[:3]
    for command in COMMANDS:
        assert command.split()[0] in " ".join(listing)


def test_evaluate_help_points_to_transfer(capsys):
    with pytest.raises(SystemExit):
        flows_cli.main(["evaluate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "`evaluate --dataset` is now `tilecast transfer`" in text
    for hidden in ("--split", "--rounds", "--formulation", "--threads"):   # transfer's now
        assert hidden not in text
