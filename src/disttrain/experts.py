"""Expert parallelism's part of a layout: which ranks hold which experts, and the rules for `parallel.ep`.
Pure Python (no torch): the planner and config validation read it.

`ep` ranks are taken from the data-parallel ones (dp_shard first, then dp_replicate), innermost beside tensor
parallel, so an all-to-all over them stays in a node while ep x tp fits one. Each of those ranks holds
num_experts / ep experts; the dp / ep ranks that hold the same experts shard them when ZeRO shards
(`efsdp`, the experts' own FSDP dimension) and replicate them otherwise, as the dense parameters are over dp.
"""

from __future__ import annotations

from dataclasses import replace
from math import gcd

from disttrain.layout import Layout, Problem
from disttrain.models.shape import ModelShape


def expert_layout(layout: Layout) -> Layout:
    """The layout the experts' states follow: their data-parallel ranks are the dp / ep that hold the same
    experts, `dp_shard / gcd(ep, dp_shard)` of them sharding (efsdp) and the rest replicating."""
    if layout.ep <= 1:
        return layout
    efsdp = layout.dp_shard // gcd(layout.ep, layout.dp_shard)
    replicas = max(1, layout.dp // layout.ep // efsdp)
    # The same sequences per rank, so the same micro-batches: the group is smaller, not the work.
    return replace(layout, dp_shard=efsdp, dp_replicate=replicas, ep=1,
                   global_batch_size=layout.sequences_per_rank * efsdp * replicas, balance_weights=())


def expert_problems(shape: ModelShape | None, layout: Layout) -> list[Problem]:
    """`parallel.ep` must split the experts evenly, over data-parallel ranks, of a mixture-of-experts model
    (with `layout.layout_problems`, every reason a layout with experts cannot run)."""
    ep = layout.ep
    if ep < 1:
        return [Problem("parallel.ep", ep, "a positive integer", f"parallel.ep={ep}: must be at least 1")]
    if ep == 1:
        return []
    if shape is not None and shape.moe is None:
        return [Problem("parallel.ep", ep, "1 for a dense model", f"parallel.ep={ep} needs a mixture-of-experts "
                        "model; this one has no experts (allowed: 1)")]
    problems = []
    if shape is not None and shape.moe.num_experts % ep:
        experts = shape.moe.num_experts
        allowed = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        problems.append(Problem("parallel.ep", ep, f"a divisor of model.moe.num_experts={experts}",
                                f"parallel.ep={ep} does not divide model.moe.num_experts={experts} (allowed: {allowed})"))
    if layout.dp % ep:
        problems.append(Problem("parallel.ep", ep, f"a divisor of the data-parallel size {layout.dp}",
                                f"parallel.ep={ep} does not divide the data-parallel size {layout.dp} (world size "
                                f"{layout.world_size}): expert-parallel ranks are taken from the data-parallel ones"))
    if layout.engine != "torch":
        problems.append(Problem("parallel.ep", ep, "1 with engine=deepspeed",
                                f"parallel.ep={ep} needs engine=torch (allowed with engine=deepspeed: 1)"))
    return problems
