"""The cold build of a run config: every compile its run makes before measuring (each
family's candidate executables and, where the family is timed in-process, their shared
libraries), from an empty cache, timed per family with the compiler invocations counted.

    .venv/bin/python benchmarks/cold_build.py [--config quick] [--repeat 1]

The caches ($TILECAST_CACHE, $TILECAST_BUILD_CACHE) point at a fresh temporary directory;
a shim named like the compiler, first on PATH, logs every invocation (a compile writes an
output with -o, a dependency listing is -MM, the rest are --version and target queries).
Prints the machine's load (uptime) before and after each repeat: the cores are shared.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SHIM = """#!/bin/sh
printf '%s\\n' "$*" >> "{log}"
exec "{real}" "$@"
"""


def kind(arguments: str) -> str:
    """What one logged compiler invocation did."""
    words = arguments.split()
    if "-MM" in words:
        return "listing"
    if "-o" in words:
        return "compile"
    return "query"


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def family_builds(pipeline, ctx):
    """(family, seconds) as each family's compiles finish, in the run's order: its
    executables (the build stage), then its in-process libraries (the bench stage's first
    step)."""
    from tilecast.stages.bench import in_process_libraries

    for name in ctx.config.families:
        started = time.perf_counter()
        pipeline.build_stage(ctx, name)
        if ctx.config.interleave:
            family, _ = pipeline._family(ctx, name)
            in_process_libraries(family, pipeline.load_builds(ctx, name), ctx.build_cache,
                                 ctx.config.build_jobs)
        yield name, time.perf_counter() - started


def cold_build(config: str) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="tilecast-cold-"))
    try:
        real = shutil.which("g++")
        shim_dir, log = scratch / "bin", scratch / "compiler.log"
        shim_dir.mkdir()
        (shim_dir / "g++").write_text(SHIM.format(log=log, real=real))
        (shim_dir / "g++").chmod(0o755)
        os.environ["PATH"] = f"{shim_dir}{os.pathsep}{os.environ['PATH']}"
        os.environ["TILECAST_CACHE"] = str(scratch / "cache")
        os.environ["TILECAST_BUILD_CACHE"] = str(scratch / "cache" / "build")
        from tilecast.workflows import pipeline

        ctx = pipeline.RunContext.create(config, scratch / "work", scratch / "registry")
        print(f"load before: {load()}", flush=True)
        started = time.perf_counter()
        seen = 0
        for name, seconds in family_builds(pipeline, ctx):
            lines = log.read_text().splitlines() if log.exists() else []
            counts = Counter(kind(line) for line in lines[seen:])
            seen = len(lines)
            print(f"{name:26s} {seconds:7.1f} s  compiles {counts['compile']:3d}  "
                  f"listings {counts['listing']:3d}  queries {counts['query']:3d}", flush=True)
        total = time.perf_counter() - started
        counts = Counter(kind(line) for line in log.read_text().splitlines())
        print(f"{'all':26s} {total:7.1f} s  compiles {counts['compile']:3d}  "
              f"listings {counts['listing']:3d}  queries {counts['query']:3d}")
        print(f"load after: {load()}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quick")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; {sys.version.split()[0]}")
    for _ in range(args.repeat):
        cold_build(args.config)


if __name__ == "__main__":
    main()
