"""The cold build of a run config: every compile its run makes before measuring (each
family's candidate executables and, where the family is timed in-process, their shared
libraries), from an empty cache, timed, with the compiler invocations counted per family.

    .venv/bin/python benchmarks/cold_build.py [--config quick] [--repeat 1] [--per-family]

The caches ($TILECAST_CACHE, $TILECAST_BUILD_CACHE) point at a fresh temporary directory;
a shim named like the compiler, first on PATH, logs every invocation: a compile (a .cpp
in, `-c` or a program out), a link (objects in), a dependency listing (-MM) or a query
(--version, the -march=native target). By default it builds as `tilecast run --plain`
does (pipeline.build_all: every family in one pool of build.jobs compilers, then the
in-process libraries); --per-family builds one family at a time, the build stage then the
bench stage's libraries, as the run did before build_all. Prints the machine's load
(uptime) before and after each repeat: the cores are shared.
"""
from __future__ import annotations

import argparse
import os
import resource
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
    if any(word.endswith((".cpp", ".cu")) for word in words):
        return "compile"
    if any(word.endswith(".o") for word in words):
        return "link"
    return "query"


def child_cpu_seconds() -> float:
    """CPU seconds (user + system) of the compilers this process ran and waited for: what the
    build cost, whatever else the shared cores were doing."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def per_family(pipeline, ctx):
    """(family, seconds) as each family's compiles finish, one family at a time: its
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


def all_at_once(pipeline, ctx):
    """("all families", seconds) of pipeline.build_all, then each family's bench-stage
    library step (which should find every library built)."""
    from tilecast.stages.bench import in_process_libraries

    started = time.perf_counter()
    pipeline.build_all(ctx)
    yield "build_all", time.perf_counter() - started
    if ctx.config.interleave:
        for name in ctx.config.families:
            started = time.perf_counter()
            family, _ = pipeline._family(ctx, name)
            in_process_libraries(family, pipeline.load_builds(ctx, name), ctx.build_cache,
                                 ctx.config.build_jobs)
            yield f"{name} libraries", time.perf_counter() - started


def counts_line(lines: list[str]) -> str:
    counts = Counter(kind(line) for line in lines)
    return "  ".join(f"{what} {counts[what]:3d}" for what in ("compile", "link", "listing", "query"))


def cold_build(config: str, by_family: bool) -> None:
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
        started, seen, cpu = time.perf_counter(), 0, child_cpu_seconds()
        cpu_start = cpu
        for name, seconds in (per_family if by_family else all_at_once)(pipeline, ctx):
            lines = log.read_text().splitlines() if log.exists() else []
            now = child_cpu_seconds()
            print(f"{name:36s} {seconds:7.1f} s wall {now - cpu:7.1f} s compiler CPU  "
                  f"{counts_line(lines[seen:])}", flush=True)
            seen, cpu = len(lines), now
        total = time.perf_counter() - started
        lines = log.read_text().splitlines()
        print(f"{'all':36s} {total:7.1f} s wall {child_cpu_seconds() - cpu_start:7.1f} s "
              f"compiler CPU  {counts_line(lines)}")
        for name in ctx.config.families:
            prefix = pipeline._family(ctx, name)[0].name + "_"
            mine = [line for line in lines if f"/{prefix}" in line or f".{prefix}" in line]
            print(f"  {name:34s} {counts_line(mine)}")
        print(f"load after: {load()}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quick")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--per-family", action="store_true",
                        help="one family at a time, as the run built before build_all")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; Python {sys.version.split()[0]}")
    for _ in range(args.repeat):
        cold_build(args.config, args.per_family)


if __name__ == "__main__":
    main()
