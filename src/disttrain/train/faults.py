"""Test-only fault injection, off unless DISTTRAIN_FAULT is set. Used by the fault-tolerance tests
to kill, signal or stall one rank at a chosen step of the first attempt (not after a restart):

    DISTTRAIN_FAULT="kill:rank=1:step=7"            SIGKILL itself after step 7
    DISTTRAIN_FAULT="signal:rank=0:step=5:sig=TERM" send itself SIGTERM after step 5
    DISTTRAIN_FAULT="sleep:rank=1:step=4:seconds=600" stop stepping after step 4 (until SIGTERM/SIGUSR1: a
                                                    stalled rank that a scheduler then preempts)
    DISTTRAIN_FAULT="kill_after_save:rank=1:step=8" SIGKILL right after step 8's save began
    DISTTRAIN_FAULT="pause_after_save:rank=0:step=8:seconds=3" wait 3 s after step 8's save began (an async
                                                    save: its data is written, COMMIT not yet; the test
                                                    takes the store away meanwhile)
    DISTTRAIN_FAULT="nan:rank=0:step=3"             make this rank's loss NaN in step 3
    DISTTRAIN_FAULT="desync:rank=1:step=4"          nudge one parameter on this rank after step 4
    DISTTRAIN_FAULT="slow:rank=1:step=0:seconds=0.05" sleep before every step's forward (a straggler)
    DISTTRAIN_FAULT="kill_agent_at_exit:rank=1:step=0" SIGKILL the torchrun agent as this worker finishes
                                                    (a node that vanishes once training is done)
    (add ":attempts=all" to apply a fault after restarts too; by default only the first attempt has it;
    several faults, one per rank, are separated by ";": "sleep:rank=1:step=5:seconds=600;pause_after_save:rank=0:...")
    DISTTRAIN_FAULT="slowdown:rank=1:step=0:factor=2" every forward and backward takes 2x as long (a slower GPU)
    DISTTRAIN_FAULT="hang_backward:rank=1:step=5:seconds=600" stop inside step 5's (first) backward
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    sig: str = "TERM"
    seconds: float = 0.0
    factor: float = 1.0
    every_attempt: bool = False


def parse_fault(spec: str | None) -> Fault | None:
    if not spec:
        return None
    kind, *fields = spec.split(":")
    kv = dict(f.split("=", 1) for f in fields)
    return Fault(kind, int(kv["rank"]), int(kv["step"]), kv.get("sig", "TERM"), float(kv.get("seconds", 0)),
                 float(kv.get("factor", 1)), kv.get("attempts", "first") == "all")


class FaultInjector:
    def __init__(self, rank: int, environ=os.environ):
        faults = [parse_fault(spec) for spec in (environ.get("DISTTRAIN_FAULT") or "").split(";")]
        fault = next((f for f in faults if f is not None and f.rank == rank), None)
        first_attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.fault = fault if fault and fault.rank == rank and (first_attempt or fault.every_attempt) else None
        self._phase_start = time.perf_counter()

    def _record(self, kind: str, step: int) -> None:
        """DISTTRAIN_FAULT_LOG names a file that gets the moment of the fault (for recovery benchmarks)."""
        path = os.environ.get("DISTTRAIN_FAULT_LOG")
        if path:
            with open(path, "a") as f:
                f.write(f'{{"fault": "{kind}", "step": {step}, "time": {time.time()}}}\n')

    def at_exit(self) -> None:
        """Called after a run completed, just before the worker exits 0."""
        if self.fault is not None and self.fault.kind == "kill_agent_at_exit":
            self._record(self.fault.kind, 0)
            os.kill(os.getppid(), signal.SIGKILL)

    def after_save(self, step: int) -> None:
        f = self.fault
        if f is not None and f.kind == "kill_after_save" and step == f.step:
            self._record(f.kind, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if f is not None and f.kind == "pause_after_save" and step == f.step:
            self._record(f.kind, step)
            time.sleep(f.seconds)

    # ------------------------------------------------------------ phase subscriber (train/phases.py)
    def enter(self, event) -> None:
        if self.fault is not None and event.step is not None and event.depth == 0 and event.name in ("forward", "pipeline"):
            self.before_forward()

    def exit(self, event) -> None:
        if self.fault is None or event.step is None:
            return
        if event.name == "forward":
            self.after_forward()
        elif event.name == "backward":
            self.after_backward(event.step)
        if event.depth == 0 and event.name in ("forward", "pipeline"):
            event.loss = self.corrupt_loss(event.step, event.loss)

    def corrupt_loss(self, step: int, loss):
        f = self.fault
        if f is not None and f.kind == "nan" and step == f.step:
            self._record(f.kind, step)
            return loss * float("nan")
        return loss

    def before_forward(self) -> None:
        if self.fault is not None and self.fault.kind == "slow":
            time.sleep(self.fault.seconds)
        self._phase_start = time.perf_counter()

    def after_forward(self) -> None:
        self._stretch()

    def after_backward(self, step: int | None = None) -> None:
        f = self.fault
        if f is not None and f.kind == "hang_backward" and step == f.step:
            self._record(f.kind, step)
            time.sleep(f.seconds)
        self._stretch()

    def _stretch(self) -> None:
        """`slowdown`: wait (factor - 1) x the phase that just ran, so it took factor x as long."""
        now = time.perf_counter()
        if self.fault is not None and self.fault.kind == "slowdown":
            time.sleep((self.fault.factor - 1) * (now - self._phase_start))
        self._phase_start = time.perf_counter()

    def after_step(self, step: int, model=None) -> None:
        f = self.fault
        if f is None or step != f.step or f.kind == "pause_after_save":
            return
        if f.kind == "desync":
            import torch

            with torch.no_grad():
                next(p for p in model.parameters() if p.ndim >= 2).add_(1e-3)  # the first matrix
            self._record(f.kind, step)
            return
        self._record(f.kind, step)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "signal":
            os.kill(os.getpid(), getattr(signal, f"SIG{f.sig}"))
        elif f.kind == "sleep":
            _sleep_until_preempted(f.seconds)


def _sleep_until_preempted(seconds: float) -> None:
    """Sleep, cut short by SIGTERM or SIGUSR1, which the run's own handler (resilience.StepControl) still gets:
    a stalled rank is woken by a preemption and saves with the others (a plain sleep would resume after the
    handler and hold every rank until the launcher's kill)."""
    woke: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def wake(signum, frame):
        woke.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)

    for sig in previous:
        signal.signal(sig, wake)
    deadline = time.monotonic() + seconds
    try:
        while not woke and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
