"""A pipeline rank's memory through its schedule: torch's own order of forwards, backwards and weight passes
for the rank (its stages' in-flight micro-batches), and what each moment of it holds (`HeldAt`)."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def total(self) -> float:
        return self.activations + self.weight_pass + self.grads + self.gathered + self.fresh


def schedule_peak(order: list[tuple[str, int, int]], kept: list[float], pending: list[float],
                  grads: list[float], loss_stage: int | None = None,
                  params: list[float] | None = None, fresh: list[float] | None = None,
                  loose: list[float] | None = None) -> tuple[HeldAt, HeldAt]:
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
    the fp32 ones from the next input-gradient pass on)."""
    forwarded, inputs_done, stepped, gathered = set(), set(), set(), set()
    cast, unreduced = set(), set()  # stages with accumulated gradients; with gradients in `.grad` (loose)
    block, loss = HeldAt(), HeldAt()
    last = max((m for _, _, m in order), default=0)

    def held_grads() -> float:
        if loose is None:
            return sum(grads[s] for s in stepped)
        return sum(grads[s] for s in cast) + sum(loose[s] for s in unreduced)

    def held() -> HeldAt:
        return HeldAt(sum(kept[s] for s, _ in forwarded), sum(pending[s] for s, _ in inputs_done),
                      held_grads(), sum(params[s] for s in gathered) if params else 0.0)

    for kind, stage, micro in order:
        if kind in ("B", "I") and stage == loss_stage:  # the loss's backward runs first, before this pass adds
            loss = max(loss, held(), key=lambda h: h.total)
        if kind == "F":
            forwarded.add((stage, micro))
            gathered.discard(stage)
            continue
        if kind == "I":
            inputs_done.add((stage, micro))
            if stage in unreduced:  # the post-backward casts the loose gradients (counted after: they are fewer)
                unreduced.discard(stage)
                cast.add(stage)
        now = held()
        if fresh and kind in ("B", "W"):
            now.fresh = fresh[stage]
        block = max(block, now, key=lambda h: h.total)
        if kind in ("B", "W"):
            forwarded.discard((stage, micro))
            inputs_done.discard((stage, micro))
            # A stage's first gradients grow while the pass frees its micro-batch block by block: counted at the
            # pass's start without them, at its end with them (7b pp=4 zero-bubble: +6.7% counting both at once).
            first = stage not in stepped
            stepped.add(stage)
            if kind == "W" and loose is not None:
                unreduced.add(stage)
            if first or loose is not None:
                block = max(block, held(), key=lambda h: h.total)
            if params and micro != last:  # the backward's end: its stage stays gathered
                gathered.add(stage)
                block = max(block, held(), key=lambda h: h.total)
    return block, loss
