"""A worker forked from its launcher: what torchrun runs, in the child, when workers are forked.

torchrun starts each worker as a fresh interpreter, which imports torch, DTensor and DCP again: about
2.5 CPU-seconds per process before any work, paid again at every restart. On a machine without an
accelerator, with DISTTRAIN_WORKER_START=fork (the test suite's setting), the launcher (torchrun's agent,
in this process) forks its workers instead, with those modules already imported, through torchrun's own
`--run-path --start-method fork` (launch/agent.py decides). torchrun runs this file with sys.argv set to
`[this file, "-m", MODULE, args...]` or `[this file, SCRIPT, args...]`.

A forked child inherits what a fresh interpreter would not have, and this undoes it first: the
launcher's signal handlers (torchrun's agent turns SIGTERM into an exception), its atexit functions
(the launcher's own clean-up must not run in a worker) and the thread count torch read at the
launcher's start. A worker that succeeds returns, so that torchrun's child reports its result; one
that fails leaves at once with its exit status, as a fresh process would.

A returned worker then waits in torchrun's child until the launcher has read its result. It also holds
copies of the launcher's sockets, the rendezvous store's among them: were the launcher to die then (a node
that vanishes as training ends), a worker left waiting would keep that store's port open and mute, and the
other nodes' launchers would hang on it in their exit barrier. So a returned worker dies with its launcher.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import time

from disttrain.launch import this_process

RESET_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _fresh_process_state() -> None:
    atexit._clear()
    for name in RESET_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def main() -> None:
    this_process.STARTED = time.time()  # this worker's start, not the launcher's
    this_process.STARTED_BY_FORK = True
    launcher = os.getppid()
    _fresh_process_state()
    this_process.FORKED_WORKER = True  # exit_now raises SystemExit here instead of leaving the process
    args = sys.argv[1:]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    this_process.FORKED_WORKER = False
    if code not in (0, None):
        this_process.exit_now(code)
    atexit._run_exitfuncs()  # the worker's own (logging closes its files); torchrun's child then exits
    _die_with_launcher(launcher)


def _die_with_launcher(launcher: int) -> None:
    """SIGKILL this finished worker when the launcher that forked it dies (Linux), or now if it already has.
    torch's child asks for a SIGINT then, which a worker may take at a moment that drops it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher:
        os._exit(0)


if __name__ == "__main__":
    main()
