"""One night on one worker against the same night on two, and on two with one killed.

Everything on this machine and loopback: moto's S3 server (in this process) holds the stores
and registries, a Prefect server on 127.0.0.1, the pools and deployments of prefect.yaml, and
workers of the tilecast-shards pool each on a slot of one core (`tilecast worker --cpus 1`:
pinned, its own device name, build cache and home) as machines of one class. A throwaway
night on both workers warms their build caches; then three nights of one config, one after
another:

  one   one worker, `tilecast fleet --shards 1`
  two   two workers, `--shards 2`
  kill  two workers, `--shards 2`, the first worker seen measuring killed with its shard

It prints each night's wall time (the parent's command, and the span from the first shard
submitted to the last done), the records and problems each night holds, whether the one- and
two-worker nights hold the same problems, kernels and statuses, records lost and duplicated
in the killed night, and the labels of `two` scored against `one`
(`tilecast repeatability`). The parents run pinned to core 0 beside a worker: they only wait,
until they train at the end.

    .venv/bin/python benchmarks/fleet_night.py OUT [--config benchmarks/configs/fleet.yaml]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
TILECAST = [sys.executable, "-m", "tilecast.flows.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3(env: dict) -> str:
    """moto's S3 on 127.0.0.1, its PUTs serialized (S3 decides a conditional PUT atomically;
    moto in two steps)."""
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    lock, original = threading.Lock(), S3Response.put_object

    def put_object(self, *args, **kwargs):
        with lock:
            return original(self, *args, **kwargs)

    S3Response.put_object = put_object
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_ENDPOINT_URL=endpoint)
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                           "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")})
    import fsspec
    fsspec.filesystem("s3", use_listings_cache=False).mkdir("fleet-bench")
    return endpoint


def start_prefect(out: Path, env: dict, query_s: float) -> subprocess.Popen:
    port = free_port()
    env.update(PREFECT_HOME=str(out / "prefect"), DO_NOT_TRACK="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_WORKER_QUERY_SECONDS=str(query_s),
               PREFECT_WORKER_PREFETCH_SECONDS=str(query_s))
    proc = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], stdout=open(out / "server.log", "w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                if r.read().strip() == b"true":
                    return proc
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the Prefect server did not come up; see " + str(out / "server.log"))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def worker(out: Path, env: dict, core: int, night: str) -> subprocess.Popen:
    """A machine: `tilecast worker --cpus 1` on a slot of one core (its own device, build
    cache and tilecast home)."""
    own = {**env, "TILECAST_BUILD_CACHE": str(out / f"cache-{core}"),
           "TILECAST_HOME": str(out / f"home-{core}")}
    return subprocess.Popen([*TILECAST, "worker", "--pool", "tilecast-shards", "--cpus", "1",
                             "--slots", str(out / f"slots-{night}"), "--host", "fleet-bench",
                             "--name", f"{night}-worker{core}"],
                            stdout=open(out / f"{night}-worker{core}.log", "w"),
                            stderr=subprocess.STDOUT, env=own, cwd=out, start_new_session=True)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children so far, from /proc."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(proc.name) == pid or _descends(int(proc.name), pid):
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def run_night(out: Path, env: dict, config: str, night: str, cores: list[int],
              kill: bool = False, poll_s: float = 5.0, control: int | None = None) -> dict:
    """One night; its summary, wall time and what was killed."""
    workers = {c: worker(out, env, c, night) for c in cores}
    store, registry = f"s3://fleet-bench/{night}/store", f"s3://fleet-bench/{night}/registry"
    command = ["taskset", "-c", "0", *TILECAST, "fleet", "--config", config, "--store", store,
               "--registry", registry, "--workdir", str(out / night), "--shards",
               str(len(cores)), "--shard-workdir", str(out / "shards"), "--lease-s", "30",
               "--poll-s", str(poll_s)]
    control_before = (cpu_s(control) if control else 0.0) + _self_cpu()
    started = time.monotonic()
    parent = subprocess.Popen(command, stdout=subprocess.PIPE,
                              stderr=open(out / f"{night}-parent.log", "w"), text=True,
                              env=env, cwd=REPO, start_new_session=True)
    killed = None
    try:
        if kill:
            killed = kill_first_running(store, workers, parent)
        stdout, _ = parent.communicate(timeout=3600)
    finally:
        stop(parent)
        for w in workers.values():
            stop(w)
    wall = time.monotonic() - started
    control_s = (cpu_s(control) if control else 0.0) + _self_cpu() - control_before
    if parent.returncode != 0:
        raise SystemExit(f"night {night} failed; see {out / (night + '-parent.log')}")
    summary = json.loads(stdout)
    return {"summary": summary, "wall_s": wall, "killed": killed, "store": store,
            "control_cpu_s": control_s}


def _self_cpu() -> float:
    """This process's CPU seconds (moto's S3 server runs in it)."""
    times = os.times()
    return times.user + times.system


def kill_first_running(store: str, workers: dict, parent: subprocess.Popen) -> str | None:
    """Kill the machine of the first shard seen measuring: its worker and its shard."""
    import fsspec

    fs = fsspec.filesystem("s3", use_listings_cache=False)
    prefix = store.removeprefix("s3://") + "/fleet"
    while parent.poll() is None:
        for path in fs.glob(prefix + "/*/*/*/attempt-1.json"):
            lease = json.loads(fs.cat_file(path))
            if lease["state"] != "running":
                continue
            pid = int(lease["pid"])
            for w in workers.values():
                if _descends(pid, w.pid):
                    os.killpg(w.pid, signal.SIGKILL)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    w.wait()
                    print(f"kill: {lease['shard']} attempt 1 (pid {pid}) and its worker, "
                          f"{datetime.now().isoformat(timespec='seconds')}", flush=True)
                    return lease["shard"]
        time.sleep(0.3)
    return None


def _descends(pid: int, ancestor: int) -> bool:
    for _ in range(8):
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
        except (OSError, ValueError):
            return False
    return False


def shard_span(out: Path, night: str) -> float | None:
    """Seconds from the first shard submitted to the last done, from the parent's log."""
    stamps = []
    for line in (out / f"{night}-parent.log").read_text().splitlines():
        if "tilecast.workflows.fleet" in line and (" submitted " in line or " done (" in line):
            stamps.append(datetime.strptime(line[:8], "%H:%M:%S"))
    return (max(stamps) - min(stamps)).total_seconds() if len(stamps) >= 2 else None


def _stage_seconds(store: str, summary: dict, shard: dict) -> str:
    """'build / benchmark' seconds of a shard's finishing attempt, from its lease."""
    from tilecast.fleet.lease import attempt_doc, night_key
    from tilecast.store.store import Store

    [cls] = summary["classes"]
    doc = attempt_doc(Store(store), night_key(cls, summary["run_id"]), shard["shard"],
                      shard["attempt"]) or {}
    return f"{doc.get('build_s', '?')} / {doc.get('bench_s', '?')}"


def records(store: str, summary: dict):
    from tilecast.store.nights import read_frame
    from tilecast.store.store import Store

    [cls] = summary["classes"]
    return read_frame(Store(store), cls, "gemm", summary["run_id"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default=str(REPO / "benchmarks" / "configs" / "fleet.yaml"))
    parser.add_argument("--poll-s", type=float, default=5.0,
                        help="the parent's poll (tilecast fleet --poll-s; default 5, its own)")
    parser.add_argument("--worker-query-s", type=float, default=10.0,
                        help="PREFECT_WORKER_QUERY_SECONDS of the workers (default 10, "
                             "Prefect's)")
    args = parser.parse_args()
    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs taskset and two cores")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}
    start_s3(env)
    server = start_prefect(out, env, args.worker_query_s)
    try:
        for pool in ("tilecast", "tilecast-shards"):
            subprocess.run([*PREFECT, "work-pool", "create", pool, "--type", "process"],
                           env=env, cwd=REPO, check=True, capture_output=True)
        subprocess.run([*PREFECT, "--no-prompt", "deploy", "--all"], env=env, cwd=REPO,
                       check=True, capture_output=True)
        # every worker's build cache warm first (a night that compiled on one worker and
        # not the other would time the compiler): a throwaway night on both
        common = {"poll_s": args.poll_s, "control": server.pid}
        run_night(out, env, args.config, "warm", [0, 1], **common)
        nights = {"one": run_night(out, env, args.config, "one", [0], **common),
                  "two": run_night(out, env, args.config, "two", [0, 1], **common),
                  "kill": run_night(out, env, args.config, "kill", [0, 1], kill=True,
                                    **common)}
    finally:
        stop(server)
    print(f"config {args.config}; class {next(iter(nights['one']['summary']['classes']))}; parent "
          f"poll {args.poll_s:g} s, workers query {args.worker_query_s:g} s")
    print("night | workers | wall s (parent) | shards submitted..done s | records | problems | "
          "attempts | each shard's build / benchmark s | Prefect server + S3 CPU s")
    frames = {}
    for name, night in nights.items():
        frame = records(night["store"], night["summary"])
        frames[name] = frame
        [tonight] = night["summary"]["classes"].values()
        shards = tonight["families"]["gemm"]["shards"]
        print(f"{name} | {len(shards)} | {night['wall_s']:.1f} | {shard_span(out, name)} | "
              f"{len(frame)} | {frame['dims_key'].nunique()} | "
              f"{', '.join(str(s['attempt']) for s in shards)} | "
              f"{', '.join(_stage_seconds(night['store'], night['summary'], s) for s in shards)}"
              f" | {night['control_cpu_s']:.1f}")
    one, two = (shard_span(out, n) for n in ("one", "two"))
    if one and two:
        print(f"two workers / one: {two / one:.2f} of the shard span, "
              f"{nights['two']['wall_s'] / nights['one']['wall_s']:.2f} of the parent's wall time")

    def content(frame):
        return {(r.dims_key, r.kernel, r.status) for r in
                frame[frame["role"] == "candidate"].drop_duplicates(
                    ["dims_key", "kernel", "status"]).itertuples()}
    print("one and two hold the same (problem, kernel, status): "
          f"{content(frames['one']) == content(frames['two'])}")

    def screens(frame):
        return frame[(frame["role"] == "candidate") & (frame["phase"] == "screen")]

    expected = set(zip(screens(frames["one"])["dims_key"], screens(frames["one"])["kernel"]))
    killed = screens(frames["kill"])
    got = set(zip(killed["dims_key"], killed["kernel"]))
    print(f"kill: {nights['kill']['killed']} killed; screens lost {len(expected - got)}, "
          f"duplicated {int(killed.duplicated(['dims_key', 'kernel']).sum())}; missing shards "
          f"{next(iter(nights['kill']['summary']['classes'].values()))['missing']}")
    rep = subprocess.run([*TILECAST, "repeatability", nights["one"]["store"],
                          nights["two"]["store"]], capture_output=True, text=True, env=env)
    print("tilecast repeatability one two:")
    print(rep.stdout.strip() or rep.stderr.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
