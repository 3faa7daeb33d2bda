"""tilecast.tasks.apart: a stage in a worker process, its logs and its errors back here."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from tilecast.tasks import apart

CONFIG = str(Path(__file__).parent / "configs" / "tiny.yaml")


def args(tmp_path):
    return (CONFIG, str(tmp_path / "w"), str(tmp_path / "r")), {"run_id": "apart-test"}


def test_a_stage_runs_in_a_worker_and_its_log_lines_come_back(tmp_path, caplog):
    ctx_args, options = args(tmp_path)
    caplog.set_level(logging.INFO, logger="tilecast")
    result = apart.run("apart_stages:logs_and_returns", ctx_args, options, "gemm")
    assert result["family"] == "gemm" and result["run_id"] == "apart-test"
    assert result["pid"] != os.getpid()
    lines = [r.getMessage() for r in caplog.records if r.name == "tilecast.test_apart"]
    assert lines == [f"stage gemm ran in pid {result['pid']}"]


class _Where(logging.Handler):
    """Which thread of this process logged each line."""
    def __init__(self):
        super().__init__()
        self.lines = set()

    def emit(self, record):
        self.lines.add((threading.get_ident(), record.getMessage()))


def test_stages_run_side_by_side_and_each_gets_its_own_lines(tmp_path, caplog):
    ctx_args, options = args(tmp_path)
    caplog.set_level(logging.INFO, logger="tilecast")
    where = _Where()
    logger = logging.getLogger("tilecast.test_apart")
    logger.addHandler(where)
    results, threads_of = {}, {}

    def one(family):
        threads_of[family] = threading.get_ident()
        results[family] = apart.run("apart_stages:logs_and_returns", ctx_args, options, family)

    try:
        threads = [threading.Thread(target=one, args=(f,)) for f in ("a", "b", "c", "d")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        logger.removeHandler(where)
    assert sorted(results) == ["a", "b", "c", "d"]
    # each task's line was logged on that task's own thread, none lost, none twice
    assert where.lines == {(threads_of[f], f"stage {f} ran in pid {results[f]['pid']}")
                           for f in results}


def test_a_stage_error_is_raised_here_after_its_lines(tmp_path, caplog):
    ctx_args, options = args(tmp_path)
    caplog.set_level(logging.INFO, logger="tilecast")
    with pytest.raises(ValueError, match="bad family 'x'"):
        apart.run("apart_stages:fails", ctx_args, options, "x")
    assert [r.getMessage() for r in caplog.records
            if r.name == "tilecast.test_apart"] == ["about to fail for x"]
