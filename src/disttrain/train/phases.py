"""Where a step is: engines announce their phases, observers subscribe.

An engine's `train_step` is the training math wrapped in `with phases("forward", ...)` blocks
(forward, backward, reduce, optimizer, checkpoint; a pipeline's chunks nest inside its "pipeline"
phase). The step breakdown, the hang watchdog, test-only fault injection, the balancer's timer and
the dry run's memory trackers subscribe here, so an engine imports none of them and a new observer
touches no engine. A subscriber has `enter(event)` and `exit(event)`; exits run in reverse order.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

PHASES = ("forward", "backward", "reduce", "optimizer", "checkpoint", "pipeline")


@dataclass
class PhaseEvent:
    name: str  # one of PHASES
    step: int | None = None  # the optimizer step (None: evaluation, or outside a step)
    last: bool = True  # the step's last micro-batch (its backward carries the gradient reduction)
    module: Any = None  # a pipeline chunk's stage module (the dry run's trackers key statistics by it)
    loss: Any = None  # set by the engine inside "forward"; a subscriber may replace it (fault injection)
    depth: int = 0  # 0 for a phase of the step itself, 1 for a pipeline chunk inside "pipeline"


class Subscriber:
    """Both hooks optional: subclass and override what you need."""

    def enter(self, event: PhaseEvent) -> None: ...

    def exit(self, event: PhaseEvent) -> None: ...


class Phases:
    """The one announcement mechanism; cheap when nobody listens (a step has a few dozen phases)."""

    def __init__(self, *subscribers: Subscriber):
        self.subscribers: list[Subscriber] = list(subscribers)
        self.depth = 0

    def subscribe(self, subscriber: Subscriber, outermost: bool = False) -> None:
        """`outermost`: entered first and exited last, so it spans what the other subscribers do in the
        phase (the watchdog's "where is this rank" must hold while fault injection stalls inside it)."""
        if outermost:
            self.subscribers.insert(0, subscriber)
        else:
            self.subscribers.append(subscriber)

    @contextlib.contextmanager
    def __call__(self, name: str, step: int | None = None, last: bool = True, module: Any = None):
        event = PhaseEvent(name, step, last, module, depth=self.depth)
        for s in self.subscribers:
            s.enter(event)
        self.depth += 1
        try:
            yield event
        finally:
            self.depth -= 1
            for s in reversed(self.subscribers):
                s.exit(event)


class HostComputeClock(Subscriber):
    """Host seconds this rank spent computing in its latest training step: its forward passes, or its
    whole pipeline schedule (the per-rank compute figures that point at a straggler)."""

    def __init__(self):
        self.seconds, self.step = 0.0, None
        self._started: float | None = None

    def enter(self, event: PhaseEvent) -> None:
        if event.depth == 0 and event.step is not None and event.name in ("forward", "pipeline"):
            if event.step != self.step:
                self.seconds, self.step = 0.0, event.step
            self._started = time.perf_counter()

    def exit(self, event: PhaseEvent) -> None:
        if self._started is not None and event.depth == 0 and event.name in ("forward", "pipeline"):
            self.seconds += time.perf_counter() - self._started
            self._started = None
