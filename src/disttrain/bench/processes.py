"""Killing a launcher with everything it started, as a lost node loses it (tests and benchmarks).

torchrun starts workers in sessions of their own, so a process group kill misses them: walk the
children instead."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """The process and its descendants."""
    tree = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            children = []
        for child in children:
            tree += process_tree(int(child))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL the process and all its descendants at once."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
