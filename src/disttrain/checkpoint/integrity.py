"""Checksums of every checkpoint file, recorded in COMMIT and verified before a resume.

Sizes alone miss a flipped bit on a flaky disk or a bad network-filesystem cache. CRC-32 (zlib, a
few GB/s) of every file is computed when a checkpoint commits and checked before one is loaded.
Both are spread over the ranks: the sorted file list is dealt round-robin, each rank reads its
share, and the results meet in one all-gather, so no rank reads the whole checkpoint.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch.distributed as dist

CHUNK = 8 << 20
SKIP = ("COMMIT", "COMMIT.tmp")


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def checkpoint_files(path: Path) -> list[str]:
    """Every file of a checkpoint directory (subfolders included), relative, sorted."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name not in SKIP)


def _mine(names: list[str], group) -> list[str]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return [n for i, n in enumerate(names) if i % world == rank]


def record(path: Path, group=None) -> dict[str, list]:
    """Collective: {file: [size, crc32]} for every file under `path`, each rank hashing its share."""
    names = checkpoint_files(path)
    local = {n: [(path / n).stat().st_size, crc32(path / n)] for n in _mine(names, group)}
    shares: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, local, group=group)
    return {k: v for share in shares for k, v in share.items()}


def check(path: Path, files: dict[str, list], group=None) -> str | None:
    """Collective: None when every recorded file is there with its size and checksum, else what is
    wrong with the first bad file (the same answer on every rank)."""
    problems = []
    for name in _mine(sorted(files), group):
        size, crc = files[name]
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{file} has {file.stat().st_size} bytes, {size} when saved")
        elif crc32(file) != crc:
            problems.append(f"{file} does not match its checksum (corrupted since it was saved)")
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    found = sorted(p for share in gathered for p in share)
    return found[0] if found else None
