"""The MoE feed-forward layer: route, sort token rows by expert, run the experts, combine; shared experts.

Single-device code with two places parallelism plugs into from outside (parallel/expert.py):
- `expert_dispatch`: runs expert-sorted rows through their experts. None runs them here; expert
  parallelism puts an all-to-all exchange there.
- `trial_pass`: says when a forward is none of the training's (a pipeline stage's shape inference).
- `stats_group`: the gradient ranks' group (data x context parallel) the routing statistics are summed
  over, so that the balancing loss, the balancing bias and the reported loads are those of the whole
  global batch on every layout (one all-reduce of 2E + 3 numbers per layer and micro-batch).
  `aux_grad_scale` turns the local share of that loss into this rank's part of the global objective
  (gradient ranks / micro-batches).

Routing statistics of a training step (tokens each expert was chosen for, dropped tokens, probability
mass, entropy, the balancing loss) accumulate over its micro-batches, skipping activation-checkpoint
recomputation; `finish_step` moves them to `last_step` and, with a bias update rate, moves the bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from disttrain.models.moe.experts import GroupedExperts
from disttrain.models.moe.router import Router


@dataclass(frozen=True)
class MoERouting:
    """How the router trains (model.moe.*), apart from the shape."""

    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float = 0.0  # 0: dropless


class _AttachAuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; in backward gives `aux` the gradient `scale`, as if `scale * aux` were
    added to the loss. Works wherever the layer sits: a pipeline's middle stage, a checkpointed block."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def _recomputing() -> bool:
    """Inside backward: activation checkpointing re-running the forward (its statistics were counted)."""
    return torch._C._current_graph_task_id() != -1


class RoutedExperts:
    """Routed tokens through experts and back, with the routing statistics: shared by the built-in layer and
    transformers' MoE blocks (models/hf/moe.py). `experts` is the module whose 3-D parameters expert
    parallelism splits; `compute_experts(rows, counts, counts_list)` runs expert-sorted rows through it."""

    def init_routing(self, num_experts: int, top_k: int, routing: MoERouting) -> None:
        self.num_experts, self.top_k, self.routing = num_experts, top_k, routing
        self.expert_dispatch = None
        self.stats_group = None
        self.aux_grad_scale = 1.0
        self.trial_pass = None  # a callable saying this forward is not training (a pipeline's shape inference)
        self.routed_rows: torch.Tensor | None = None  # token rows to route (None: all); see models/moe/padding.py
        self.routed_rows_of = 0  # ... out of this many (the forward's tokens)
        self.step_stats: torch.Tensor | None = None  # [counts (E), dropped, aux loss, entropy sum, tokens, rounds]
        self.last_step: torch.Tensor | None = None
        self.stats_local = False  # the latest statistics (step_stats; last_step after finish_step) are per rank

    def release_compute_copies(self) -> None:
        """Drop the experts' autocast weight copies (models/moe/experts.py AutocastWeights)."""
        release = getattr(getattr(self, "experts", None), "release_compute_copies", None)
        if release is not None:
            release()

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor | None,
               training: bool) -> torch.Tensor:
        """x (tokens, dim), the router's choice (weights and experts (tokens, k)) and probabilities over all
        experts (None: not known, no balancing loss) -> the weighted sum of the chosen experts' outputs.
        Rows left out of `routed_rows` (padding) reach no expert, count in no statistic and get zeros."""
        keep, rows_of = self.routed_rows, self.routed_rows_of
        if keep is None or keep.numel() == x.shape[0] or rows_of != x.shape[0]:  # all rows, or another input's
            return self._route(x, weights, experts, probs, training)
        inner = self._route(x[keep], weights[keep], experts[keep], probs[keep] if probs is not None else None,
                            training)
        return torch.zeros_like(x).index_copy(0, keep, inner)

    def _route(self, x, weights, experts, probs, training: bool) -> torch.Tensor:
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, in token order within one
        counts = self.expert_counts(flat)
        kept, dropped = counts, None
        if self.routing.capacity_factor:
            order, kept, dropped = self._drop_overflow(flat, order, counts)
        token = order // self.top_k
        rows = x[token]
        compute = self.compute_experts
        y = compute(rows, kept, None) if self.expert_dispatch is None else self.expert_dispatch(rows, kept, compute)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x).index_add(0, token, y.to(x.dtype))
        if training and torch.is_grad_enabled() and not (self.trial_pass and self.trial_pass()):
            out = self._account(out, counts, dropped, probs)
        return out

    def expert_counts(self, flat: torch.Tensor) -> torch.Tensor:
        """Assignments per expert: a shape read from the data, which the dry run's fake tensors do not have
        (it substitutes a stated routing: dryrun/routing.py)."""
        return torch.bincount(flat, minlength=self.num_experts)

    def _drop_overflow(self, flat, order, counts):
        """Each expert keeps its first `capacity` assignments (in token order); the rest contribute nothing."""
        capacity = math.ceil(self.routing.capacity_factor * flat.numel() / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        keep = position < capacity
        return order[keep], counts.clamp(max=capacity), (~keep).sum()

    def _account(self, out: torch.Tensor, counts, dropped, probs: torch.Tensor) -> torch.Tensor:
        """Routing statistics of this micro-batch and the balancing loss attached to `out`. The loss needs the
        global batch's loads now (one all-reduce per layer and micro-batch); without it, the step's local sums
        wait for `reduce_routing_statistics`, which reduces every layer's in one all-reduce on the steps that read
        them (a bias update, a logging step)."""
        e = self.num_experts
        coef = self.routing.aux_loss_coef
        if probs is None:  # a router whose probabilities are unknown: loads only
            probs = torch.zeros(out.shape[0], e, dtype=torch.float64, device=out.device)
        p = probs.detach().double()
        entropy = -(p * p.clamp_min(1e-30).log()).sum()
        local = torch.cat([counts.double(), p.sum(0), torch.stack([
            dropped.double() if dropped is not None else p.new_zeros(()), entropy, p.new_tensor(float(p.shape[0]))])])
        if self.stats_group is not None and coef:
            dist.all_reduce(local, group=self.stats_group)
        g_counts, g_probs, tokens = local[:e], local[e:2 * e], local[-1]
        load = g_counts / (tokens * self.top_k)  # fraction of the global batch's assignments per expert
        aux_value = coef * e * (load * g_probs / tokens).sum()
        if coef:
            local_aux = coef * e * (load.to(probs.dtype) * probs.sum(0)).sum() / tokens.to(probs.dtype)
            out = _AttachAuxLoss.apply(out, local_aux, self.aux_grad_scale)
        if not _recomputing():
            row = torch.cat([g_counts, torch.stack([local[2 * e], aux_value, local[2 * e + 1], tokens,
                                                    torch.ones_like(tokens)])])
            self.step_stats = row if self.step_stats is None else self.step_stats + row
            self.stats_local = self.stats_group is not None and not coef  # no balancing loss summed them
        return out

    @torch.no_grad()
    def finish_step(self, updated: bool) -> None:
        """After the optimizer step: keep the step's statistics for reporting; move the bias (when the
        step updated the parameters; by global counts: `reduce_routing_statistics` first when `stats_local`).
        Evaluation never gets here: its forward passes count nothing."""
        self.release_compute_copies()  # the weights change: their autocast copies with them
        if self.step_stats is None:
            return
        self.last_step, self.step_stats = self.step_stats, None
        if updated and self.routing.bias_update_rate:
            self.update_bias(self.last_step[:self.num_experts], self.routing.bias_update_rate)

    def step_summary(self) -> dict | None:
        """The last training step's routing over its global batch (host sync), or None before one.
        Per-rank statistics (`stats_local`) are summed first by `reduce_routing_statistics`."""
        if self.last_step is None:
            return None
        values = self.last_step.tolist()
        e = self.num_experts
        counts, (dropped, aux, entropy, tokens, rounds) = values[:e], values[e:]
        mean = sum(counts) / e
        return {"tokens_per_expert": [int(c) for c in counts], "load_imbalance": max(counts) / mean if mean else 0.0,
                "max_imbalance": e / self.top_k,  # every token on the same top_k experts
                "dropped_tokens": int(dropped), "aux_loss": aux / rounds, "router_entropy": entropy / tokens}


@torch.no_grad()
def reduce_routing_statistics(layers) -> None:
    """Sum the latest per-rank statistics of every layer holding them over the gradient ranks (`stats_group`:
    data x context parallel) in one all-reduce (the micro-batch count, last, is the same on every rank).
    Collective: every rank calls it at the same point (after a step that moves the bias, or on a logging
    step)."""
    local = [layer for layer in layers if layer.stats_local]
    if not local:
        return
    stats = [layer.step_stats if layer.step_stats is not None else layer.last_step for layer in local]
    flat = torch.cat([s[:-1] for s in stats])
    dist.all_reduce(flat, group=local[0].stats_group)
    for layer, s, part in zip(local, stats, flat.split([s.numel() - 1 for s in stats])):
        s[:-1] = part
        layer.stats_local = False


class MoEFeedForward(RoutedExperts, nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int, n_shared: int, scoring_func: str,
                 routing: MoERouting, shared_expert: nn.Module | None = None):
        nn.Module.__init__(self)
        self.init_routing(num_experts, top_k, routing)
        self.router = Router(dim, num_experts, top_k, scoring_func)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared_experts = shared_expert if n_shared else None

    def compute_experts(self, rows, counts, counts_list):
        return self.experts(rows, counts, counts_list)

    def update_bias(self, counts: torch.Tensor, rate: float) -> None:
        self.router.update_bias(counts, rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, probs = self.router(x)
        out = self.routed(x, weights, experts, probs, self.training)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)
