"""tilecast's settings from the environment: one place that reads every TILECAST_* variable.

`settings()` reads the environment each time it is called (never at import), so a test's
monkeypatched variable or a worker's environment is seen by the next call. The cache
directories all derive from one root:

    TILECAST_CACHE            the root (default ~/.cache/tilecast)
    TILECAST_BUILD_CACHE      compiled kernels for every workdir (default: a workdir's
                              cache/build, or <root>/build outside one)
    TILECAST_REGISTRY_CACHE   local copies of remote registry versions (<root>/registry)
    TILECAST_LOCKS            benchmark device locks (<root>/devices)
    TILECAST_DEVICE           the benchmark device's name (default cpu@<host>, core.device)
    TILECAST_EMBEDDED_SERVER  "1" while `tilecast run` runs its own Prefect server
    TILECAST_CXX              the C++ compiler of the native libraries (default g++)
    TILECAST_DEVICES          hardware-table YAML files added to the shipped one
                              (os.pathsep-separated; tilecast.table.devices)

A frozen dataclass rather than a pydantic-settings class: the dispatcher reads it, and
importing pydantic would add to every `import tilecast.runtime.dispatch`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

CACHE_ENV = "TILECAST_CACHE"
BUILD_CACHE_ENV = "TILECAST_BUILD_CACHE"
REGISTRY_CACHE_ENV = "TILECAST_REGISTRY_CACHE"
LOCKS_ENV = "TILECAST_LOCKS"
DEVICE_ENV = "TILECAST_DEVICE"
EMBEDDED_SERVER_ENV = "TILECAST_EMBEDDED_SERVER"
COMPILER_ENV = "TILECAST_CXX"
DEVICES_ENV = "TILECAST_DEVICES"
DEFAULT_COMPILER = "g++"


@dataclass(frozen=True)
class Settings:
    """The environment's settings, resolved: every cache directory is a path here, except
    the build cache, whose default depends on the caller (a workdir's or the root's)."""
    cache_root: Path
    build_cache: Path | None        # None: unset, the caller picks its default
    registry_cache: Path
    lock_dir: Path
    device: str | None              # None: unset, core.device names this host's CPU
    embedded_server: bool
    compiler: str = DEFAULT_COMPILER    # of the native libraries (runtime.native, disco.native)
    device_tables: tuple[Path, ...] = ()    # user hardware tables (tilecast.table.devices)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from `environ` (default os.environ); an empty variable counts as unset."""
        env = os.environ if environ is None else environ
        root = Path(env[CACHE_ENV]) if env.get(CACHE_ENV) else Path.home() / ".cache" / "tilecast"
        return cls(cache_root=root,
                   build_cache=Path(env[BUILD_CACHE_ENV]) if env.get(BUILD_CACHE_ENV) else None,
                   registry_cache=Path(env.get(REGISTRY_CACHE_ENV) or root / "registry"),
                   lock_dir=Path(env.get(LOCKS_ENV) or root / "devices"),
                   device=env.get(DEVICE_ENV) or None,
                   embedded_server=env.get(EMBEDDED_SERVER_ENV) == "1",
                   compiler=env.get(COMPILER_ENV) or DEFAULT_COMPILER,
                   device_tables=tuple(Path(p) for p in env.get(DEVICES_ENV, "").split(os.pathsep)
                                       if p))


def settings() -> Settings:
    """The settings of the environment as it is now."""
    return Settings.from_env()
