"""Integrity of a published version: a sha256 of every file, checked before anything loads.

Publish writes `checksums.json` into the version beside its files:

    {"algorithm": "sha256", "files": {"model.txt": {"sha256": "<64 hex>", "bytes": 12345}, ...}}

covering every file staged before the version is claimed (the artifacts and metrics.json;
not promotion.json, which publish writes last, after the aliases moved). A reader verifies a
version's directory (a local version, or a remote version's cached copy) before loading it:
a file that is missing, truncated or has a flipped bit is a RegistryError naming the file,
never a model handed to LightGBM, whose loader crashes the process on a damaged file
(SIGABRT or SIGSEGV) instead of raising. A version published before checksums were kept has
no manifest: `verify_directory` returns None and the caller decides (the registry loads it
with a warning). `check_model_text` is the last line of defence for those: it refuses the
truncated LightGBM text that crashes the loader.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Mapping

from tilecast.registry.base import CHECKSUMS_FILE, RegistryError, relative_name

ALGORITHM = "sha256"
CHUNK_BYTES = 1 << 20
HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def digest_bytes(data: bytes) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of `data`."""
    return hashlib.sha256(data).hexdigest(), len(data)


def digest_file(path: Path) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of the file at `path`, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def manifest_text(digests: Mapping[str, tuple[str, int]]) -> str:
    """The checksums.json text for {relative name: (sha256, bytes)}."""
    files = {name: {"sha256": sha, "bytes": size} for name, (sha, size) in sorted(digests.items())}
    return json.dumps({"algorithm": ALGORITHM, "files": files}, indent=2, sort_keys=True) + "\n"


def read_manifest(directory: Path, where: str = "") -> dict[str, tuple[str, int]] | None:
    """{name: (sha256, bytes)} from the directory's checksums.json; None when it has none (a
    version published before checksums were kept); RegistryError when it is corrupt."""
    path = Path(directory) / CHECKSUMS_FILE
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise RegistryError(f"corrupt checksum manifest {path}{_at(where)}: {err}") from None
    files = document.get("files") if isinstance(document, dict) else None
    if not isinstance(document, dict) or document.get("algorithm") != ALGORITHM or \
            not isinstance(files, dict):
        raise RegistryError(f"corrupt checksum manifest {path}{_at(where)}: expected "
                            f'{{"algorithm": "{ALGORITHM}", "files": {{name: {{"sha256", '
                            f'"bytes"}}}}}}')
    manifest = {}
    for name, entry in files.items():
        relative_name(name)  # a manifest must not point outside the version
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not isinstance(sha, str) or not HEX_DIGEST.match(sha) or \
                not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RegistryError(f"corrupt checksum manifest {path}{_at(where)}: entry {name!r} "
                                f"is {entry!r}, expected "
                                f'{{"sha256": <64 hex digits>, "bytes": <int>}}')
        manifest[name] = (sha, size)
    return manifest


def verify_directory(directory: Path, where: str = "") -> dict[str, tuple[str, int]] | None:
    """Check every file the directory's checksums.json lists against its size and sha256;
    returns the manifest, or None when there is none. RegistryError naming the first file
    that is missing or whose checksum does not match (`where` says which version it is)."""
    directory = Path(directory)
    manifest = read_manifest(directory, where)
    if manifest is None:
        return None
    for name, (sha, size) in manifest.items():
        path = directory / name
        try:
            got_sha, got_size = digest_file(path)
        except FileNotFoundError:
            raise RegistryError(f"{path}{_at(where)} is missing, but {CHECKSUMS_FILE} lists it; "
                                f"the version is damaged: publish the model again or roll "
                                f"back to an intact version") from None
        except OSError as err:
            raise RegistryError(f"cannot read {path}{_at(where)} to verify its checksum: "
                                f"{err}") from None
        if (got_sha, got_size) != (sha, size):
            raise RegistryError(f"{path}{_at(where)}: its {ALGORITHM} checksum does not match "
                                f"{CHECKSUMS_FILE} ({got_size} bytes, sha256 {got_sha[:12]}...; "
                                f"recorded {size} bytes, sha256 {sha[:12]}...): the file is "
                                f"damaged; publish the model again or roll back to an intact "
                                f"version")
    return manifest


def check_model_text(path: Path) -> None:
    """RegistryError unless `path` is a complete LightGBM text model as far as its own
    layout tells: the header's tree_sizes land on every 'Tree=' block and on 'end of trees',
    and a parameters section is closed. LightGBM's loader trusts those offsets and reads past
    the end of a truncated file (SIGSEGV) or aborts in a parallel region (SIGABRT)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise RegistryError(f"cannot read LightGBM model {path}: {err}") from None

    def damaged(why: str) -> RegistryError:
        return RegistryError(f"corrupt LightGBM model {path}: {why} (truncated or damaged "
                             f"file); publish the model again or roll back")

    if not data.startswith(b"tree\n"):
        raise damaged("it does not start with the 'tree' header line")
    first_tree = data.find(b"\nTree=") + 1
    trees_end = data.find(b"\nend of trees\n")
    if trees_end < 0:
        raise damaged("no 'end of trees' line")
    header = data[:first_tree or trees_end]
    sizes_line = re.search(rb"^tree_sizes=(.*)$", header, re.MULTILINE)
    if sizes_line is not None and first_tree:
        try:
            sizes = [int(size) for size in sizes_line.group(1).split()]
        except ValueError:
            raise damaged("its tree_sizes line is not a list of integers") from None
        offset = first_tree
        for index, size in enumerate(sizes):
            if not data.startswith(b"Tree=", offset):
                raise damaged(f"tree {index} is not where tree_sizes puts it (byte {offset})")
            offset += size
        if offset != trees_end + 1:
            raise damaged(f"tree_sizes ends at byte {offset}, 'end of trees' is at byte "
                          f"{trees_end + 1}")
    parameters = data.find(b"\nparameters:\n", trees_end)
    if parameters >= 0 and data.find(b"\nend of parameters\n", parameters) < 0:
        raise damaged("its parameters section has no 'end of parameters' line")
    if not data.endswith(b"\n"):
        raise damaged("its last line is cut short")


def _at(where: str) -> str:
    return f" ({where})" if where else ""
