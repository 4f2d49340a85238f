"""Ctrl-C (SIGINT) in a training process: stop now, keep nothing half-written, say so in one line.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be. Two places would take it
for something else: torch.distributed.checkpoint catches every exception of a save (KeyboardInterrupt
included) and gathers it into a CheckpointException, which looks like a storage fault; and a rank waiting in
a collective for an interrupted peer sees a broken connection. So the handler also records that an interrupt
arrived, and code that handles failures asks `interrupted()` before treating one as its own.

Under a launcher the terminal's Ctrl-C reaches every worker, and torchrun's agent forwards the SIGINT it got
a moment later: a second SIGINT within GRACE_S of the first is that echo and is ignored; a later one (the user
pressing Ctrl-C again while the stop hangs) leaves at once. Once interrupted, SIGTERM and SIGUSR1 (what the
agent sends while shutting down) no longer ask for an emergency checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
import time

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
GRACE_S = 3.0

_since: float | None = None


def interrupted() -> bool:
    """Whether this process received SIGINT (under `install`)."""
    return _since is not None


def _on_sigint(signum, frame) -> None:
    global _since
    if _since is not None:
        if time.monotonic() - _since > GRACE_S:
            os._exit(EXIT_INTERRUPTED)  # asked twice: the orderly stop is taking too long
        return
    _since = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)  # already stopping; no emergency save on the agent's echo
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT in this process as the module docstring says. Only the main thread can: training in another
    thread (a Ray Train worker) leaves Ctrl-C to its driver, which stops the workers."""
    global _since
    _since = None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
