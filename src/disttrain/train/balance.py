"""Uneven data-parallel shares: faster ranks take more micro-batches of the same global batch.

The sequences of a step never change (they come from (seed, step)); only how many of its
micro-batches each data-parallel rank computes. With `parallel.balance=auto` every rank times its
forward passes, and every `parallel.balance_every` steps the ranks exchange one small all-gather and
each computes the same new split from the same numbers (shares in inverse proportion to the time per
micro-batch). Splits take effect at the next step and are recorded in metrics.jsonl and checkpoints.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from disttrain.layout.layout import Layout
from disttrain.layout.splits import balance_shares
from disttrain.train.phases import PhaseEvent, Subscriber

log = logging.getLogger(__name__)


class ComputeTimer(Subscriber):
    """Forward time per training micro-batch on this rank, with the step breakdown's clock (host clock on CPU,
    CUDA events on GPU, read only at a re-split, so no host sync per step). Backward scales with forward."""

    def __init__(self, clock):
        self.clock = clock
        self.spans: list[tuple[object, object]] = []
        self.seconds, self.count = 0.0, 0
        self._start = None

    def enter(self, event: PhaseEvent) -> None:
        if event.name == "forward" and event.depth == 0 and event.step is not None:
            self._start = self.clock()

    def exit(self, event: PhaseEvent) -> None:
        if self._start is not None and event.name == "forward" and event.depth == 0:
            self.add(self._start, self.clock())
            self._start = None

    def add(self, start, end) -> None:
        if isinstance(start, float):
            self.seconds += end - start
        else:
            self.spans.append((start, end))
        self.count += 1

    def take(self) -> tuple[float, int]:
        if self.spans:
            self.spans[-1][1].synchronize()
            self.seconds += sum(s.elapsed_time(e) / 1000.0 for s, e in self.spans)
            self.spans.clear()
        out = (self.seconds, self.count)
        self.seconds, self.count = 0.0, 0
        return out


class Balancer:
    """The current split of the global batch over data-parallel ranks, and (auto) its re-splitting."""

    def __init__(self, layout: Layout, dp_rank: int, every: int, clock):
        self.layout, self.dp_rank, self.every = layout, dp_rank, every
        self.auto = layout.balance == "auto" and layout.dp > 1
        self.shares = layout.initial_shares() if layout.balanced else []
        self.timer = ComputeTimer(clock) if self.auto else None  # subscribes to the engine's phases
        self.group = dist.new_group(backend="gloo") if self.auto else None  # CPU: no device sync

    def due(self, step: int) -> bool:
        return self.auto and step % self.every == 0

    def measure(self) -> list[float] | None:
        """Collective (the balance group): seconds per micro-batch of each data-parallel rank, the
        slowest of its tensor-parallel members; None until every rank has a measurement."""
        seconds, count = self.timer.take()
        mine = torch.tensor([float(self.dp_rank), seconds, float(count)], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, mine, group=self.group)
        per_rank = [0.0] * self.layout.dp
        for dp_rank, s, n in (g.tolist() for g in gathered):
            if n == 0:
                return None
            per_rank[int(dp_rank)] = max(per_rank[int(dp_rank)], s / n)
        return per_rank

    def rebalance(self, step: int) -> dict | None:
        """At a re-split point: the new shares from measured speed (the same on every rank), or None
        when nothing changes. Returns the event to record."""
        per_mb = self.measure()
        if per_mb is None or min(per_mb) <= 0:
            return None
        new = balance_shares(self.layout.total_microbatches, [1.0 / t for t in per_mb])
        event = {"step": step, "shares": new, "previous_shares": self.shares,
                 "seconds_per_micro_batch": [round(t, 6) for t in per_mb]}
        if new == self.shares:
            return None
        self.shares = new
        return event

    def state_dict(self) -> dict:
        return {"shares": self.shares, "dp": self.layout.dp, "auto": self.auto}

    def load_state_dict(self, state: dict | None) -> None:
        """Auto re-splits continue from the saved split when the data-parallel size is unchanged; fixed
        weights always come from the config (they are a setting, not a measurement)."""
        if not state or not self.auto or state.get("dp") != self.layout.dp or not state.get("auto"):
            return
        self.shares = list(state["shares"])
        log.info("balance: resumed with shares %s", self.shares)
