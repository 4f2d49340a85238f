"""This process: when it started, whether it was forked from its launcher, and leaving it quickly once its
work is done."""

from __future__ import annotations

import atexit
import os
import sys
import time

STARTED = time.time()  # before torch is imported: recovery benchmarks split start-up time (reset in a fork)
# Set by disttrain.launch.forked_worker in a worker forked from its launcher: there the process
# must end through torchrun's child (which reports a success back), so exit_now raises instead.
FORKED_WORKER = False
STARTED_BY_FORK = False  # this process is a worker forked from its launcher (its start line says so)


def exit_now(code: int | str | None = 0) -> None:
    """Exit with `code` as `sys.exit` would, without the interpreter's teardown of every module: with
    torch and the distributed stack imported that takes 0.3-0.9 s per process, paid by every worker
    and agent of every launch. atexit handlers still run (logging flushes and closes its files) and
    the standard streams are flushed; callers have closed their own files (the trainer closes its
    sinks). Without torch loaded there is nothing to save: a plain exit."""
    if "torch" not in sys.modules or FORKED_WORKER:
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)
