"""Progress of the build and benchmark tasks (tilecast.tasks.progress): a bar on a terminal
that follows the stage's steps and ends full, the stage's own log lines unchanged beside it
and alone elsewhere, and, in a real `tilecast run`, one progress artifact per stage and
family, at 100 % when the run ends."""
from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tilecast.tasks.progress import StageProgress, artifact_key

REPO = Path(__file__).resolve().parents[1]
TINY = Path(__file__).parent / "configs" / "tiny.yaml"
CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal(is_terminal: bool = True) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=is_terminal, width=80, color_system=None), out


def _screen(out: io.StringIO) -> list[str]:
    """The lines of the last frame drawn: the text after the last cursor movement."""
    frames = CONTROL.split(out.getvalue())
    last = next(frame for frame in reversed(frames) if frame.strip())
    return [line.strip() for line in re.split(r"[\r\n]", last) if line.strip()]


def test_a_terminal_bar_follows_the_steps_and_ends_full(caplog):
    caplog.set_level(logging.INFO, logger="tilecast")
    console, out = _terminal()
    with StageProgress("build", "gemm", console=console) as progress:
        progress(1, 4, "build 1/4 gemm_a cached")
        [line] = _screen(out)
        assert line.startswith("build gemm") and "1/4" in line and line.endswith("25%")
        progress(2, 4, "build 2/4 gemm_b 1.5s")
        [line] = _screen(out)
        assert "2/4" in line and line.endswith("50%")
    # returned: every step counts as done
    [final] = _screen(out)
    assert "4/4" in final and final.endswith("100%")
    # the stage's log lines, exactly as its default progress writes them
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("tilecast.core.build", "build 1/4 gemm_a cached"),
        ("tilecast.core.build", "build 2/4 gemm_b 1.5s")]


def test_a_stage_that_fails_leaves_its_bar_where_it_was():
    console, out = _terminal()
    with pytest.raises(RuntimeError, match="compiler gone"):
        with StageProgress("bench", "gemm", console=console) as progress:
            progress(1, 3, "bench gemm: batch 1/2 done")
            raise RuntimeError("compiler gone")
    [final] = _screen(out)
    assert "1/3" in final and final.endswith("33%")


def test_stages_running_at_once_share_one_display():
    # rich allows one live display per console: a second one would raise LiveError
    console, out = _terminal()
    with StageProgress("build", "gemm", console=console) as gemm:
        with StageProgress("build", "grouped_conv", console=console) as conv:
            conv(1, 2, "build 1/2 conv_a cached")
            gemm(3, 5, "build 3/5 gemm_c cached")
            assert len(_screen(out)) == 2
    screen = _screen(out)
    assert [line.split()[:2] for line in screen] == [["build", "gemm"], ["build", "grouped_conv"]]
    assert "5/5" in screen[0] and "2/2" in screen[1]
    with StageProgress("bench", "gemm", console=console) as again:  # the display was released
        again(1, 1, "bench gemm: batch 1/1 done")


def test_log_lines_print_above_the_bars_while_they_show(caplog):
    # `tilecast run`'s console handler writes to the terminal the bars are drawn on
    caplog.set_level(logging.INFO, logger="tilecast")
    console, out = _terminal()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("tilecast.core.build")
    logger.addHandler(handler)
    try:
        with StageProgress("build", "gemm", console=console) as progress:
            progress(1, 2, "build 1/2 gemm_a cached")
            progress(2, 2, "build 2/2 gemm_b 1.0s")
        assert handler.stream is out  # given back once the bars are gone
    finally:
        logger.removeHandler(handler)
    # each on a line of its own: written straight to the terminal, a line would continue
    # the bar the cursor was left on
    lines = re.split(r"[\r\n]", CONTROL.sub("", out.getvalue()))
    assert "build 1/2 gemm_a cached" in lines and "build 2/2 gemm_b 1.0s" in lines
    assert lines.index("build 1/2 gemm_a cached") < lines.index("build 2/2 gemm_b 1.0s")


def test_without_a_terminal_only_the_log_lines_remain(caplog):
    caplog.set_level(logging.INFO, logger="tilecast")
    console, out = _terminal(is_terminal=False)
    with StageProgress("bench", "gemm", console=console) as progress:
        progress(1, 2, "bench gemm: batch 1/1 done, 3 new records")
        progress(2, 2, "bench gemm: race round 1/1 done, 2 contenders of 1 problems")
    assert out.getvalue() == ""
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("tilecast.stages.bench", "bench gemm: batch 1/1 done, 3 new records"),
        ("tilecast.stages.bench", "bench gemm: race round 1/1 done, 2 contenders of 1 problems")]


def test_artifact_keys_and_stages_are_checked():
    assert artifact_key("bench", "grouped_conv_forward") == "tilecast-bench-grouped-conv-forward"
    with pytest.raises(ValueError, match="unknown stage 'train'.*valid: build, bench"):
        StageProgress("train", "gemm")


# `tilecast run` on the tiny config; once it returns (its embedded server stops only at exit),
# the run's progress artifacts read back through the API
RUN_THEN_READ = """
import json, sys
from tilecast.flows.cli import main
config, work, registry = sys.argv[1:4]
status = main(["run", "--config", config, "--workdir", work, "--registry", registry])
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType
with get_client(sync_client=True) as client:
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        type=ArtifactFilterType(any_=["progress"])))
    tasks = {a.task_run_id: client.read_task_run(a.task_run_id).name
             for a in artifacts if a.task_run_id}
print(json.dumps({"status": status, "artifacts": [
    {"key": a.key, "progress": a.data, "task": tasks.get(a.task_run_id),
     "flow_run": str(a.flow_run_id)} for a in artifacts]}))
"""


@pytest.mark.slow
def test_a_run_leaves_one_finished_progress_artifact_per_stage_and_family(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("PREFECT_API_URL", "PREFECT_HOME"):
        env.pop(name, None)
    child = subprocess.run([sys.executable, "-c", RUN_THEN_READ, str(TINY), str(tmp_path / "w"),
                            str(tmp_path / "r")], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["status"] == 0
    found = {a["key"]: a for a in report["artifacts"]}
    assert sorted(found) == ["tilecast-bench-gemm", "tilecast-build-gemm"]
    assert found["tilecast-build-gemm"]["task"].startswith("build-kernels")
    assert found["tilecast-bench-gemm"]["task"].startswith("benchmark-candidates")
    assert all(a["progress"] == 100 for a in found.values())
    assert len({a["flow_run"] for a in found.values()}) == 1
    # beside them, the stages' own progress lines, as without a reporter
    assert re.search(r"build 4/4 \S+ ", child.stderr)
    assert "bench gemm: batch 1/" in child.stderr
