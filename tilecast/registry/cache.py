"""Local copies of remote registry versions, for loaders that need files (LightGBM, json).

A version is immutable, so it is downloaded once: into
`<cache>/<sha256(url, model, version, publisher token)[:24]>/<version>/`, where <cache> is
$TILECAST_REGISTRY_CACHE, else $TILECAST_CACHE/registry, else ~/.cache/tilecast/registry.
The publisher's token (from the version's .complete marker) is part of the key, so a
registry deleted and re-created at the same URL never serves a stale copy. Files are
downloaded into a temp directory beside the target and checked against the marker's sizes
and the caller's check (the version's checksums, tilecast.registry.integrity), then the
directory is renamed into place: concurrent loaders on one machine never see a partial
copy, and the first rename wins. A cached copy that fails the check (edited or damaged on
disk) is downloaded again; a fresh download that fails it is the version's own damage, an
error. Directories get the mode the umask allows, so a cache can be shared.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, Mapping

from tilecast.core.atomic import make_temp_dir
from tilecast.core.settings import REGISTRY_CACHE_ENV, settings
from tilecast.registry.base import TEMP_PREFIX, RegistryError


def default_cache_dir() -> Path:
    """$TILECAST_REGISTRY_CACHE, else $TILECAST_CACHE/registry, else
    ~/.cache/tilecast/registry (core.settings)."""
    return settings().registry_cache


def _intact(directory: Path, files: Mapping[str, int]) -> bool:
    return directory.is_dir() and all(
        (directory / name).is_file() and (directory / name).stat().st_size == size
        for name, size in files.items())


def _passes(directory: Path, check: Callable[[Path], object] | None) -> bool:
    """Whether a cached copy passes `check` (a RegistryError from it: damaged on disk)."""
    if check is None:
        return True
    try:
        check(directory)
    except RegistryError:
        return False
    return True


def materialize(key: tuple, leaf: str, files: Mapping[str, int],
                download: Callable[[str, Path], None], *, cache_dir=None,
                check: Callable[[Path], object] | None = None) -> Path:
    """The cached directory `<cache>/<hash of key>/<leaf>` holding `files` (name -> size in
    bytes), calling `download(name, local_path)` for each when it is not there yet, or when
    the copy there fails `check(directory)` (which raises RegistryError on damage; a fresh
    download that fails it raises that error)."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256("\n".join(map(str, key)).encode()).hexdigest()[:24]
    target = base / digest / leaf
    if _intact(target, files) and _passes(target, check):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = make_temp_dir(target.parent, TEMP_PREFIX)
    except OSError as err:
        raise RegistryError(f"cannot write the registry cache {base}: {err}; set "
                            f"{REGISTRY_CACHE_ENV} to a writable directory") from None
    try:
        for name, size in files.items():
            local = temp / name
            local.parent.mkdir(parents=True, exist_ok=True)
            download(name, local)
            got = local.stat().st_size
            if got != size:
                raise RegistryError(f"downloaded {name} for {target} has {got} bytes; the "
                                    f"version's complete marker says {size}")
        if check is not None:
            check(temp)  # the remote version itself is damaged: say so, cache nothing
        if target.exists():  # a damaged copy (a file edited or removed by hand)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(temp, target)
        except OSError as err:
            # another process renamed its complete copy into place first: use that one
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _intact(target, files) \
                    or not _passes(target, check):
                raise
    except OSError as err:
        raise RegistryError(f"cannot write the registry cache {base}: {err}; set "
                            f"{REGISTRY_CACHE_ENV} to a writable directory") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return target
