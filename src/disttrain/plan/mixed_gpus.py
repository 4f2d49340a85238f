"""Planning for a cluster of mixed GPU types: which layout, and what share of the batch each rank takes.

A model replica (its tp x pp GPUs) is made of one GPU type; data-parallel ranks of different types
take uneven shares of the global batch in whole micro-batches (`parallel.balance_weights`), inverse
to each type's modelled time per micro-batch (compute and tensor-parallel communication; peak FLOP/s
alone misses the communication share), which the runtime then refines from measured speed
(`balance=auto`).
Memory does not grow with a rank's share (micro-batches run one after another), so a layout fits
when it fits the GPU type with the least memory. Step time: the slowest rank's micro-batches times
its time per micro-batch, plus the data-parallel communication of the slowest link. Pipelines keep
equal shares (a schedule runs the same micro-batches on every rank), so their pace is the slowest type's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from disttrain.core.gpus import GPUSpec, find_gpu
from disttrain.layout.layout import Layout
from disttrain.layout.rules import layout_problems
from disttrain.layout.splits import balance_shares
from disttrain.models.shape import ModelShape
from disttrain.plan.estimate import Estimate, estimate
from disttrain.plan.search import SearchSpace, layout_families, micro_batch_sizes, reduced_every_microbatch
from disttrain.plan.timing import Cluster


@dataclass(frozen=True)
class GPUGroup:
    count: int
    gpu: GPUSpec


def parse_cluster(text: str) -> list[GPUGroup]:
    """'8xa100-80g,8xv100-32g' -> groups in rank order (ValueError names the part it cannot read)."""
    groups = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*[x*]\s*([\w.-]+)\s*", part)
        if not match or int(match.group(1)) < 1:
            raise ValueError(f"{part.strip()!r}: expected COUNTxGPU, e.g. 8xa100-80g")
        groups.append(GPUGroup(int(match.group(1)), find_gpu(match.group(2))))
    return groups


@dataclass
class MixedPlan:
    estimate: Estimate  # the layout (with balance weights) and its memory, at the least-memory GPU type
    rank_types: list[str]  # GPU type of each data-parallel rank
    shares: list[int]  # micro-batches per data-parallel rank
    per_micro_batch_s: dict[str, float]  # forward + backward of one micro-batch, per GPU type
    step_s: float
    equal_step_s: float  # the same layout with equal shares
    fits: dict[str, bool]

    @property
    def tokens_per_s(self) -> float:
        return self.estimate.tokens_per_step / self.step_s

    def as_dict(self) -> dict:
        return {"layout": self.estimate.layout.as_dict(), "bytes_per_rank": self.estimate.memory.as_dict(),
                "rank_types": self.rank_types, "shares": self.shares, "per_micro_batch_s": self.per_micro_batch_s,
                "step_s": self.step_s, "equal_shares_step_s": self.equal_step_s, "tokens_per_s": self.tokens_per_s,
                "speedup_over_equal_shares": self.equal_step_s / self.step_s, "fits": self.fits}


def _proxy(groups: list[GPUGroup]) -> GPUSpec:
    """One GPU spec that is no better than any of the groups (for the layout enumeration)."""
    gpus = [g.gpu for g in groups]
    least = min(gpus, key=lambda g: g.memory_gb)
    return replace(least, intra_node_gbs=min(g.intra_node_gbs for g in gpus),
                   inter_node_gbs=min(g.inter_node_gbs for g in gpus))


def plan_mixed(shape: ModelShape, groups: list[GPUGroup], space: SearchSpace, gpus_per_node: int = 8,
               headroom: float = 0.1, model: str = "custom", dtype: str = "bf16",
               compute_efficiency: float = 0.5) -> list[MixedPlan]:
    """Every fitting layout for the mixed cluster, fastest first."""
    total = sum(g.count for g in groups)
    per_node = min(gpus_per_node, total)
    proxy = Cluster(_proxy(groups), per_node, max(1, total // per_node), compute_efficiency=compute_efficiency)
    plans = []
    for family in layout_families(shape, proxy, space):
        replica = family.tp * family.pp
        if any(g.count % replica for g in groups):
            continue  # a replica would mix GPU types
        rank_types = [g.gpu.name for g in groups for _ in range(g.count // replica)]
        peaks = {g.gpu.name: g.gpu.peak_flops(_peak_key(dtype)) for g in groups}
        for mbs in micro_batch_sizes(family, space):
            layout = family.replace(micro_batch_size=mbs)
            if family.pp == 1 and family.dp > 1 and len(set(peaks.values())) > 1:
                slowest = min(peaks.values())
                layout = layout.replace(balance_weights=tuple(round(peaks[t] / slowest, 2) for t in rank_types))
            if layout_problems(shape, layout):
                continue
            plan = _evaluate(shape, layout, groups, rank_types, per_node, headroom, model, compute_efficiency)
            if layout.balanced:  # re-weight by the modelled time of a micro-batch on each type, not its peak
                slowest = max(plan.per_micro_batch_s.values())
                timed = layout.replace(balance_weights=tuple(round(slowest / plan.per_micro_batch_s[t], 2)
                                                           for t in rank_types))
                plan = min(plan, _evaluate(shape, timed, groups, rank_types, per_node, headroom, model,
                                           compute_efficiency), key=lambda p: p.step_s)
            if not all(plan.fits.values()) and (sharded := reduced_every_microbatch(shape, layout)) is not None:
                plan = _evaluate(shape, sharded, groups, rank_types, per_node, headroom, model, compute_efficiency)
            if not all(plan.fits.values()):
                break  # larger micro-batches need more memory still
            plans.append(plan)
    plans.sort(key=lambda p: (-p.tokens_per_s, p.estimate.memory.total))
    return plans


def _peak_key(dtype: str) -> str:
    return dtype if dtype != "fp32" else "tf32"


def _evaluate(shape, layout: Layout, groups, rank_types, per_node, headroom, model, efficiency) -> MixedPlan:
    by_type = {}
    for g in groups:
        cluster = Cluster(g.gpu, per_node, max(1, layout.world_size // per_node), compute_efficiency=efficiency)
        by_type[g.gpu.name] = (g.gpu, estimate(shape, layout, cluster, model=model))
    mean_micro_batches = layout.global_batch_size / layout.dp / layout.micro_batch_size
    per_mb = {name: (est.time.compute_s + est.time.tp_comm_s) / mean_micro_batches
              for name, (_, est) in by_type.items()}
    rest = max(est.time.dp_exposed_s + est.time.pp_comm_s + est.time.bubble_s + est.time.ep_comm_s
               for _, est in by_type.values())
    fits = {name: est.memory.total <= gpu.memory_bytes * (1 - headroom) for name, (gpu, est) in by_type.items()}
    least = min(by_type.values(), key=lambda v: v[0].memory_bytes)[1]
    equal_shares = [layout.total_microbatches // layout.dp] * layout.dp
    equal = max(n * per_mb[t] for n, t in zip(equal_shares, rank_types)) + rest
    if layout.balanced:
        shares = balance_shares(layout.total_microbatches, list(layout.balance_weights))
        step = max(n * per_mb[t] for n, t in zip(shares, rank_types)) + rest
    else:
        shares, step = equal_shares, equal
    return MixedPlan(least, rank_types, shares, per_mb, step, equal, fits)


def render_plans(plans: list[MixedPlan], top: int) -> list[str]:
    """The ranked table, the winner's speed-up over equal shares and its per-type lines."""

    win = plans[0]
    lines = [f"{'#':>2}  {'tokens/s':>10}  {'step s':>7}  {'equal shares':>12}  {'GiB/GPU':>7}  layout"]
    for i, p in enumerate(plans[:top], 1):
        lines.append(f"{i:>2}  {p.tokens_per_s:>10,.0f}  {p.step_s:>7.2f}  {p.equal_step_s:>11.2f}s  "
                     f"{p.estimate.memory.total / 2**30:>7.1f}  {p.estimate.layout.describe(micro_batch=True)}")
    lines += ["", f"Winner: {win.estimate.layout.describe(micro_batch=True)}; {win.equal_step_s / win.step_s:.2f}x the speed of equal "
                  "shares", *describe_types(win)]
    if win.estimate.layout.balanced:
        lines.append(f"  parallel.balance_weights={list(win.estimate.layout.balance_weights)} (modelled speed; "
                     "parallel.balance=auto refines them from measured speed)")
    return lines


def describe_types(plan: MixedPlan) -> list[str]:
    """One line per GPU type: its ranks, their shares, time per micro-batch and the busy time per step."""
    lines = []
    for name in dict.fromkeys(plan.rank_types):
        ranks = [i for i, t in enumerate(plan.rank_types) if t == name]
        shares = sorted({plan.shares[i] for i in ranks})
        busy = max(plan.shares[i] for i in ranks) * plan.per_micro_batch_s[name]
        lines.append(f"  {name:<10} {len(ranks):>3} data-parallel rank(s), {'/'.join(map(str, shares))} micro-batch(es) "
                     f"each, {plan.per_micro_batch_s[name] * 1e3:,.1f} ms per micro-batch -> busy {busy:.2f} s per "
                     f"step; {'fits' if plan.fits[name] else 'DOES NOT FIT'}")
    return lines
