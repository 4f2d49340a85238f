"""Preemption and hang handling.

Preemption: SIGTERM or SIGUSR1 (what SLURM and Kubernetes send before killing) only sets a flag.
At each step boundary the ranks agree through one small all-reduce on a CPU (gloo) control group,
so every rank saves the emergency checkpoint at the same step, then exits with EXIT_PREEMPTED.

Watchdog: a daemon thread per rank. When no step completes within max(min_seconds,
factor x median step time), it writes every thread's stack (faulthandler) and the trainer's current
phase to the rank's log, names the rank(s) whose last completed step is oldest (from heartbeats each
rank's thread publishes in the job's key-value store, which works while collectives hang), and
exits with EXIT_HANG so the launcher restarts the group.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import statistics
import threading
import time
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from disttrain.core.errors import EXIT_HANG, EXIT_PREEMPTED
from disttrain.train.phases import PhaseEvent, Subscriber

log = logging.getLogger(__name__)

__all__ = ["EXIT_HANG", "EXIT_PREEMPTED", "Decision", "StepControl", "Watchdog", "NullWatchdog",
           "note_preemption_signal"]
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_noted: list[int] = []  # preemption signals caught by a handler of the main thread while training runs in another


def note_preemption_signal(signum: int) -> None:
    """For a process whose training runs outside its main thread (a Ray Train worker: launch/ray_worker.py), where
    only the main thread can handle signals: its handler calls this, and StepControl reads it at the next step
    boundary as if its own handler had caught the signal."""
    _noted.append(signum)


class Decision(NamedTuple):
    save_due: bool  # the time-based checkpoint interval elapsed (rank 0's clock)
    preempted: bool  # some rank received SIGTERM/SIGUSR1
    write_pending: bool  # some rank's async checkpoint write is still running
    stop: bool = False  # some rank's job asked the run to stop (Trainer.request_stop)


class StepControl:
    """Per-step agreement on 'save now' (time trigger) and 'stop now' (preemption, or a job's request)."""

    def __init__(self, every_minutes: float, rank: int):
        self.every_s = 60 * every_minutes
        self.rank = rank
        self.preempt_signal: int | None = None
        # Under torchrun the agent is this process's parent. An agent killed by a signal it does not
        # handle (plain torchrun and SIGUSR1) leaves its workers orphaned in their own sessions: a
        # changed parent counts as preemption, so they still save and stop before the scheduler's kill.
        self.agent_pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self.last_save = time.monotonic()
        self.group = dist.new_group(backend="gloo")  # CPU: no device sync in the hot path
        if threading.current_thread() is threading.main_thread():  # else the main thread's handler notes them
            for sig in PREEMPT_SIGNALS:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.preempt_signal = signum

    def decide(self, write_pending: bool = False, stop: bool = False) -> Decision:
        """Collective: one small all-reduce (MAX) of this rank's four flags."""
        due = self.rank == 0 and self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s
        if self.preempt_signal is None and _noted:
            self.preempt_signal = _noted[-1]
            _noted.clear()  # read once: a later run in this process starts without it
        if self.agent_pid is not None and self.preempt_signal is None and os.getppid() != self.agent_pid:
            log.warning("the launcher (pid %d) is gone: saving an emergency checkpoint and stopping", self.agent_pid)
            self.preempt_signal = signal.SIGHUP
        flags = torch.tensor([float(due), float(self.preempt_signal is not None), float(write_pending), float(stop)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return Decision(*(bool(f) for f in flags.tolist()))  # a CPU tensor: one read, no device sync

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def close(self) -> None:
        for sig in PREEMPT_SIGNALS:
            if signal.getsignal(sig) == self._on_signal:  # not one a Ctrl-C set meanwhile (core/interrupts.py)
                signal.signal(sig, signal.SIG_DFL)


class Watchdog:
    def __init__(self, rank: int, world_size: int, factor: float, min_seconds: float, log_file: str | None):
        self.rank, self.world = rank, world_size
        self.factor, self.min_seconds = factor, min_seconds
        self.log_file = log_file
        self.step = 0
        self.phase, self.in_collective = "starting", False
        self.last_progress = time.monotonic()
        self.durations: deque[float] = deque(maxlen=50)
        self._stop = threading.Event()
        self._store = dist.distributed_c10d._get_default_store()  # private, but the job's own store
        self._thread = threading.Thread(target=self._run, name="disttrain-watchdog", daemon=True)
        self._thread.start()

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        self.durations.append(now - self.last_progress)
        self.step, self.last_progress = step, now
        self.enter(f"after step {step}")

    def enter(self, phase: str, collective: bool = False) -> None:
        """Where this rank is; a rank waiting in a collective is a victim of a hang, not its cause."""
        self.phase, self.in_collective = phase, collective

    def touch(self) -> None:
        """Work between steps (evaluation, saving) counts as progress, not as step time."""
        self.last_progress = time.monotonic()

    def limit(self) -> float:
        median = statistics.median(self.durations) if self.durations else 0.0
        return max(self.min_seconds, self.factor * median)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._store.set(f"disttrain/heartbeat/{self.rank}",
                                f"{self.step}|{int(self.in_collective)}|{self.phase}")
            except Exception:  # the store's host died: the launcher handles that
                pass
            idle = time.monotonic() - self.last_progress
            if idle > self.limit():
                self._fire(idle)

    def _stalled_ranks(self) -> str:
        """The ranks furthest behind; among those, the ones not waiting in a collective."""
        try:
            beats = {r: self._store.get(f"disttrain/heartbeat/{r}").decode().split("|", 2) for r in range(self.world)}
        except Exception:
            return "unknown (heartbeats unavailable)"
        oldest = min(int(b[0]) for b in beats.values())
        behind = {r: b for r, b in beats.items() if int(b[0]) == oldest}
        culprits = {r: b for r, b in behind.items() if b[1] == "0"} or behind
        where = "; ".join(f"rank {r}: {b[2]}" for r, b in sorted(beats.items()))
        return f"{', '.join(map(str, sorted(culprits)))} (last completed step {oldest}; {where})"

    def _fire(self, idle: float) -> None:
        msg = (f"watchdog: rank {self.rank} completed no step for {idle:.0f} s (limit {self.limit():.0f} s) after "
               f"step {self.step}, in '{self.phase}'; stalled rank(s): {self._stalled_ranks()}; "
               "thread stacks follow")
        log.error(msg)
        for handler in logging.getLogger("disttrain").handlers:
            handler.flush()
        if self.log_file:
            with open(self.log_file, "a") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(EXIT_HANG)

    def close(self) -> None:
        self._stop.set()


class WatchdogPhases(Subscriber):
    """Tells the watchdog where the step is from the engine's phases: its own compute (forward) or a phase
    holding collectives (a rank waiting there is a victim of a hang, not its cause); back to the enclosing
    phase on exit."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog
        self.outer: list[tuple[str, bool]] = []

    def enter(self, event: PhaseEvent) -> None:
        w = self.watchdog
        self.outer.append((w.phase, w.in_collective))
        where = f"step {event.step}: {event.name}" if event.step is not None else f"{w.phase}: {event.name}"
        w.enter(where, collective=event.name != "forward")

    def exit(self, event: PhaseEvent) -> None:
        self.watchdog.enter(*self.outer.pop())


class NullWatchdog:
    """Stands in when `distributed.watchdog_factor=0`, so the loop needs no checks."""

    def step_done(self, step: int) -> None: ...

    def enter(self, phase: str, collective: bool = False) -> None: ...

    def touch(self) -> None: ...

    def close(self) -> None: ...
