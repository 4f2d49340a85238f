"""`torchrun` with a bounded exit barrier: `python -m disttrain.launch.agent [torchrun arguments]`.

When its workers finish, torchrun's agent waits for every other node's agent in an exit barrier of
300 s that no flag changes; a node that vanished after training finished keeps the survivors waiting
those 300 s. This runs torchrun's own `main` with its agent class swapped for one whose barrier lasts
DISTTRAIN_EXIT_BARRIER_S seconds (set by `disttrain train --exit-barrier-timeout`, default 30): long
enough for nodes that finish together (the end of a run is a collective), short for a lost node.

With DISTTRAIN_WORKER_START=fork on a machine without an accelerator, workers that are Python (`-m MODULE`
or a script) are forked from this process rather than started as fresh interpreters: a launch or restart
costs half the CPU time (launch/forked_worker.py says how). Fresh interpreters stay the default: forked
DDP workers spent 2.5% more CPU per token in the steady state here (docs/benchmarks/overhead.md).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import signal
import sys
import traceback

from torch.distributed import run
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher import api

from disttrain.core.errors import EXIT_HEALTH, EXIT_PREEMPTED, EXIT_STORAGE, EXIT_USAGE
from disttrain.core.interrupts import EXIT_INTERRUPTED
from disttrain.launch.this_process import exit_now


class BoundedExitBarrierAgent(LocalElasticAgent):
    def __init__(self, *args, **kwargs):
        kwargs["exit_barrier_timeout"] = float(os.environ.get("DISTTRAIN_EXIT_BARRIER_S", "30"))
        super().__init__(*args, **kwargs)


# Worker exit statuses that mean "disttrain already said why in one line": a user mistake found in the
# workers, a health check that stopped the run, a clean preemption (emergency checkpoint saved), a
# final save that storage refused, and Ctrl-C. torchrun's report would only repeat them.
QUIET_EXITS = (EXIT_USAGE, EXIT_HEALTH, EXIT_PREEMPTED, EXIT_STORAGE, EXIT_INTERRUPTED)


class _QuietExits(logging.Filter):
    """Drops the elastic agent's `failed (exitcode: N)` line for a quiet exit status, its `Sending process
    P closing signal SIGTERM` lines (stopping the other workers after the first one exits: no news, and the
    failure report names every worker's end), and its lines about passing a Ctrl-C on. The exit barrier's
    traceback, when another node's launcher has gone or does not arrive in time, becomes one line."""

    barrier_lost = False

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Error waiting on exit barrier"):  # another node's launcher has gone (or timed out)
            record.msg, record.args, record.exc_info, record.exc_text = EXIT_BARRIER_LOST, (), None, None
            self.barrier_lost = True
            return True
        if self.barrier_lost and "has failed to shutdown the rendezvous" in msg:
            return False  # the same news, from the rendezvous
        if msg.startswith(("Received %s death signal", "Closing process ")) and "SIGINT" in str(record.args):
            return False  # Ctrl-C passed on to the workers: they say where the run stopped
        if msg.startswith(("Sending process ", "Terminating process ")):  # the latter: forked workers' spawn
            return False
        return not (msg.startswith("failed (exitcode: ") and record.args and record.args[0] in QUIET_EXITS)


QUIET_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn",
                 "torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.rendezvous.dynamic_rendezvous")
EXIT_BARRIER_LOST = ("this node's workers finished; another node's launcher did not reach the exit barrier "
                     "(gone, or its rendezvous store is): not waiting for it")

# What a forked worker would import first: here once (torch's DTensor and DCP come with the builder; dynamo,
# 0.65 CPU-seconds, with the first model built on the meta device).
PRELOAD = ("disttrain.train.builder", "disttrain.train.loop", "torch._dynamo")
FORKED_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forked_worker.py")


def fork_workers(args) -> bool:
    """Whether to fork: asked for, Python workers, and no accelerator (a process that touched CUDA must not
    fork)."""
    if os.environ.get("DISTTRAIN_WORKER_START", "exec") != "fork" or args.no_python or args.run_path:
        return False
    import torch

    return torch.accelerator.current_accelerator() is None


def as_forked(args):
    """torchrun arguments that run the same workers forked: torchrun's `--run-path --start-method fork`
    on forked_worker.py, which runs the module or script. What the workers import is imported here
    first, once."""
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the children's collections then leave these objects' pages alone (no copy-on-write)

    target = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script_args = [*target, *args.training_script_args]
    args.training_script, args.module, args.run_path, args.start_method = FORKED_WORKER, False, True, "fork"
    return args


def _run_torchrun(argv: list[str]) -> None:
    """torchrun's `main` (parse, then run), forking the workers where fork_workers says so."""
    from torch.distributed.elastic.multiprocessing.errors import record

    args = run.parse_args(argv)
    if fork_workers(args):
        args = as_forked(args)
    record(run.run)(args)


def launch(argv: list[str]) -> tuple[int, str]:
    """torchrun's own `main` on `argv` in this process: (exit status, torchrun's failure report or "").
    A quiet first failure gives its status and no report."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    api.LocalElasticAgent = BoundedExitBarrierAgent  # what torchrun's launch_agent constructs
    quiet = _QuietExits()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        _run_torchrun(argv)
    except SystemExit as exc:  # torchrun's argument errors
        return (exc.code if isinstance(exc.code, int) else 2), ""
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()  # the cause; the agent then stops the other workers
        if first.exitcode in QUIET_EXITS:
            return first.exitcode, ""
        return 1, traceback.format_exc()
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:  # Ctrl-C: the agent passed it on; rank 0 said where the run stopped
            return EXIT_INTERRUPTED, ""
        return 1, traceback.format_exc()  # another handled signal: torchrun's report, as when it dies of it
    except Exception:
        return 1, traceback.format_exc()
    finally:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    return 0, ""


def run_agent(argv: list[str] | None = None) -> int:
    """torchrun's own `main` on `argv` in this process, its report on stderr; its exit status."""
    code, report = launch(argv if argv is not None else sys.argv[1:])
    if report:
        print(report, file=sys.stderr, end="", flush=True)
    return code


def main() -> None:
    exit_now(run_agent())


if __name__ == "__main__":
    main()
