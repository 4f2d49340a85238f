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
from disttrain.splits import split_layers

ACCOUNTINGS = ("runtime", "zero-paper")
FP32 = 4
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32


@dataclass
class RankParams:
    """Parameters one rank holds after tensor and pipeline splitting, before data-parallel sharding."""

    layers: int
    embedding: bool
    output: bool
    block: int  # parameters in those layers
    root: int  # embeddings, output layer, final norm: FSDP's root unit

    @property
    def total(self) -> int:
        return self.block + self.root


def layer_params(shape: ModelShape, tp: int = 1) -> int:
    kv_dim = shape.n_kv_heads * shape.head_dim
    matrices = 2 * shape.dim * shape.dim + 2 * shape.dim * kv_dim + 3 * shape.dim * shape.ffn_hidden_dim
    return matrices // tp + 2 * shape.dim  # the two RMSNorm weights are replicated across tp


def stage_layers(shape: ModelShape, layout: Layout) -> list[list[int]]:
    """Layer counts of the (virtual) stages each pipeline rank owns; rank r owns stages r, r+pp, ..."""
    counts = split_layers(shape.n_layers, layout.pp * layout.stages_per_rank)
    return [counts[r::layout.pp] for r in range(layout.pp)]


def rank_params(shape: ModelShape, layout: Layout, pp_rank: int = 0) -> RankParams:
    per_stage = stage_layers(shape, layout)[pp_rank]
    n_stages = layout.pp * layout.stages_per_rank
    first = pp_rank == 0
    last = (n_stages - 1) % layout.pp == pp_rank
    table = shape.vocab_size * shape.dim // layout.tp
    root = 0
    if first:
        root += table
    if last:
        root += shape.dim  # final norm
        # A tied output matrix is the embedding itself when one rank holds both.
        if not (shape.tie_embeddings and first):
            root += table
    layers = sum(per_stage)
    return RankParams(layers, first, last, layers * layer_params(shape, layout.tp), root)


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


def model_state_bytes(n_params: float, layout: Layout, accounting: str = "runtime",
                      largest_unit: float = 0.0, root_params: float = 0.0, largest_tensor: float = 0.0) -> ModelStates:
    """Bytes of parameters, gradients and optimizer states one rank holds for `n_params` parameters
    (already split by tp/pp). `largest_unit`/`root_params` size FSDP's gather buffers; `largest_tensor`
    (parameters of the biggest one) bounds ZeRO-1's share from below: torch's ZeroRedundancyOptimizer
    gives whole tensors to ranks, so one rank holds the embedding's states (measured by the dry run)."""
    pb = DTYPE_BYTES[layout.param_dtype]
    stage = layout.zero_stage
    if accounting == "zero-paper":
        master = 0 if pb == FP32 else FP32
        p, g, o = pb * n_params, pb * n_params, (master + ADAM_MOMENT_BYTES) * n_params
        d_opt = layout.dp if stage == 1 else layout.dp_shard
        return ModelStates(params=p / (layout.dp_shard if stage >= 3 else 1),
                           grads=g / (layout.dp_shard if stage >= 2 else 1),
                           optimizer=o / (d_opt if stage >= 1 else 1), buffers=0.0,
                           step_temporary=FP32 * n_params / (d_opt if stage >= 1 else 1))
    if accounting != "runtime":
        raise ValueError(f"accounting={accounting} (allowed: {', '.join(ACCOUNTINGS)})")
    p, g, o = FP32 * n_params, FP32 * n_params, ADAM_MOMENT_BYTES * n_params
    if stage <= 1:
        # DDP: gradients are views into its buckets (gradient_as_bucket_view); autocast keeps a
        # low-precision copy of each weight for the backward - of every weight without checkpointing; with
        # it, a block's copies are remade in its recomputation, so only the uncheckpointed root's stay,
        # plus the block being recomputed (measured by the dry run: 7b ZeRO-1 selective, 0.6 not 12.6 GiB).
        held_copies = n_params if layout.activation_checkpointing == "none" else root_params + largest_unit
        buffers = pb * held_copies if pb != FP32 else 0.0
        owned = max(n_params / layout.dp, largest_tensor) if stage == 1 else n_params
        return ModelStates(p, g, ADAM_MOMENT_BYTES * owned, buffers, step_temporary=FP32 * owned,
                           first_step_grads=g if layout.dp > 1 else 0.0)
    d = layout.dp_shard
    rb = DTYPE_BYTES[layout.reduce_dtype]
    if not layout.reshard_after_forward:  # gathered parameters stay from forward to backward; one unit's gradients unsharded
        buffers = pb * n_params + (pb + rb) * largest_unit
    else:  # current + prefetched block gathered, the root unit kept gathered for backward
        buffers = pb * (2 * largest_unit + root_params) + (pb + rb) * largest_unit
    states = ModelStates(p / d, g / d, o / d, buffers, step_temporary=FP32 * n_params / d)
    if layout.microbatches > 1:  # on the device even with CPU offload
        states.unsharded_grads = rb * n_params
    if layout.cpu_offload:
        states.cpu = states.params + states.grads + states.optimizer
        states.params = states.grads = states.optimizer = states.step_temporary = 0.0
    return states


# ---------------------------------------------------------------- activations


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes per transformer layer, Korthikanti et al. 2022 (fp16, GPT with dropout):
    sbh(34 + 5as/h) without parallelism; tensor parallel sbh(10 + 24/t + 5as/ht); with sequence
    parallel sbh(34/t + 5as/ht); selective recomputation drops the 5as/h term; full keeps 2sbh."""
    sbh = s * b * h
    attention = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * (34 / t + attention)
    return sbh * (10 + 24 / t + attention)


def korthikanti_in_flight_factor(pp: int, microbatches: int, schedule: str, virtual_stages: int = 1) -> float:
    """How many micro-batches' worth of its layers the first stage holds, relative to one: 1F1B
    keeps p in flight (so L/p layers × p = L layers in all), interleaving (v chunks) multiplies
    that by 1 + (p−1)/(p·v) (Korthikanti et al. 2022, section 4.2.3), GPipe keeps all m."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    in_flight = float(min(pp, microbatches))
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        in_flight *= 1 + (pp - 1) / (pp * virtual_stages)
    return min(in_flight, float(microbatches))


@dataclass
class LayerActivations:
    saved: float  # held from a layer's forward to its backward, per micro-batch
    transient: float  # extra while that layer's backward runs (recomputed tensors)


def _norm_bytes(e: int, tokens: int, h: int, r: int, fused: bool) -> float:
    """RMSNorm: the fused CUDA kernel keeps its input and the fp32 reciprocal RMS; the decomposed
    one (CPU) keeps the input upcast to fp32 and the fp32 normalised x̂. The output is saved by the
    matmul it feeds (whole under sequence parallelism: the all-gathered copy)."""
    kept_input = e if fused else 2 * FP32
    return kept_input * tokens * h / r + FP32 * tokens / r + e * tokens * h


def layer_activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout,
                           fused_norm: bool = True) -> LayerActivations:
    """Saved tensors of one `TransformerBlock` of models/llama.py, counted from what autograd keeps
    (checked against saved-tensor hooks in tests/test_plan.py):
    attention: what RMSNorm keeps (see `_norm_bytes`) and its output, q, k, v, SDPA output
    and log-sum-exp (flash attention stores no s×s scores); MLP: its input, norm output, w1 and w3
    outputs, SiLU output and the gated product. Under tensor parallelism the head/FFN-split tensors
    divide by tp; with sequence parallelism so does the residual stream, but the all-gathered input
    of each column-parallel matmul is saved whole (DTensor keeps it; Megatron re-gathers it)."""
    e = DTYPE_BYTES[layout.param_dtype]
    t = layout.tp
    r = t if layout.sequence_parallel else 1
    sb = seq_len * micro_batch
    h, f = shape.dim, shape.ffn_hidden_dim
    kv = shape.n_kv_heads * shape.head_dim
    per_norm = _norm_bytes(e, sb, h, r, fused_norm)
    attention = e * sb * (h + 2 * kv + h) / t + FP32 * micro_batch * (shape.n_heads // t) * seq_len  # q k v out, lse
    mlp = 4 * e * sb * f / t
    full = 2 * per_norm + attention + mlp
    residual = e * sb * h / r
    mode = layout.activation_checkpointing
    if mode == "full":
        return LayerActivations(saved=residual, transient=full)
    if mode == "selective":
        # Kept: block input, every matmul output (q, k, v, wo, w1, w3, w2; row-parallel outputs are
        # full-size partial sums) and the attention output; the rest is recomputed.
        kept = residual + attention + e * sb * 2 * f / t + 2 * e * sb * h
        return LayerActivations(saved=kept, transient=max(full - kept, 0.0))
    return LayerActivations(saved=full, transient=0.0)


@dataclass
class StageActivations:
    saved: float
    transient: float
    in_flight: float

    @property
    def peak(self) -> float:
        return self.saved + self.transient


def stage_activation_bytes(shape: ModelShape, layout: Layout, pp_rank: int, fused_norm: bool = True) -> StageActivations:
    mb, s = layout.micro_batch, layout.seq_len
    held = rank_params(shape, layout, pp_rank)
    layer = layer_activation_bytes(shape, mb, s, layout, fused_norm)
    if pp_rank == 0:
        in_flight = korthikanti_in_flight_factor(layout.pp, layout.microbatches, layout.pp_schedule,
                                                 layout.stages_per_rank)
    else:  # later stages start their backwards sooner: rank r of 1F1B keeps p - r in flight
        first = korthikanti_in_flight_factor(layout.pp, layout.microbatches, layout.pp_schedule, layout.stages_per_rank)
        in_flight = max(1.0, first * (layout.pp - pp_rank) / layout.pp) if layout.pp_schedule != "gpipe" else first
    e = DTYPE_BYTES[layout.param_dtype]
    saved = held.layers * layer.saved * in_flight
    transient = layer.transient
    if held.embedding:
        saved += 8 * mb * s * in_flight  # token ids the embedding backward needs
    if held.output:
        r = layout.tp if layout.sequence_parallel else 1
        norm = _norm_bytes(e, mb * s, shape.dim, r, fused_norm)
        logits = FP32 * mb * s * shape.vocab_size / layout.tp  # fp32 log-softmax kept by the loss
        saved += norm + logits
        transient = max(transient, 2 * logits)  # its gradient and the logits' in backward
    return StageActivations(saved, transient, in_flight)


# ---------------------------------------------------------------- one rank, all of it


@dataclass
class MemoryEstimate:
    params_per_rank: int  # parameter count after tp/pp splitting, before data-parallel sharding
    states: ModelStates
    activations: StageActivations
    pipeline_buffers: float
    pp_rank: int
    per_stage: list[dict] = field(default_factory=list)

    @property
    def buffers(self) -> float:
        return self.states.buffers + self.pipeline_buffers

    @property
    def backward_total(self) -> float:
        """Forward/backward: states, activations, gather and transfer buffers."""
        s = self.states
        return s.params + s.grads + s.unsharded_grads + s.optimizer + self.activations.peak + self.buffers

    @property
    def step_total(self) -> float:
        """The optimizer step: activations and buffers are freed, AdamW's temporaries are not yet."""
        s = self.states
        return s.params + s.grads + s.optimizer + s.step_temporary

    @property
    def first_step_total(self) -> float:
        """DDP's first forward/backward: no optimizer states yet, a second copy of the gradients."""
        s = self.states
        return s.params + s.grads + s.first_step_grads + self.activations.peak + self.buffers

    @property
    def total(self) -> float:
        return max(self.backward_total, self.step_total, self.first_step_total)

    def categories(self) -> dict:
        """The dry run's categories (dryrun/simulate.py) at whichever peak is higher: gathered parameters,
        FSDP's and DDP's collective buffers and pipeline transfer buffers are `communication`; what
        backward adds on top of the saved activations is `temporary`; the optimizer step's temporaries
        count with the optimizer (the tracker files what the step creates there)."""
        s = self.states
        if self.first_step_total > max(self.backward_total, self.step_total):
            return {"parameters": s.params, "gradients": s.grads, "optimizer": 0.0,
                    "activations": self.activations.saved,
                    "temporary": self.activations.transient + s.first_step_grads, "communication": self.buffers}
        if self.step_total > self.backward_total:
            return {"parameters": s.params, "gradients": s.grads, "optimizer": s.optimizer + s.step_temporary,
                    "activations": 0.0, "temporary": 0.0, "communication": 0.0}
        return {"parameters": s.params, "gradients": s.grads + s.unsharded_grads, "optimizer": s.optimizer,
                "activations": self.activations.saved, "temporary": self.activations.transient,
                "communication": self.buffers}

    def as_dict(self) -> dict:
        s = self.states
        return {"params": s.params, "grads": s.grads, "unsharded_grads": s.unsharded_grads, "optimizer": s.optimizer,
                "activations": self.activations.peak, "buffers": self.buffers, "total": self.total,
                "backward_total": self.backward_total, "optimizer_step_total": self.step_total,
                "first_step_total": self.first_step_total, "cpu_offloaded": s.cpu}


def estimate_memory(shape: ModelShape, layout: Layout, accounting: str = "runtime",
                    fused_norm: bool = True, pp_rank: int | None = None) -> MemoryEstimate:
    """The rank that needs the most memory (over pipeline stages), with every stage's total kept;
    with `pp_rank`, that pipeline rank's."""
    candidates = []
    ranks = {0, layout.pp - 1} | ({1} if layout.pp > 2 else set()) if pp_rank is None else {pp_rank}
    for pp_rank in sorted(ranks):
        held = rank_params(shape, layout, pp_rank)
        unit = layer_params(shape, layout.tp)
        largest = max(shape.dim * shape.ffn_hidden_dim // layout.tp,  # an MLP matrix, or the vocabulary's
                      shape.vocab_size * shape.dim // layout.tp if held.embedding or held.output else 0)
        states = model_state_bytes(held.total, layout, accounting, largest_unit=unit, root_params=held.root,
                                   largest_tensor=largest)
        acts = stage_activation_bytes(shape, layout, pp_rank, fused_norm)
        e = DTYPE_BYTES[layout.param_dtype]
        pipe = 0.0
        if layout.pp > 1:  # a send and a receive buffer per neighbour direction and virtual stage
            pipe = 2 * e * layout.micro_batch * layout.seq_len * shape.dim * layout.stages_per_rank
        candidates.append(MemoryEstimate(held.total, states, acts, pipe, pp_rank))
    worst = max(candidates, key=lambda m: m.total)
    worst.per_stage = [{"pp_rank": m.pp_rank, "total": m.total, "activations": m.activations.peak,
                        "in_flight": m.activations.in_flight} for m in candidates]
    return worst
