"""Per-rank memory: model states (ZeRO paper and this runtime's accounting), activations
(Korthikanti et al. 2022 and this framework's Llama), communication buffers.

Two accountings of model states:
- `runtime` (default) counts what disttrain allocates: fp32 parameters, fp32 gradients and fp32
  Adam moments for every stage; FSDP2 (stages 2 and 3) shards all three and all-gathers
  parameters in `param_dtype` for compute, which shows up as buffers, not as a second copy.
- `zero-paper` is Rajbhandari et al. 2020 generalised over dtypes: parameters and gradients in
  `param_dtype`, an fp32 master copy when that is not fp32, and Adam's two fp32 moments (K = 12
  for fp16/bf16, 8 for fp32); stage 1 shards the optimizer states, 2 also gradients, 3 also
  parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.models.registry import ModelShape
from disttrain.layout import DTYPE_BYTES, Layout
from disttrain.plan.activations import (  # noqa: F401 (re-exported: the planner's memory API)
    StageActivations, korthikanti_in_flight_factor, korthikanti_layer_bytes, layer_activation_bytes,
    pipeline_batch_bytes, pipeline_recv_bytes, stage_activation_bytes)
from disttrain.plan.moe import model_states as moe_model_states
from disttrain.plan.moe import layer_params as moe_layer_params
from disttrain.plan.params import (RankParams, layer_params, lora_layer_params, rank_params,  # noqa: F401
                                   rotary_table_bytes, stage_layers)

ACCOUNTINGS = ("runtime", "zero-paper")
FP32 = 4
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32


@dataclass
class ModelStates:
    params: float
    grads: float
    optimizer: float
    buffers: float
    cpu: float = 0.0  # bytes moved to host memory by CPU offload
    # FSDP2 accumulating micro-batches without gradient sync keeps every held parameter's gradient
    # unsharded (in reduce_dtype) until the last micro-batch's reduce-scatter.
    unsharded_grads: float = 0.0
    # AdamW's foreach kernels (the default on GPUs) hold one fp32 temporary per updated parameter, all at
    # once, during the step (measured by `disttrain dryrun`); none on the device when the step runs on the CPU.
    step_temporary: float = 0.0
    # DDP's first backward: autograd's fresh gradients exist beside the buckets until the reducer copies
    # them in (measured on real tensors and by the dry run); from then on gradients are bucket views.
    first_step_grads: float = 0.0
    tables: float = 0.0  # buffers held whole beside the parameters (the rotary tables)
    # Autocast over fp32 weights (DDP, ZeRO-1) caches a copy of every weight it casts until the forward's autocast
    # region ends, checkpointing or not: all of them exist at the loss's forward (the dry run: 125m, 8 ranks).
    forward_copies: float = 0.0
    block_copies: float = 0.0  # of `buffers`, the copies only a block's recomputation holds (not at the loss)


def model_state_bytes(n_params: float, layout: Layout, accounting: str = "runtime",
                      largest_unit: float = 0.0, root_params: float = 0.0, largest_tensor: float = 0.0,
                      trainable: float | None = None) -> ModelStates:
    """Bytes of parameters, gradients and optimizer states one rank holds for `n_params` parameters
    (already split by tp/pp). `largest_unit`/`root_params` size FSDP's gather buffers; `largest_tensor`
    (parameters of the biggest one) bounds ZeRO-1's share from below: torch's ZeroRedundancyOptimizer
    gives whole tensors to ranks, so one rank holds the embedding's states (measured by the dry run).
    `trainable`: the parameters that train (LoRA adapters; None: all); frozen ones have no gradient,
    no optimizer state and no master copy, and the runtime stores them in a bf16/fp16 compute dtype."""
    pb = DTYPE_BYTES[layout.param_dtype]
    stage = layout.zero_stage
    t = n_params if trainable is None else trainable
    if accounting == "zero-paper":
        master = 0 if pb == FP32 else FP32
        p, g, o = pb * n_params, pb * t, (master + ADAM_MOMENT_BYTES) * t
        d_opt = layout.gradient_ranks if stage == 1 else layout.shard_ranks
        return ModelStates(params=p / (layout.shard_ranks if stage >= 3 else 1),
                           grads=g / (layout.shard_ranks if stage >= 2 else 1),
                           optimizer=o / (d_opt if stage >= 1 else 1), buffers=0.0,
                           step_temporary=FP32 * t / (d_opt if stage >= 1 else 1))
    if accounting != "runtime":
        raise ValueError(f"accounting={accounting} (allowed: {', '.join(ACCOUNTINGS)})")
    low = layout.compute_dtype in ("bf16", "fp16")
    frozen_bytes = DTYPE_BYTES[layout.compute_dtype] if low else FP32
    p, g, o = FP32 * t + frozen_bytes * (n_params - t), FP32 * t, ADAM_MOMENT_BYTES * t
    if stage <= 1:
        # DDP: gradients are views into its buckets (gradient_as_bucket_view); autocast keeps a
        # low-precision copy of each weight for the backward - of every weight without checkpointing; with
        # it, a block's copies are remade in its recomputation, so only the uncheckpointed root's stay,
        # plus the block being recomputed (measured by the dry run: 7b ZeRO-1 selective, 0.6 not 12.6 GiB).
        # A pipeline runs its schedule's whole step (every forward and backward) in one autocast region, whose
        # cache keeps every weight's copy until the step ends, checkpointing or not (tiny, pp=2 1F1B, dry run).
        whole = layout.activation_checkpointing == "none" or layout.pp > 1
        held_copies = n_params if whole else root_params + largest_unit
        if trainable is not None and low:  # a frozen base already in the compute dtype needs no copies
            held_copies = t
        buffers = pb * held_copies if pb != FP32 else 0.0
        owned = max(t / layout.gradient_ranks, largest_tensor) if stage == 1 else t
        return ModelStates(p, g, ADAM_MOMENT_BYTES * owned, buffers, step_temporary=FP32 * owned,
                           first_step_grads=g if layout.gradient_ranks > 1 else 0.0)
    d = layout.shard_ranks
    rb = DTYPE_BYTES[layout.reduce_dtype]
    if not layout.reshard_after_forward:  # gathered parameters stay from forward to backward; one unit's gradients unsharded
        buffers = pb * n_params + (pb + rb) * largest_unit
    else:  # current + prefetched block gathered, the root unit kept gathered for backward
        buffers = pb * (2 * largest_unit + root_params) + (pb + rb) * largest_unit
    states = ModelStates(p / d, g / d, o / d, buffers, step_temporary=FP32 * t / d)
    if layout.microbatches > 1 or layout.pp > 1:  # on the device even with CPU offload; a pipeline schedule defers
        # the reduce-scatter to after its last micro-batch (`perform_reduce_grad`), even with one
        states.unsharded_grads = rb * t
    if layout.cpu_offload:
        states.cpu = states.params + states.grads + states.optimizer
        states.params = states.grads = states.optimizer = states.step_temporary = 0.0
    return states


# ---------------------------------------------------------------- one rank, all of it


@dataclass
class MemoryEstimate:
    """One rank's memory at each moment of a step where a peak can fall, in the dry run's categories
    (dryrun/simulate.py); the peak is the fullest moment. Summing every term's own maximum instead
    over-counts: the loss's logits, a block's recomputation and the optimizer's temporaries never
    coexist."""

    params_per_rank: int  # parameter count after tp/pp splitting, before data-parallel sharding
    states: ModelStates
    activations: StageActivations
    pipeline_buffers: float
    pp_rank: int
    moments: dict[str, dict] = field(default_factory=dict)
    per_stage: list[dict] = field(default_factory=list)
    trainable_per_rank: int | None = None  # LoRA: the adapters (None: every parameter trains)

    @property
    def buffers(self) -> float:
        return self.states.buffers + self.pipeline_buffers

    def _sum(self, name: str) -> float:
        return sum(self.moments[name].values()) if name in self.moments else 0.0

    @property
    def backward_total(self) -> float:
        """Forward/backward: the loss's backward or a block's, whichever is fuller."""
        return max(self._sum("loss"), self._sum("block"))

    @property
    def step_total(self) -> float:
        """The optimizer step: activations and buffers are freed, AdamW's temporaries are not yet."""
        return self._sum("step")

    @property
    def first_step_total(self) -> float:
        return self._sum("first step")

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self._sum)

    @property
    def total(self) -> float:
        return self._sum(self.peak_moment)

    def categories(self) -> dict:
        return dict(self.moments[self.peak_moment])

    def as_dict(self) -> dict:
        s = self.states
        return {"params": s.params, "grads": s.grads, "unsharded_grads": s.unsharded_grads, "optimizer": s.optimizer,
                "activations": self.activations.peak, "buffers": self.buffers, "total": self.total,
                "peak_moment": self.peak_moment, "backward_total": self.backward_total,
                "optimizer_step_total": self.step_total, "first_step_total": self.first_step_total,
                "cpu_offloaded": s.cpu, "moments": self.moments}


def _moments(states: ModelStates, acts: StageActivations, layout: Layout, gathered: float, unit: float,
             root: float, pipe: float, grad_unit: float | None = None,
             grad_root: float | None = None, all_gathered: float = 0.0) -> dict[str, dict]:
    """What is alive at each moment, by category. `gathered`: FSDP's all-gathered parameters held through
    the step (ZeRO-2: every unit; ZeRO-3: the root unit); `unit`: one block's parameters; `grad_unit`,
    `grad_root`: those of them that get gradients (LoRA: the block's adapters, none of the root's); `pipe`:
    a pipeline's receive buffers and token ids, activations to the dry run's tracker (made outside any backward)."""
    grad_unit = unit if grad_unit is None else grad_unit
    grad_root = root if grad_root is None else grad_root
    s = states
    pb, rb = DTYPE_BYTES[layout.param_dtype], DTYPE_BYTES[layout.reduce_dtype]
    fsdp = layout.zero_stage >= 2 and layout.engine == "torch"
    # FSDP's sharded gradients appear at the last micro-batch's reduce-scatter (set to None after each
    # step); DDP's are its buckets, there from the start.
    grads = s.unsharded_grads if fsdp else s.grads
    if layout.pp > 1 and layout.pp_schedule == "gpipe":  # every forward, and loss, before the first backward
        grads = 0.0 if fsdp else grads
    loss_grads, loss_acts, loss_pending, block_pending = grads, acts.saved, 0.0, 0.0
    loss_gathered = block_gathered = 0.0
    if acts.at_block is not None:  # several stages per rank: what the schedule's order holds at each moment
        if fsdp:  # FSDP's accumulated gradients exist for the stages that have run a backward
            grads, loss_grads = acts.at_block.grads, acts.at_loss.grads
        loss_acts, loss_pending, block_pending = acts.saved_at_loss, acts.at_loss.weight_pass, acts.at_block.weight_pass
        loss_gathered, block_gathered = acts.at_loss.gathered, acts.at_block.gathered
    copies = 0.0 if fsdp else s.buffers  # autocast's low-precision weight copies, kept as activations
    moments = {}
    if acts.logits:  # the loss's backward: its gradient and the logits' (loss_parallel keeps one more shard)
        moments["loss"] = {"parameters": s.params + s.tables, "gradients": loss_grads, "optimizer": s.optimizer,
                           "activations": loss_acts + copies - (0.0 if fsdp else s.block_copies) + pipe,
                           "temporary": (3 if layout.tp > 1 else 2) * acts.logits + loss_pending,
                           "communication": gathered + loss_gathered}
    block_grads = grads if s.unsharded_grads or not fsdp else 0.0
    # The block gathered (ZeRO-3: and the next one prefetched) and its unsharded gradients, unless those
    # are already counted among the accumulated ones.
    gathers = 2 * pb * unit if layout.reshard_after_forward else 0.0
    in_use = gathers + (0.0 if s.unsharded_grads else (pb + rb) * grad_unit) if fsdp else 0.0
    block_acts, block_temp = acts.saved - acts.logits - acts.block_freed + copies + pipe, acts.layer + block_pending
    if fsdp and not s.unsharded_grads:
        # One micro-batch: the output layer's unsharded gradients, pending until the end of the backward, and of
        # the block's only those made by its fullest moment (acts.grad_share), temporaries to the dry run's
        # tracker; from the second block on, the previous block's reduce-scatter input too (rb) and its sharded
        # gradients, while that block's saved activations are freed and, under ZeRO-2, its gathered parameters
        # (pb, among `gathered`): the fuller of the first and a later block. Torch's tracker on the dry run,
        # `debug` and `debug-moe` at seq 128, cp=2, ZeRO-2: the block moment counted both at once, 28-29% over
        # the fullest block measured, and was taken for the peak (+9% and +17%); `tiny` cp=4 ZeRO-3: +12.6%.
        previous = (rb - (0 if layout.reshard_after_forward else pb)) * grad_unit
        sharded = FP32 * grad_unit / layout.shard_ranks  # that block's sharded gradients
        later = previous + sharded > acts.layer_saved
        in_use = gathers + (previous if later else 0.0)
        block_acts -= acts.layer_saved if later else 0.0
        block_grads = sharded if later else 0.0
        block_temp += pb * (grad_root + acts.grad_share * grad_unit)
    elif fsdp and layout.pp == 1 and FP32 * grad_unit / layout.shard_ranks > acts.layer_saved:
        # Accumulating: in the last micro-batch's backward each finished block's gradients become its reduce-scatter
        # input and a sharded gradient, fuller than a first block when its saved tensors are fewer (checkpointing).
        block_grads += FP32 * grad_unit / layout.shard_ranks - rb * grad_unit
        in_use += rb * grad_unit
        block_acts -= acts.layer_saved
    moments["block"] = {"parameters": s.params + s.tables, "gradients": block_grads, "optimizer": s.optimizer,
                        "activations": block_acts, "temporary": block_temp,
                        "communication": gathered + in_use + block_gathered}
    if fsdp and not layout.reshard_after_forward and layout.pp == 1:
        # ZeRO-2's forward gathers every unit and keeps it; each all-gather's output buffer lives until the next one
        # is waited for: two buffers at a block's start (the blocks before it saved), one after the last block (all
        # saved). The dry run's peak there for `tiny` at seq 512 (cp 2 and 4, each checkpointing mode).
        base = acts.saved - acts.logits - acts.loss_inputs
        moments["forward"] = max(({"parameters": s.params + s.tables, "gradients": s.unsharded_grads,
                                   "optimizer": s.optimizer, "activations": act, "temporary": 0.0,
                                   "communication": gathered + buffers * pb * unit}
                                  for act, buffers in ((base - acts.layer_saved, 2), (base + acts.loss_inputs, 1))),
                                 key=lambda m: sum(m.values()))
    if fsdp and layout.pp > 1:
        # A backward done, before the deferred reduce-scatter: every unsharded gradient; and torch's schedules keep
        # the parameters gathered after every backward but the last (`set_reshard_after_backward(False)`), so the
        # end of the one before the last holds the stage's whole parameters and the other in-flight micro-batches.
        others = acts.saved * max(acts.in_flight - 1, 0.0) / acts.in_flight if layout.microbatches > 1 else 0.0
        moments["backward end"] = {"parameters": s.params + s.tables, "gradients": s.unsharded_grads,
                                   "optimizer": s.optimizer, "activations": others + pipe, "temporary": 0.0,
                                   "communication": all_gathered if layout.microbatches > 1 else gathered}
    moments["step"] = {"parameters": s.params + s.tables, "gradients": s.grads,
                       "optimizer": s.optimizer + s.step_temporary,
                       "activations": pipe, "temporary": 0.0, "communication": 0.0}  # receive buffers stay
    if s.forward_copies > copies and acts.logits and layout.pp == 1 and layout.tp == 1:
        # The loss's forward, under autocast with checkpointing: every weight's cached copy, and beside the fp32
        # log-softmax it keeps, the logits in the compute dtype and their fp32 copy (the dry run's peak at 125m and
        # 1b, DDP and ZeRO-1 with full checkpointing and two micro-batches: all of it activations to its tracker).
        ec = DTYPE_BYTES[layout.param_dtype]
        logits = acts.logits * (1 + (1 + ec / FP32 if ec < FP32 else 1))
        moments["loss forward"] = {**moments["loss"], "temporary": 0.0, "activations":
                                   loss_acts - acts.logits + logits + s.forward_copies + pipe}
    # DDP's first step: no optimizer states yet, autograd's gradients beside the buckets. With one micro-batch the
    # reducer copies each into its bucket as it is made, and they never all coexist (the dry run, which counts the
    # buckets from the start: 13b ZeRO-1 without checkpointing, 32 ranks, peaks at the loss's backward; the planner
    # read +4.2% from this moment, with gradients +100%; `tiny` at seq 64, 8 ranks: +14.6% -> -1.4%).
    if s.first_step_grads and layout.microbatches > 1:
        moments["first step"] = {"parameters": s.params + s.tables, "gradients": s.grads + s.first_step_grads,
                                 "optimizer": 0.0, "activations": copies, "temporary": 0.0, "communication": 0.0}
        if "loss" in moments:  # accumulated outside the buckets, through the next loss
            loss = max((moments[k] for k in ("loss", "loss forward") if k in moments), key=lambda m: sum(m.values()))
            moments["first step"] = {**loss, "optimizer": 0.0, "gradients": loss["gradients"] + s.first_step_grads}
    return moments


def output_params(shape: ModelShape, layout: Layout, held) -> float:
    """The root unit's parameters whose gradients a block's backward finds made: the output layer's and the final
    norm's (the input embedding's come at the very end, unless it is the output layer's, tied)."""
    return shape.vocab_size * shape.dim / layout.tp + shape.dim if held.output else 0.0


def estimate_memory(shape: ModelShape, layout: Layout, accounting: str = "runtime",
                    fused_norm: bool = True, pp_rank: int | None = None, lora_rank: int = 0,
                    routing_skew: float = 1.0) -> MemoryEstimate:
    """The rank that needs the most memory (over pipeline stages), with every stage's total kept;
    with `pp_rank`, that pipeline rank's. `lora_rank` > 0: LoRA adapters on every projection train and
    the base (held as the runtime holds it, in fp32) is frozen. `routing_skew`: MoE routing (plan/moe.py)."""
    candidates = []
    ranks = {0, layout.pp - 1} | ({1} if layout.pp > 2 else set()) if pp_rank is None else {pp_rank}
    for pp_rank in sorted(ranks):
        held = rank_params(shape, layout, pp_rank)
        unit = layer_params(shape, layout.tp, layout.ep)
        largest = max(shape.dim * shape.ffn_hidden_dim // layout.tp,  # an MLP matrix, or the vocabulary's
                      shape.vocab_size * shape.dim // layout.tp if held.embedding or held.output else 0)
        adapters = held.layers * lora_layer_params(shape, lora_rank, layout.tp) if lora_rank else None
        states = model_state_bytes(held.total + (adapters or 0), layout, accounting, largest_unit=unit,
                                   root_params=held.root, largest_tensor=largest, trainable=adapters)
        if held.experts:  # the experts' states on their own data-parallel group
            states = moe_model_states(model_state_bytes, held, layout, accounting, largest, shape)
        states.tables = rotary_table_bytes(shape)
        if layout.zero_stage <= 1 and states.buffers and not lora_rank and not held.experts and layout.pp == 1:
            # Autocast casts every matrix but the input embedding's (a lookup); without checkpointing the copies stay
            # for the backward; with it, the output layer's, and the block being recomputed holds its own.
            pb = DTYPE_BYTES[layout.param_dtype]
            embedding = shape.vocab_size * shape.dim // layout.tp if held.embedding and not shape.tie_embeddings else 0
            states.forward_copies = pb * (held.total - embedding - shape.dim * (2 * held.layers + held.output))
            if layout.activation_checkpointing == "none":
                states.buffers = states.forward_copies
            else:
                states.block_copies = pb * (unit - 2 * shape.dim)
                output = shape.vocab_size * shape.dim // layout.tp if held.output else 0
                states.buffers = pb * output + states.block_copies
        tied = shape.tie_embeddings and held.output  # the output's sharded gradient is added to it: sharded
        if states.unsharded_grads and layout.tp > 1 and held.embedding and not tied and not lora_rank:
            # DTensor's embedding backward gives the vocabulary-parallel table's gradient whole (Replicate on
            # tp), and FSDP2 accumulates it so until the last micro-batch's reduce-scatter redistributes it.
            states.unsharded_grads += DTYPE_BYTES[layout.reduce_dtype] * shape.vocab_size * shape.dim * (
                layout.tp - 1) // layout.tp
        acts = stage_activation_bytes(shape, layout, pp_rank, fused_norm, routing_skew=routing_skew,
                                      accumulated_grads=states.unsharded_grads)
        pipe = pipeline_recv_bytes(shape, layout, pp_rank) + pipeline_batch_bytes(layout) if layout.pp > 1 else 0.0
        pb = DTYPE_BYTES[layout.param_dtype]
        gathered, all_held = 0.0, held.total
        if held.experts and layout.experts_outside_fsdp:  # no FSDP unit gathers the experts (one-rank mesh)
            all_held -= held.experts
            unit -= moe_layer_params(shape, shape.n_layers - 1, layout.tp, layout.ep)[1]
        if layout.zero_stage >= 2:
            gathered = pb * (all_held if not layout.reshard_after_forward else held.root)
        est = MemoryEstimate(held.total + (adapters or 0), states, acts, pipe, pp_rank, trainable_per_rank=adapters)
        lora_unit = lora_layer_params(shape, lora_rank, layout.tp) if lora_rank else None
        est.moments = _moments(states, acts, layout, gathered, unit if layout.zero_stage >= 2 else 0.0, held.root, pipe,
                               grad_unit=lora_unit if layout.zero_stage >= 2 else None,
                               grad_root=0.0 if lora_rank else output_params(shape, layout, held),
                               all_gathered=pb * all_held)
        candidates.append(est)
    worst = max(candidates, key=lambda m: m.total)
    worst.per_stage = [{"pp_rank": m.pp_rank, "total": m.total, "activations": m.activations.peak,
                        "in_flight": m.activations.in_flight} for m in candidates]
    return worst
