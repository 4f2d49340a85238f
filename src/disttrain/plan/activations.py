"""Activation bytes per rank: Korthikanti et al. 2022's formulas (for reference and tests), and this
framework's Llama block counted tensor by tensor from what autograd keeps on a GPU.

Three dtypes matter. `compute` is what the matmuls write (the autocast or FSDP parameter dtype). The
`residual` stream is that dtype too, except under autocast over fp32 weights (DDP, ZeRO-1, or FSDP with
fp32 parameters), where the embedding's output and every residual sum stay fp32. Logits are upcast to
fp32 for the loss. RMSNorm keeps its input and an fp32 reciprocal RMS (torch's fused CUDA kernel;
counted on a GPU by benchmarks/dryrun_vs_real.py --saved-by-device).
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.layout import DTYPE_BYTES, Layout
from disttrain.models.shape import ModelShape
from disttrain.plan.params import rank_params

FP32 = 4
TOKEN_ID = 8  # int64 token ids the embedding's backward keeps


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


def autocast(layout: Layout) -> bool:
    """Matmuls in a lower precision than the stored fp32 weights: torch.autocast casts per op."""
    stored = "fp32" if layout.zero_stage <= 1 or layout.engine != "torch" else layout.param_dtype
    compute = layout.param_dtype if layout.zero_stage <= 1 else layout.compute_dtype
    return stored == "fp32" and compute in ("bf16", "fp16")


def dtype_bytes(layout: Layout) -> tuple[int, int]:
    """(compute, residual) bytes per element."""
    if autocast(layout):
        return DTYPE_BYTES[layout.param_dtype if layout.zero_stage <= 1 else layout.compute_dtype], FP32
    e = DTYPE_BYTES[layout.param_dtype]
    return e, e


@dataclass
class LayerActivations:
    saved: float  # held from a layer's forward to its backward, per micro-batch
    transient: float  # extra while that layer's backward runs (recomputed tensors)


def _norm_bytes(er: int, tokens: int, h: int, r: int, fused: bool) -> float:
    """What one RMSNorm keeps: its input and the fp32 reciprocal RMS (fused CUDA kernel), or the input
    upcast to fp32 and the fp32 normalised x̂ besides (the CPU's decomposition)."""
    kept_input = er if fused else 2 * FP32
    return kept_input * tokens * h / r + FP32 * tokens / r


def layer_activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout,
                           fused_norm: bool = True) -> LayerActivations:
    """Saved tensors of one `TransformerBlock` of models/llama (checked against saved-tensor hooks in
    tests/test_plan.py): each RMSNorm's input and reciprocal RMS, and its output as the next matmul
    keeps it (under autocast each matmul keeps its own cast copy: three for q/k/v, two for w1/w3;
    whole under sequence parallelism: the all-gathered copy); q, k, v, the attention output and its
    log-sum-exp (flash attention keeps no s×s scores); the w1 and w3 outputs, SiLU's output and the gated
    product. Head- and FFN-split tensors divide by tp; with sequence parallelism so does the residual."""
    ec, er = dtype_bytes(layout)
    t = layout.tp
    r = t if layout.sequence_parallel else 1
    sb = seq_len * micro_batch
    h, f = shape.dim, shape.ffn_hidden_dim
    kv = shape.n_kv_heads * shape.head_dim
    copies = (3, 2) if autocast(layout) else (1, 1)
    norms = 2 * _norm_bytes(er, sb, h, r, fused_norm) + ec * sb * h * sum(copies)
    attention = ec * sb * (h + 2 * kv + h) / t + FP32 * micro_batch * (shape.n_heads // t) * seq_len  # q k v out, lse
    mlp = 4 * ec * sb * f / t
    full = norms + attention + mlp
    residual = er * sb * h / r
    mode = layout.activation_checkpointing
    if mode == "full":
        return LayerActivations(saved=residual, transient=full)
    if mode == "selective":
        # Kept: block input, every matmul output (q, k, v, wo, w1, w3, w2; row-parallel outputs are
        # full-size partial sums) and the attention output; the rest is recomputed.
        kept = residual + attention + ec * sb * 2 * f / t + 2 * ec * sb * h
        return LayerActivations(saved=kept, transient=max(full - kept, 0.0))
    return LayerActivations(saved=full, transient=0.0)


@dataclass
class StageActivations:
    saved: float  # every in-flight micro-batch's saved tensors, and the loss's
    transient: float  # the most that backward adds on top at one time
    in_flight: float
    logits: float = 0.0  # the fp32 log-softmax the loss keeps (last stage)
    layer: float = 0.0  # one layer's recomputed tensors (checkpointing)

    @property
    def peak(self) -> float:
        return self.saved + self.transient


def stage_activation_bytes(shape: ModelShape, layout: Layout, pp_rank: int, fused_norm: bool = True) -> StageActivations:
    mb, s = layout.micro_batch, layout.seq_len // layout.cp  # a context rank holds seq_len / cp tokens
    held = rank_params(shape, layout, pp_rank)
    layer = layer_activation_bytes(shape, mb, s, layout, fused_norm)
    if layout.cp > 1:
        from disttrain.plan.context import context_extra_bytes

        extra = context_extra_bytes(shape, layout, dtype_bytes(layout)[0])
        layer = LayerActivations(saved=layer.saved + extra, transient=layer.transient)
    first = korthikanti_in_flight_factor(layout.pp, layout.microbatches, layout.pp_schedule, layout.stages_per_rank)
    if pp_rank == 0 or layout.pp_schedule == "gpipe":
        in_flight = first
    else:  # later stages start their backwards sooner: rank r of 1F1B keeps p - r in flight
        in_flight = max(1.0, first * (layout.pp - pp_rank) / layout.pp)
    ec, er = dtype_bytes(layout)
    saved = held.layers * layer.saved * in_flight
    logits = 0.0
    if held.embedding:
        saved += TOKEN_ID * mb * s * in_flight
    if held.output:
        r = layout.tp if layout.sequence_parallel else 1
        logits = FP32 * mb * s * shape.vocab_size / layout.tp  # fp32 log-softmax kept by the loss
        # A pipeline's last stage also holds its output (the logits in the compute dtype) for the schedule's
        # backward; GPipe runs every micro-batch's forward and loss first, so it holds all of them.
        output = ec * mb * s * shape.vocab_size / layout.tp if layout.pp > 1 else 0.0
        losses = in_flight if layout.pp > 1 and layout.pp_schedule == "gpipe" else 1.0
        saved += losses * (_norm_bytes(er, mb * s, shape.dim, r, fused_norm) + ec * mb * s * shape.dim + logits + output)
    return StageActivations(saved, max(layer.transient, 2 * logits), in_flight, logits, layer.transient)
