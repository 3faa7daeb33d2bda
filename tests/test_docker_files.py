"""docker/compose.yaml and docker/Dockerfile as files (no Docker engine runs in CI): the
services a fleet needs, volumes that exist, and commands that tilecast's CLI accepts."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

DOCKER = Path(__file__).resolve().parent.parent / "docker"


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _defaults(text: str) -> str:
    """${VAR:-default} as compose fills it with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_compose_names_a_server_the_parents_worker_and_shard_machines():
    compose = _compose()
    services = compose["services"]
    assert {"postgres", "server", "worker", "shard-worker"} <= set(services)
    declared = set(compose["volumes"])
    for name, service in services.items():
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in declared, f"{name}: volume {volume} is not declared"
    worker, shard = services["worker"], services["shard-worker"]
    # the worker creates both pools before it deploys (the shard workers take its deployments)
    script = " ".join(worker["command"])
    assert "work-pool create tilecast --type process" in script
    assert "work-pool create tilecast-shards --type process" in script
    # one store and one registry for every machine
    for path in ("/opt/tilecast/store", "/opt/tilecast/registry"):
        assert [v for v in worker["volumes"] if v.endswith(":" + path)] == \
               [v for v in shard["volumes"] if v.endswith(":" + path)]
    # a shard worker is a machine of its own: no shared device name, a slot of the host
    assert "TILECAST_DEVICE" not in shard["environment"]
    assert any(v.endswith(":/slots") for v in shard["volumes"])
    home = re.search(r"^WORKDIR (\S+)", (DOCKER / "Dockerfile").read_text(), re.M).group(1)
    assert worker["environment"]["TILECAST_HOME"] == shard["environment"]["TILECAST_HOME"] == home


def test_the_shard_workers_command_is_one_tilecast_accepts(tmp_path):
    """The replica's arguments parse; without a server it stops at the first check."""
    shard = _compose()["services"]["shard-worker"]
    argv = [_defaults(str(a)) for a in shard["command"]]
    assert argv[:3] == ["worker", "--pool", "tilecast-shards"] and "--cpus" in argv
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "tilecast.flows.cli", *argv],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "a worker needs the Prefect server of its pool" in done.stderr, done.stderr
