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
    mlp_backward_bytes, pipeline_batch_bytes, pipeline_recv_bytes, stage_activation_bytes)
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
             grad_root: float | None = None, all_gathered: float = 0.0, mlp: float = 0.0, layers: int = 0,
             reduced: float = 0.0, early_root: float | None = None) -> dict[str, dict]:
    """What is alive at each moment, by category. `gathered`: FSDP's all-gathered parameters held through
    the step (ZeRO-2: every unit; ZeRO-3: the root unit); `unit`: one block's parameters; `grad_unit`,
    `grad_root`: those of them that get gradients (LoRA: the block's adapters, none of the root's); `pipe`:
    a pipeline's receive buffers and token ids, activations to the dry run's tracker (made outside any backward);
    `mlp`: the MLP backward's gradients (activations.mlp_backward_bytes); `layers`: the rank's blocks; `reduced`:
    the parameters of the first FSDP unit whose reduce-scatter a pipeline defers to after its last backward;
    `early_root`: the root's parameters whose gradients exist while a block runs its backward (the output layer and
    final norm: the embedding's come after every block's)."""
    grad_unit = unit if grad_unit is None else grad_unit
    grad_root = root if grad_root is None else grad_root
    s = states
    pb, rb = DTYPE_BYTES[layout.param_dtype], DTYPE_BYTES[layout.reduce_dtype]
    fsdp = layout.zero_stage >= 2 and layout.engine == "torch"
    # FSDP's sharded gradients appear at the last micro-batch's reduce-scatter (set to None after each
    # step); DDP's are its buckets, there from the start.
    grads = s.unsharded_grads if fsdp else s.grads
    first_backward = False
    if layout.pp > 1 and acts.at_block is None and acts.in_flight >= layout.microbatches:
        # Every micro-batch in flight (GPipe; 1F1B where the warmup's forwards are all of them, as on the first stage
        # when there are no more than pp): that happens before the rank's first backward, with no gradients yet.
        # 7b, pp=4 1F1B, 4 micro-batches: counting them there put the first stage +16.6% over the dry run.
        first_backward = fsdp
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
    # The root's unsharded gradients made before the blocks' backwards, pending until the root's post-backward (13b
    # ZeRO-3, full checkpointing: counting the embedding's too put the planner 5.7% over the dry run; now +2.8%).
    # Without a pipeline a block's one-micro-batch gradients are counted as temporaries below, as the dry run files them.
    early_root = grad_root if early_root is None else min(early_root, grad_root)
    block_grads = grads if s.unsharded_grads or not fsdp else (0.0 if layout.pp == 1 else pb * early_root)
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
        if layout.pp == 1:
            sharded = FP32 * grad_unit / layout.shard_ranks  # that block's sharded gradients
            later = previous + sharded > acts.layer_saved
            in_use = gathers + (previous if later else 0.0)
            block_acts -= acts.layer_saved if later else 0.0
            block_grads = sharded if later else 0.0
            block_temp += pb * (grad_root + acts.grad_share * grad_unit)
        else:  # pipelines: their schedules' terms (plan/activations.py schedule_peak)
            in_use = gathers + pb * grad_unit + max(0.0, previous - acts.layer_saved)
    elif fsdp and layout.pp == 1 and FP32 * grad_unit / layout.shard_ranks > acts.layer_saved:
        # Accumulating: in the last micro-batch's backward each finished block's gradients become its reduce-scatter
        # input and a sharded gradient, fuller than a first block when its saved tensors are fewer (checkpointing).
        block_grads += FP32 * grad_unit / layout.shard_ranks - rb * grad_unit
        in_use += rb * grad_unit
        block_acts -= acts.layer_saved
    block = {"parameters": s.params + s.tables, "gradients": block_grads, "optimizer": s.optimizer,
             "activations": block_acts, "temporary": block_temp + (acts.at_block.fresh if acts.at_block else 0.0),
             "communication": gathered + in_use + block_gathered}
    moments["block"] = block
    if layout.pp > 1:  # without a pipeline the MLP backward's gradients are in acts.layer (block_backward_bytes)
        moments["block"] = max(block, _mlp_backward(block, acts, layout, mlp, gathered + gathers + block_gathered,
                                                    s.grads if not fsdp and layout.gradient_ranks > 1 else 0.0),
                               key=lambda m: sum(m.values()))
    if first_backward:
        # That backward frees one micro-batch's activations block by block while the gradients accumulate: its
        # last block (a recomputation, under checkpointing) runs beside nearly all of them and the other micro-batches.
        others = acts.saved * (acts.in_flight - 1) / acts.in_flight
        late = {**block, "gradients": s.unsharded_grads, "activations": others + acts.layer_saved + copies + pipe}
        moments["block"] = max(moments["block"], late, key=lambda m: sum(m.values()))
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
        # The root unit's gradients, in the parameter dtype, until its post-backward (the backward's very end) casts
        # them into the accumulated ones (7b pp=4 1F1B, first stage: the embedding's, 0.24 GiB by the dry run).
        root_grads = pb * grad_root if pb != rb and acts.at_block is None else 0.0
        moments["backward end"] = {"parameters": s.params + s.tables, "gradients": s.unsharded_grads + root_grads,
                                   "optimizer": s.optimizer, "activations": others + pipe, "temporary": 0.0,
                                   "communication": all_gathered if layout.microbatches > 1 else gathered}
        if layout.microbatches > 1 and layout.reshard_after_forward and acts.at_block is None:
            # The same backward's last blocks: the stage is gathered by then (the last block's all-gather prefetched),
            # while this micro-batch still holds its first two blocks' saved tensors and the MLP backward's gradients.
            # The dry run's peak of 13b, HSDP 4 x 4, pp=2 1F1B, ZeRO-3 (the second block's MLP backward, 32 ranks).
            late = {**moments["backward end"], "temporary": acts.layer + mlp,
                    "activations": others + min(layers, 2) * acts.layer_saved + pipe}
            if layout.microbatches <= acts.in_flight:
                # No steady state (every micro-batch in flight at the first backward): the first backward's late blocks
                # hold the other micro-batches but only the gradients of the blocks done (none of the root's); a later
                # backward holds every gradient and one micro-batch fewer (tiny, 8 blocks, m=2: +3.8% counting both).
                done = (s.unsharded_grads - rb * grad_root) * max(layers - 2, 0) / max(layers, 1)
                late = max({**late, "gradients": done},
                           {**late, "activations": late["activations"] - acts.saved / acts.in_flight},
                           key=lambda m: sum(m.values()))
            moments["gathered block"] = late
        # After the last backward, torch's `perform_reduce_grad` reduces unit by unit (the root first) with the rest of
        # the stage still gathered and every unsharded gradient alive: the first unit's parameters resharded, its
        # reduce-scatter input and output beside them, activations to the dry run's tracker (made outside any
        # backward). 125m at seq 256, HSDP 2 x 2, pp=2 1F1B, ZeRO-3: the dry run's peak, −7.3% before.
        moments["reduce"] = {**moments["backward end"], "activations": pipe + rb * reduced * (1 + 1 / layout.shard_ranks),
                             "communication": all_gathered - pb * reduced}
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


def _mlp_backward(block: dict, acts: StageActivations, layout: Layout, mlp: float, communication: float,
                  first_grads: float) -> dict:
    """The first block's MLP backward: its gradients beside the recomputed tensors (activations.mlp_backward_bytes),
    before that block's other weight gradients or any reduce-scatter input exist (which the block moment counts at
    a later block's end: counted on top of those, the dry run never holding both, they made `tiny` ZeRO-3 with
    full checkpointing +12% and 13b ZeRO-3 selective fp32 +5.6%). A pipeline rank whose first backward comes with
    every micro-batch of the step in flight (no steady state: m <= in flight) holds none of the step's gradients
    yet there (set to None after each step; DDP's buckets, `first_grads`, stay), and one micro-batch fewer at the
    next backward (tiny, tp=2+sp x pp=4, 4 micro-batches: the first rank +6.5% counting both at once)."""
    moment = {**block, "temporary": block["temporary"] + mlp, "communication": communication}
    if not mlp or layout.pp == 1 or acts.at_block is not None or layout.microbatches > acts.in_flight:
        return moment
    first = {**moment, "gradients": first_grads}
    one = (acts.saved - acts.logits) / acts.in_flight
    later = {**moment, "activations": moment["activations"] - one} if layout.microbatches > 1 else first
    return max(first, later, key=lambda m: sum(m.values()))


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
        table = shape.vocab_size * shape.dim // layout.tp
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
                               grad_root=0.0 if lora_rank else output_params(shape, layout, held) if layout.pp == 1 else None,
                               all_gathered=pb * all_held,
                               mlp=mlp_backward_bytes(shape, layout.micro_batch, layout.seq_len // layout.cp, layout),
                               layers=held.layers, reduced=held.root or unit,
                               early_root=held.root - (table if held.embedding and not tied else 0))
        candidates.append(est)
    worst = max(candidates, key=lambda m: m.total)
    worst.per_stage = [{"pp_rank": m.pp_rank, "total": m.total, "activations": m.activations.peak,
                        "in_flight": m.activations.in_flight} for m in candidates]
    return worst
