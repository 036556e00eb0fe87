"""A checkpoint directory that cannot be torn: written aside, published by a rename, described by a
manifest written last.

[Note: publishing a checkpoint]
``save(path)`` never writes into ``path``. Every rank writes its DCP files into a sibling
``<path>.partial-<token>`` (the token comes from rank 0, so every rank names the same one). When DCP's
save returns on rank 0 every rank's files are written and synced (DCP gathers the ranks' write results
there before it writes its own metadata). The ranks then hash their share of the files, rank 0 writes
``manifest.json`` (the model's fingerprint and each file's size and sha256) last, and publishes:

  1. ``path`` -> ``<path>.previous``     (if a checkpoint is there)
  2. ``<path>.partial-<token>`` -> ``path``
  3. ``<path>.previous`` is removed

Each step is one ``rename``, atomic on a POSIX filesystem. Killed anywhere before step 2, ``path`` still
holds the previous checkpoint; killed between 1 and 2, ``path`` is missing and ``<path>.previous`` holds
it: ``load`` reads it from there (with a warning) and the next save moves it back first. A directory
without a manifest, or whose files differ from their manifest, is never loaded.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dpar.core.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PREVIOUS = ".previous"

# Tests stop a save at one of these points (raise, or kill the process) to show that no point tears it.
FAULT_POINTS = ("staged", "written", "manifest", "retired", "published")
_at_point: Callable[[str], None] | None = None


def reached(point: str) -> None:
    assert point in FAULT_POINTS, point
    if _at_point is not None:
        _at_point(point)


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def staging_directory(path: str, group: dist.ProcessGroup | None) -> str:
    """Where this save writes: a fresh sibling of ``path`` that every rank of ``group`` names alike.

    Rank 0 first finishes what an interrupted save left (see the Note); the broadcast of its
    token makes the others wait for that.
    """
    rank, _ = _group_rank_and_size(group)
    token = [None]
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        previous = path + PREVIOUS
        if not os.path.exists(path) and os.path.exists(previous):
            os.replace(previous, path)  # a save died between the two renames
        for stale in glob.glob(glob.escape(path) + ".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, group_src=0, group=group)
    return f"{path}.partial-{token[0]}"


@dataclasses.dataclass(frozen=True)
class FileDigest:
    bytes: int
    sha256: str


def _digest(file: str) -> FileDigest:
    hasher = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            hasher.update(chunk)
    return FileDigest(os.path.getsize(file), hasher.hexdigest())


def _shared_digests(directory: str, names: list[str], group: dist.ProcessGroup | None) -> dict[str, FileDigest | None]:
    """Every file's digest (None: missing), each file hashed by one rank of ``group`` only."""
    rank, size = _group_rank_and_size(group)
    mine = {
        name: _digest(os.path.join(directory, name)) if os.path.isfile(os.path.join(directory, name)) else None
        for i, name in enumerate(names) if i % size == rank
    }
    if size == 1:
        return mine
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    return {name: digest for part in everyone for name, digest in part.items()}


def publish(staging: str, path: str, fingerprint: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Hash the written files, write the manifest last, rename ``staging`` to ``path``; on every rank of
    ``group``, which returns once the checkpoint is published."""
    rank, _ = _group_rank_and_size(group)
    names = sorted(os.listdir(staging)) if rank == 0 else None
    if dist.is_initialized():
        box = [names]
        dist.broadcast_object_list(box, group_src=0, group=group)
        names = box[0]
    digests = _shared_digests(staging, names, group)
    if rank == 0:
        manifest = {
            "format": FORMAT_VERSION,
            "written_by": "dpar.checkpoint.save",
            "fingerprint": fingerprint,
            "files": {name: dataclasses.asdict(digests[name]) for name in names},
        }
        _write_synced(os.path.join(staging, MANIFEST), json.dumps(manifest))
        reached("manifest")
        previous = path + PREVIOUS
        if os.path.exists(path):
            shutil.rmtree(previous, ignore_errors=True)  # older than path: a finished save's leftover
            os.replace(path, previous)
            reached("retired")
        os.replace(staging, path)
        _sync_directory(os.path.dirname(os.path.abspath(path)))
        reached("published")
        shutil.rmtree(previous, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=group)


def _write_synced(file: str, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def published(path: str) -> str:
    """The directory that holds the checkpoint published at ``path``: ``path``, or ``<path>.previous``
    where a save died between its two renames."""
    if os.path.isdir(path):
        return path
    previous = path + PREVIOUS
    if os.path.isfile(os.path.join(previous, MANIFEST)):
        warnings.warn(
            f"{path!r} is missing and {previous!r} holds the checkpoint published before it (a save was "
            "interrupted while it replaced it): loading that one; the next save moves it back",
            stacklevel=3,
        )
        return previous
    raise CheckpointError(f"no checkpoint at {path!r}: save one with dpar.checkpoint.save, or check the path")


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a published checkpoint, after every file was checked against it (on every rank)."""
    file = os.path.join(directory, MANIFEST)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{directory!r} has no {MANIFEST}: it is not a checkpoint dpar.checkpoint.save published (an "
            "interrupted save never publishes one). Load the previous checkpoint; a checkpoint written by "
            "torch.distributed.checkpoint.save directly loads with torch.distributed.checkpoint.load"
        )
    try:
        with open(file) as f:
            manifest = json.load(f)
        version, files = manifest["format"], manifest["files"]
        manifest["fingerprint"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"the manifest of {directory!r} is corrupt ({type(exc).__name__}: {exc}): the checkpoint cannot be "
            "trusted; load an earlier one"
        ) from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory!r} has checkpoint format {version}, this dpar reads format {FORMAT_VERSION}: load it with "
            "the dpar version that saved it and export it with dpar.checkpoint.full_state_dict"
        )
    digests = _shared_digests(directory, sorted(files), None)
    bad = [
        f"{name} ({'missing' if digests[name] is None else _difference(digests[name], FileDigest(**files[name]))})"
        for name in sorted(files)
        if digests[name] != FileDigest(**files[name])
    ]
    if bad:
        raise CheckpointError(
            f"the checkpoint at {directory!r} is damaged: {', '.join(bad)} differ from its manifest (truncated, "
            "overwritten or corrupted on disk); nothing was loaded. Load an earlier checkpoint"
        )
    return manifest


def _difference(got: FileDigest, want: FileDigest) -> str:
    if got.bytes != want.bytes:
        return f"{got.bytes} bytes, the manifest says {want.bytes}"
    return "same size, other sha256"


__all__ = ["FAULT_POINTS", "publish", "published", "read_manifest", "reached", "staging_directory"]
