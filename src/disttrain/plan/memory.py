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

from dataclasses import dataclass, field, replace

from disttrain.models.registry import ModelShape
from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.plan.korthikanti import korthikanti_in_flight_factor, korthikanti_layer_bytes  # noqa: F401
from disttrain.plan.activations import (  # noqa: F401 (re-exported: the planner's memory API)
    StageActivations, last_stage_output_bytes,
    layer_activation_bytes, mlp_backward_bytes, mlp_product_bytes, pipeline_batch_bytes, pipeline_recv_bytes,
    stage_activation_bytes, stage_output_bytes)
from disttrain.plan.moe import expert_shard_padding, model_states as moe_model_states
from disttrain.plan.optimizer import muon_params, muon_temporaries
from disttrain.plan.peak_moments import alive_at_moments
from disttrain.plan.moe import layer_params as moe_layer_params
from disttrain.plan.objective import ObjectiveTerms, distill_head_bytes, frozen_pipeline_bytes
from disttrain.plan.params import (RankParams, layer_params, lora_layer_params, rank_params,  # noqa: F401
                                   rotary_table_bytes, stage_layers)

ACCOUNTINGS = ("runtime", "zero-paper")
FP32 = 4
# per moment value, optim.state_dtype (train/state_dtype.py); int8: a byte a value and an fp32 scale per 256 (torchao;
# its tensors under 4,096 values keep fp32 moments, a share too small to count here)
STATE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 256}
ADAM_MOMENT_BYTES = 2 * STATE_BYTES["fp32"]  # exp_avg + exp_avg_sq
MUON_MOMENT_BYTES = STATE_BYTES["fp32"]  # momentum_buffer


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
                      trainable: float | None = None, muon: float = 0.0, muon_matrix: float = 0.0,
                      state_dtype: str = "fp32") -> ModelStates:
    """Bytes of parameters, gradients and optimizer states one rank holds for `n_params` parameters
    (already split by tp/pp). `largest_unit`/`root_params` size FSDP's gather buffers; `largest_tensor`
    (parameters of the biggest one) bounds ZeRO-1's share from below: torch's ZeroRedundancyOptimizer
    gives whole tensors to ranks, so one rank holds the embedding's states (measured by the dry run).
    `trainable`: the parameters that train (LoRA adapters; None: all); frozen ones have no gradient,
    no optimizer state and no master copy, and the runtime stores them in a bf16/fp16 compute dtype.
    `muon`: of the trainable parameters, those Muon steps (optim.name=muon: one fp32 momentum where AdamW keeps
    two moments; train/muon.py), whose largest matrix has `muon_matrix` elements (whole, however sharded).
    `state_dtype`: optim.state_dtype; bf16 moments take half the bytes, and their step (one tensor at a time,
    train/state_dtype.py) holds fp32 copies of one tensor's two moments and its denominator, not of all."""
    pb = DTYPE_BYTES[layout.param_dtype]
    stage = layout.zero_stage
    t = n_params if trainable is None else trainable
    per_moment = STATE_BYTES[state_dtype]
    moments = per_moment * (2 * (t - muon) + muon)
    if accounting == "zero-paper":
        master = 0 if pb == FP32 else FP32
        p, g, o = pb * n_params, pb * t, master * t + moments
        d_opt = layout.gradient_ranks if stage == 1 else layout.shard_ranks
        return ModelStates(params=p / (layout.shard_ranks if stage >= 3 else 1),
                           grads=g / (layout.shard_ranks if stage >= 2 else 1),
                           optimizer=o / (d_opt if stage >= 1 else 1), buffers=0.0,
                           step_temporary=FP32 * t / (d_opt if stage >= 1 else 1))
    if accounting != "runtime":
        raise ValueError(f"accounting={accounting} (allowed: {', '.join(ACCOUNTINGS)})")
    low = layout.compute_dtype in ("bf16", "fp16")
    frozen_bytes = DTYPE_BYTES[layout.compute_dtype] if low else FP32
    p, g, o = FP32 * t + frozen_bytes * (n_params - t), FP32 * t, moments
    adamw = t - muon  # AdamW's foreach temporaries cover its own parameters; Muon's are one matrix at a time
    if state_dtype != "fp32":  # one tensor at a time (its largest); a tensor's own size under sharding
        adamw = 3 * min(adamw, largest_tensor or adamw)
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
        if muon:  # ZeRO-1 keeps each matrix's momentum on its owner only; AdamW's states stay replicated
            o = per_moment * (2 * (t - muon) + muon / (layout.gradient_ranks if stage == 1 else 1))
            return ModelStates(p, g, o, buffers, step_temporary=FP32 * adamw + muon_temporaries(muon_matrix, muon),
                               first_step_grads=g if layout.gradient_ranks > 1 else 0.0)
        return ModelStates(p, g, 2 * per_moment * owned, buffers,
                           step_temporary=FP32 * (owned if state_dtype == "fp32" else adamw),
                           first_step_grads=g if layout.gradient_ranks > 1 else 0.0)
    d = layout.shard_ranks
    rb = DTYPE_BYTES[layout.reduce_dtype]
    if not layout.reshard_after_forward:  # gathered parameters stay from forward to backward; one unit's gradients unsharded
        buffers = pb * n_params + (pb + rb) * largest_unit
    else:  # current + prefetched block gathered, the root unit kept gathered for backward
        buffers = pb * (2 * largest_unit + root_params) + (pb + rb) * largest_unit
    states = ModelStates(p / d, g / d, o / d, buffers,
                         step_temporary=FP32 * adamw / d + muon_temporaries(muon_matrix, muon))
    if (layout.microbatches > 1 or layout.pp > 1) and not layout.reduces_every_microbatch:
        # on the device even with CPU offload; a pipeline schedule defers the reduce-scatter to after its last
        # micro-batch (`perform_reduce_grad`), even with one. Reduced every micro-batch, they add up in the shards.
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


def output_params(shape: ModelShape, layout: Layout, held) -> float:
    """The root unit's parameters whose gradients a block's backward finds made: the output layer's and the final
    norm's (the input embedding's come at the very end, unless it is the output layer's, tied)."""
    return shape.vocab_size * shape.dim / layout.tp + shape.dim if held.output else 0.0


def last_forward_output(shape: ModelShape, layout: Layout, held) -> float:
    """The output of a pipeline rank's last forward, which torch's schedules keep to the step's end: the logits in
    the compute dtype on the last stage, else the stage's output."""
    return last_stage_output_bytes(shape, layout) if held.output else stage_output_bytes(shape, layout)


def estimate_memory(shape: ModelShape, layout: Layout, accounting: str = "runtime",
                    fused_norm: bool = True, pp_rank: int | None = None, lora_rank: int = 0,
                    routing_skew: float = 1.0, muon: bool = False, state_dtype: str = "fp32",
                    objective: ObjectiveTerms = ObjectiveTerms()) -> MemoryEstimate:
    """The rank that needs the most memory (over pipeline stages), with every stage's total kept;
    with `pp_rank`, that pipeline rank's. `lora_rank` > 0: LoRA adapters on every projection train and
    the base (held as the runtime holds it, in fp32) is frozen. `routing_skew`: MoE routing (plan/moe.py).
    `muon`: optim.name=muon (the block matrices keep one moment instead of two); `state_dtype`: optim.state_dtype.
    `objective`: train.objective's rows per sample and frozen model (plan/objective.py)."""
    if objective.rows > 1:  # the trained model sees rows, not samples
        layout = layout.replace(micro_batch_size=layout.micro_batch_size * objective.rows,
                                global_batch_size=layout.global_batch_size * objective.rows)
    candidates = []
    ranks = {0, layout.pp - 1} | ({1} if layout.pp > 2 else set()) if pp_rank is None else {pp_rank}
    for pp_rank in sorted(ranks):
        held = rank_params(shape, layout, pp_rank)
        unit = layer_params(shape, layout.tp, layout.ep)
        largest = max(shape.dim * shape.ffn_hidden_dim // layout.tp,  # an MLP matrix, or the vocabulary's
                      shape.vocab_size * shape.dim // layout.tp if held.embedding or held.output else 0)
        adapters = held.layers * lora_layer_params(shape, lora_rank, layout.tp) if lora_rank else None
        matrices = muon_params(shape, held) if muon else 0.0
        states = model_state_bytes(held.total + (adapters or 0), layout, accounting, largest_unit=unit,
                                   root_params=held.root, largest_tensor=largest, trainable=adapters,
                                   muon=matrices, muon_matrix=shape.dim * max(shape.dim, shape.ffn_hidden_dim),
                                   state_dtype=state_dtype)
        if held.experts:  # the experts' states on their own data-parallel group
            states = moe_model_states(model_state_bytes, held, layout, accounting, largest, shape, muon, state_dtype)
        states.tables = rotary_table_bytes(shape)
        if objective.frozen is not None:  # sharded as the trained model's parameters, no gradients or states
            frozen = rank_params(objective.frozen, layout, pp_rank).total
            states.params += (FP32 if accounting == "runtime" else DTYPE_BYTES[layout.param_dtype]) * frozen / (
                layout.shard_ranks if layout.zero_stage >= 3 or (layout.zero_stage == 2 and accounting == "runtime")
                else 1)
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
        if held.output and lora_rank and layout.loss_chunk_tokens:  # a frozen head makes no fp32 weight gradient
            stat = 8 if layout.compute_dtype == "fp64" else FP32
            acts = replace(acts, saved=acts.saved - stat * shape.vocab_size / layout.tp * shape.dim)
        if held.output and objective.name == "distill":  # the teacher's terms in the student's output head
            kept, transient = distill_head_bytes(objective, shape, layout)
            acts = replace(acts, saved=acts.saved + kept, chunk=acts.chunk + transient if acts.chunk else 0.0)
        pipe = pipeline_recv_bytes(shape, layout, pp_rank) + pipeline_batch_bytes(layout) + \
            frozen_pipeline_bytes(objective, layout, pp_rank) if layout.pp > 1 else 0.0
        pb = DTYPE_BYTES[layout.param_dtype]
        gathered, all_held, expert_unit = 0.0, held.total, 0.0
        if held.experts and layout.experts_outside_fsdp:  # no FSDP unit gathers the experts (one-rank mesh)
            all_held -= held.experts
            unit -= moe_layer_params(shape, shape.n_layers - 1, layout.tp, layout.ep)[1]
        elif held.experts:  # FSDP2 gathers their padded rows (fewer experts than ranks sharing them)
            routed = moe_layer_params(shape, shape.n_layers - 1, layout.tp, layout.ep)[1]
            unit += (expert_shard_padding(shape, layout) - 1) * routed
            if layout.ep > 1:  # split experts are FSDP units of their own (parallel/expert.py)
                expert_unit = expert_shard_padding(shape, layout) * routed
        if layout.zero_stage >= 2:
            gathered = pb * (all_held if not layout.reshard_after_forward else held.root)
        est = MemoryEstimate(held.total + (adapters or 0), states, acts, pipe, pp_rank, trainable_per_rank=adapters)
        lora_unit = lora_layer_params(shape, lora_rank, layout.tp) if lora_rank else None
        est.moments = alive_at_moments(states, acts, layout, gathered, unit if layout.zero_stage >= 2 else 0.0, held.root, pipe,
                               grad_unit=lora_unit if layout.zero_stage >= 2 else None,
                               grad_root=0.0 if lora_rank else output_params(shape, layout, held) if layout.pp == 1 else None,
                               all_gathered=pb * all_held,
                               mlp=mlp_backward_bytes(shape, layout.micro_batch, layout.seq_len // layout.cp, layout),
                               product=mlp_product_bytes(shape, layout.micro_batch, layout.seq_len // layout.cp, layout),
                               layers=held.layers, reduced=held.root or unit,
                               early_root=held.root - (table if held.embedding and not tied else 0),
                               last_output=last_forward_output(shape, layout, held) if layout.pp > 1 else 0.0,
                               expert_unit=expert_unit if layout.zero_stage >= 2 else 0.0)
        candidates.append(est)
    worst = max(candidates, key=lambda m: m.total)
    worst.per_stage = [{"pp_rank": m.pp_rank, "total": m.total, "activations": m.activations.peak,
                        "in_flight": m.activations.in_flight} for m in candidates]
    return worst
