"""Layout rules of expert parallelism (`parallel.ep`): an MoE model, experts that split evenly over
data-parallel x context-parallel ranks, and what it composes with. Pure Python; rules.py asks them with
the others."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.layout.problem import Problem

if TYPE_CHECKING:  # the shape is read, never built, here
    from disttrain.models.shape import ModelShape


def expert_problems(shape: ModelShape | None, layout) -> list[Problem]:  # layout: a layout.Layout
    """Expert parallelism: an MoE model, experts that split evenly, and what it composes with."""
    ep, moe = layout.ep, shape.moe if shape is not None else None
    shared = moe.moe_intermediate_size * moe.n_shared_experts if moe is not None else 0
    if layout.tp > 1 and shared % layout.tp:
        return [Problem("parallel.tp", layout.tp, f"a divisor of the shared experts' width {shared}",
                        f"parallel.tp={layout.tp} does not divide the shared experts' width model.moe."
                        f"moe_intermediate_size x n_shared_experts = {shared}")]
    if ep == 1:
        return []
    if shape is not None and moe is None:
        return [Problem("parallel.ep", ep, "1 for a dense model", f"parallel.ep={ep} on a dense model (no experts "
                        "to split; allowed: 1, or an MoE model such as model.name=debug-moe)")]
    if moe is not None and moe.num_experts % ep:
        return [Problem("parallel.ep", ep, f"a divisor of model.moe.num_experts={moe.num_experts}",
                        f"parallel.ep={ep} does not divide model.moe.num_experts={moe.num_experts}")]
    if layout.engine == "deepspeed" or layout.balanced:
        what = ("engine=deepspeed" if layout.engine == "deepspeed" else
                "uneven shares (parallel.balance/balance_weights)")
        return [Problem("parallel.ep", ep, "1 with " + what, f"parallel.ep={ep} with {what}: experts are split "
                        "by the torch engine (zero_stage 0 to 3) with equal shares (allowed with it: parallel.ep=1)")]
    return []


def expert_batch_problems(layout) -> list[Problem]:  # layout: a layout.Layout
    """Experts are split over `ep` of the dp_shard x cp ranks (the MoE layer is token-wise: a context rank's
    chunk of a sequence is more tokens to dispatch, as a data-parallel rank's sequences are)."""
    cp = getattr(layout, "cp", 1)
    if layout.ep > 1 and (layout.dp_shard * cp) % layout.ep:
        ranks = (f"parallel.dp_shard x parallel.cp = {layout.dp_shard} x {cp}" if cp > 1 else
                 f"the data-parallel degree parallel.dp_shard={layout.dp_shard}")
        allowed = f"a divisor of parallel.dp_shard x parallel.cp = {layout.dp_shard * cp}"
        return [Problem("parallel.ep", layout.ep, allowed,
                        f"parallel.ep={layout.ep} does not divide {ranks} (experts are split over data-parallel "
                        "and context-parallel ranks)")]
    return []
