"""A pipeline rank's memory through its schedule: torch's own order of forwards, backwards and weight passes
for the rank (its stages' in-flight micro-batches), and what each moment of it holds (`HeldAt`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from disttrain.layout.layout import Layout
from disttrain.models.shape import ModelShape
from disttrain.plan.dtypes import dtype_bytes


def schedule_order(schedule: str, pp: int, microbatches: int, virtual_stages: int,
                   pp_rank: int) -> list[tuple[str, int, int]]:
    """(kind, local stage, micro-batch) in the order torch's multi-stage schedule (`ScheduleInterleaved1F1B`,
    `ScheduleInterleavedZeroBubble`) runs them on `pp_rank`: its own order table, without the idle slots.
    Kinds: F forward, B whole backward, I input-gradient pass, W weight-gradient pass. The table is a private
    method of torch's schedules (no public one builds it without stages); the pipeline rows of
    tests/test_planner_grid.py fail if a torch upgrade moves it."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                        _ComputationType)

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "I",
             _ComputationType.BACKWARD_WEIGHT: "W", _ComputationType.FULL_BACKWARD: "B"}
    rounds = max(1, microbatches // pp)
    table = SimpleNamespace(n_local_stages=virtual_stages, pp_group_size=pp, _n_microbatches=microbatches,
                            number_of_rounds=rounds, microbatches_per_round=microbatches // rounds)
    cls = ScheduleInterleavedZeroBubble if schedule == "zero_bubble" else ScheduleInterleaved1F1B
    return [(kinds[a.computation_type], a.stage_index // pp, a.microbatch_index)
            for a in cls._calculate_single_rank_operations(table, pp_rank) if a is not None]


@dataclass
class HeldAt:
    """What a multi-stage rank holds at one moment of its order (bytes)."""

    activations: float = 0.0  # saved tensors of the micro-batch stages not yet through their backward
    weight_pass: float = 0.0  # zero-bubble: gradients kept from input-gradient passes for the weight passes
    grads: float = 0.0  # accumulated (unsharded) gradients of the stages that have run a backward
    gathered: float = 0.0  # ZeRO-3: parameters a backward left gathered (torch's schedules reshard only the last)
    fresh: float = 0.0  # a gradient pass's first block's gradients, in the parameter dtype, before FSDP takes them
    loose: float = 0.0  # zero-bubble: weight passes' gradients in the parameter dtype beside the accumulated ones
    input_grads: float = 0.0  # zero-bubble: input gradients left on the stages' receive buffers (`sent` below)
    transient: float = 0.0  # zero-bubble: a whole backward's first MLP backward (`transient` below)

    @property
    def total(self) -> float:
        return self.activations + self.weight_pass + self.grads + self.gathered + self.fresh + self.temporary

    @property
    def temporary(self) -> float:
        """What the dry run's tracker files as temporaries (made in a backward, none of FSDP2's own)."""
        return self.weight_pass + self.loose + self.input_grads + self.transient


def schedule_peak(order: list[tuple[str, int, int]], kept: list[float], pending: list[float],
                  grads: list[float], loss_stage: int | None = None,
                  params: list[float] | None = None, fresh: list[float] | None = None,
                  loose: list[float] | None = None, sent: list[float] | None = None, layers: list[int] | None = None,
                  whole: set[int] = frozenset(), transient: float = 0.0) -> tuple[HeldAt, HeldAt]:
    """The fullest moment of `order` (a whole backward or an input-gradient pass running), and the fullest
    moment of the loss's backward on `loss_stage` (None: not this rank's). A forward adds its stage's `kept`
    bytes, a whole backward frees them; zero-bubble's input-gradient pass keeps them (its graph is retained
    for the weight pass) and adds `pending`, and the weight pass frees both. A stage's `grads` exist from
    its first backward (weight pass for zero-bubble). `params` (ZeRO-3): a stage's gathered parameters, left
    gathered by each of its backwards but the last until its next forward reshards them. `fresh`: the gradients
    a stage's first block makes at the start of each of its gradient passes (B or W), in the parameter dtype, before
    FSDP's post-backward casts them into the accumulated ones. `loose` (zero-bubble, parameters in a lower dtype than
    the reduction's): a stage's gradients in the parameter dtype, which its weight pass adds into the parameters'
    own `.grad`; FSDP2's post-backward runs in the input-gradient pass, so the stage's next one casts them into
    the accumulated `grads` (reduce dtype), and each later weight pass leaves them again beside those (the dry
    run's tracker on `tiny`, pp=2 zero-bubble, bf16: the parameter-dtype gradients after the first weight pass,
    the fp32 ones from the next input-gradient pass on). Those of a stage's first weight pass are its only
    gradients and the tracker files them so; later ones, beside the accumulated gradients, it files as
    temporaries (`loose` of HeldAt). `sent` (zero-bubble): the input gradient a stage's input-gradient pass
    leaves on its receive buffer (torch's `stage_backward_input` sets the input's `.grad`, which only the next
    step's `clear_runtime_states` clears; a whole backward sets it to None), held from the pass on. Zero-bubble's
    input-gradient pass is counted where its stage's loose gradients meet the pass's own kept ones: at its first
    block's end (all the loose ones, that block's share of `pending`: `layers`, the stage's blocks) and at its
    last's (all of `pending`, that block's share of the loose ones), each block's post-backward casting its own.
    `whole`: stages whose weight pass is a whole backward (torch runs the first stage's so; its input-gradient pass
    does nothing), which start with `transient` besides (their first MLP backward; plan/activations.py)."""
    forwarded, inputs_done, stepped, gathered = set(), set(), set(), set()
    cast, unreduced = set(), set()  # stages with accumulated gradients; with gradients in `.grad` (loose)
    block, loss = HeldAt(), HeldAt()
    last = max((m for _, _, m in order), default=0)
    input_grads = 0.0

    def held() -> HeldAt:
        if loose is None:
            grads_now, beside = sum(grads[s] for s in stepped), 0.0
        else:  # a stage's loose gradients are its only ones until its accumulated ones exist
            grads_now = sum(grads[s] for s in cast) + sum(loose[s] for s in unreduced - cast)
            beside = sum(loose[s] for s in unreduced & cast)
        return HeldAt(sum(kept[s] for s, _ in forwarded), sum(pending[s] for s, _ in inputs_done),
                      grads_now, sum(params[s] for s in gathered) if params else 0.0, loose=beside,
                      input_grads=input_grads)

    for kind, stage, micro in order:
        if kind in ("B", "I") and stage == loss_stage:  # the loss's backward runs first, before this pass adds
            loss = max(loss, held(), key=lambda h: h.total)
        if kind == "F":
            forwarded.add((stage, micro))
            gathered.discard(stage)
            continue
        if kind == "I" and stage in whole:
            continue
        n = max(layers[stage], 1) if layers else 1
        if kind == "I":  # its first block's end: the stage's loose gradients not cast yet, that block's kept ones made
            start = held()
            first_block = replace(start, weight_pass=start.weight_pass + pending[stage] / n)
            block = max(block, first_block, key=lambda h: h.total)
            beside = loose[stage] if loose is not None and stage in unreduced & cast else 0.0
            inputs_done.add((stage, micro))
            if stage in unreduced:  # the post-backward casts the loose gradients (counted after: they are fewer)
                unreduced.discard(stage)
                cast.add(stage)
        now = held()
        if fresh and kind in ("B", "W"):
            now.fresh = fresh[stage]
        if kind == "I":  # its last block's end: that block's loose gradients not cast yet
            now.loose += beside / n
        if kind == "W" and stage in whole:
            now.transient = transient
        block = max(block, now, key=lambda h: h.total)
        if kind == "I" and sent:  # made at the pass's end, kept to the next step
            input_grads += sent[stage]
        if kind in ("B", "W"):
            forwarded.discard((stage, micro))
            inputs_done.discard((stage, micro))
            # A stage's first gradients grow while the pass frees its micro-batch block by block: counted at the
            # pass's start without them, at its end with them (7b pp=4 zero-bubble: +6.7% counting both at once).
            first = stage not in stepped
            stepped.add(stage)
            if kind == "W" and loose is not None:  # a whole backward's post-backwards cast them as it goes
                (cast if stage in whole else unreduced).add(stage)
            if first or loose is not None:
                block = max(block, held(), key=lambda h: h.total)
            if params and micro != last:  # the backward's end: its stage stays gathered
                gathered.add(stage)
                block = max(block, held(), key=lambda h: h.total)
    return block, loss


def weight_gradient_inputs_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """What zero-bubble's input-gradient pass leaves for the weight pass, per layer and micro-batch: torch's
    `stage_backward_input` keeps the gradient arriving at every op that leads to a weight (each matmul's
    output, each RMSNorm's scaled output), in the compute dtype. Counted on real tensors for two blocks: 5h +
    kv + 2f per token (q, the attention projection, w2 and the two norms h each; k and v together one kv; w1
    and w3 f each); head- and FFN-split tensors divide by tp."""
    ec, _ = dtype_bytes(layout)
    kv = shape.n_kv_heads * shape.head_dim
    return ec * micro_batch * seq_len * (5 * shape.dim + kv + 2 * shape.ffn_hidden_dim) / layout.tp
