"""A pre-imported interpreter that forks the suite's `python -m disttrain ...` commands.

Most of a short test run's CPU time is interpreter start-up: torch, DTensor (which pulls in sympy) and DCP
take about 3 CPU-seconds per process on this machine, more than the run itself, and the suite starts
hundreds of such commands. Each pytest worker starts this server once; every command is then a fork of it
with those modules already imported, given the command's own arguments, environment, working directory and
output files. The child undoes what a fresh interpreter would not have (signal handlers, the thread count
torch read at import) and leaves as `python -m` would: exit status, atexit functions, flushed streams.
Only modules that read no per-command environment at import are loaded here (not transformers): the
launcher's own, and what its agent preloads before forking workers (the builder, the loop, dynamo). Requests come one JSON line at a time on stdin; replies go to stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

import numpy  # noqa: F401
import torch
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401

import disttrain.cli  # noqa: F401
from disttrain.launch.agent import PRELOAD
from disttrain.launch import this_process

for _name in PRELOAD:  # what every training command imports: the builder, the loop, dynamo
    __import__(_name)

RESET_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE")


def _child(request: dict) -> None:
    """Run one command in this forked process and leave with its status; never returns."""
    code: int | str | None = 1
    try:
        for name in RESET_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        this_process.STARTED = time.time()
        sys.path[0] = request["cwd"]  # as `python -m` puts its working directory first
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # as an interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # what interpreter exit waits for: non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code or 0)


def serve() -> None:
    replies = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
