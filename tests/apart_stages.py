"""Stages for tests/test_apart.py, imported by the worker processes of tilecast.tasks.apart."""
import logging
import os

log = logging.getLogger("tilecast.test_apart")


def logs_and_returns(ctx, family: str) -> dict:
    log.info("stage %s ran in pid %d", family, os.getpid())
    log.debug("a debug line the parent's level leaves out")
    return {"family": family, "pid": os.getpid(), "run_id": ctx.run_id}


def fails(ctx, family: str) -> dict:
    log.info("about to fail for %s", family)
    raise ValueError(f"bad family {family!r}")
