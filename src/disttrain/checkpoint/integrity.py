"""Checksums of every checkpoint file, recorded in COMMIT and verified before a resume.

Sizes alone miss a flipped bit on a flaky disk or a bad network-filesystem cache. CRC-32 (zlib, a
few GB/s) of every file is computed when a checkpoint commits and checked before one is loaded.
Both are spread over the ranks: the sorted file list is dealt round-robin, each rank reads its
share, and the results meet in one all-gather, so no rank reads the whole checkpoint. Locations are local
paths or fsspec URLs (storage.py); a rank that cannot read its share says so through the same all-gather,
so every rank gets the same answer and none waits for a peer that gave up.
"""

from __future__ import annotations

import zlib

import torch.distributed as dist

from disttrain.core import storage

CHUNK = 8 << 20
SKIP = ("COMMIT", "COMMIT.tmp")


def crc32(path) -> str:
    crc = 0
    with storage.open_file(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def checkpoint_files(path) -> dict[str, int]:
    """Every file of a checkpoint directory (subfolders included): relative name -> size."""
    return {name: size for name, size in storage.files_under(path).items()
            if storage.name_of(name) not in SKIP}


def _mine(names: list[str], group) -> list[str]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return [n for i, n in enumerate(names) if i % world == rank]


def record(path, group=None) -> tuple[dict[str, list], str | None]:
    """Collective: ({file: [size, crc32]} for every file under `path`, each rank hashing its share; None),
    or ({}, what failed) on every rank when any rank could not list or read its share."""
    try:
        sizes = checkpoint_files(path)
        local, failure = {n: [sizes[n], crc32(storage.join(path, n))] for n in _mine(sorted(sizes), group)}, None
    except Exception as exc:
        local, failure = {}, f"reading back {path} ({storage.describe(exc)})"
    shares: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, (local, failure), group=group)
    failures = [f for _, f in shares if f]
    if failures:
        return {}, failures[0]
    return {k: v for share, _ in shares for k, v in share.items()}, None


def check(path, files: dict[str, list], group=None) -> str | None:
    """Collective: None when every recorded file is there with its size and checksum, else what is
    wrong with the first bad file (the same answer on every rank)."""
    problems = []
    try:
        present = storage.files_under(path)
        for name in _mine(sorted(files), group):
            size, crc = files[name]
            file = storage.join(path, name)
            if name not in present:
                problems.append(f"{file} is missing")
            elif present[name] != size:
                problems.append(f"{file} has {present[name]} bytes, {size} when saved")
            elif crc32(file) != crc:
                problems.append(f"{file} does not match its checksum (corrupted since it was saved)")
    except Exception as exc:
        problems.append(f"{path} could not be read ({storage.describe(exc)})")
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    found = sorted(p for share in gathered for p in share)
    return found[0] if found else None
