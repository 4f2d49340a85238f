"""The routing the dry run assumes for mixture-of-experts layers.

Which expert a token goes to is read from the data: the tokens per expert (`bincount`) and the all-to-all's
split sizes are shapes that only values give, and fake tensors have none (torch stops at `aten.bincount`,
a data-dependent output shape). A real run's routing is not known before it runs either, so the dry run
states one instead of guessing: balanced by default, or a skew s with the planner's meaning
(`--routing-skew`, plan/moe.py): the busiest expert-parallel rank receives s times its balanced share of
routed rows (at most all of them: s <= ep), spread evenly over its experts, and the other ranks share the
rest evenly. The simulated rank is taken to be the busiest one, so its peak is the job's worst.

Only the two places where the model reads counts off the data are substituted, by hooks this module
installs on the dry run's own model (`expert_counts` on each MoE layer, `host_counts` on its all-to-all
dispatch); the model's math for real runs is untouched. Every token still goes through the router and
the experts, so the shapes of routed rows, received rows and expert intermediates are those of the
stated routing. Capacity factors drop tokens by their values: not simulated (refused in `unsupported`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily


def spread(total: int, parts: int) -> list[int]:
    """`total` split into `parts` integers that differ by at most one (the first ones larger)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclass(frozen=True)
class AssumedRouting:
    """Routed rows per expert for `rows` assignments (tokens x top-k) of one rank, with this rank the
    busiest of `ep` expert-parallel ranks at skew `skew`."""

    skew: float = 1.0

    def counts(self, rows: int, num_experts: int, ep: int, busiest: int) -> list[int]:
        """What one source rank sends to each expert (every rank routes alike, so also what each sends)."""
        per_rank = num_experts // ep
        busy = min(rows, round(min(self.skew, ep) * rows / ep)) if ep > 1 else rows
        totals = [busy if r == busiest else 0 for r in range(ep)]
        others = iter(spread(rows - busy, ep - 1)) if ep > 1 else iter(())
        totals = [t if r == busiest else next(others) for r, t in enumerate(totals)]
        return [c for total in totals for c in spread(total, per_rank)]


class _LayerRouting:
    """Hooks for one MoE layer: its counts from the assumption, and the dispatch's host sync from the same."""

    def __init__(self, layer, assumed: AssumedRouting, ep: int, busiest: int):
        self.layer, self.assumed, self.ep, self.busiest = layer, assumed, ep, busiest
        self.rows = 0

    def expert_counts(self, flat: torch.Tensor) -> torch.Tensor:
        self.rows = flat.numel()
        counts = self.assumed.counts(self.rows, self.layer.num_experts, self.ep, self.busiest)
        with unset_fake_temporarily():  # a real tensor: the per-expert loop reads its values on the host
            return torch.tensor(counts, dtype=torch.int64, device=flat.device)

    def host_counts(self, counts: torch.Tensor) -> list:
        per_rank = self.layer.num_experts // self.ep
        sent = self.assumed.counts(self.rows, self.layer.num_experts, self.ep, self.busiest)
        mine = sent[self.busiest * per_rank:(self.busiest + 1) * per_rank]
        return [[sent[r * per_rank:(r + 1) * per_rank] for r in range(self.ep)], [list(mine)] * self.ep]


def assume_routing(layers: dict, ep: int, assumed: AssumedRouting) -> None:
    """Install the stated routing on a built model's MoE layers (`spec.moe_layers(model)`), after expert
    parallelism has set their dispatch."""
    for layer in layers.values():
        dispatch = getattr(layer, "expert_dispatch", None)
        busiest = dist.get_rank(dispatch.group) if dispatch is not None and ep > 1 else 0
        hooks = _LayerRouting(layer, assumed, ep, busiest)
        layer.expert_counts = hooks.expert_counts
        if dispatch is not None:
            dispatch.host_counts = hooks.host_counts
