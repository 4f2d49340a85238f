"""Activation bytes per rank: this framework's Llama block counted tensor by tensor from what autograd keeps on a
GPU (Korthikanti et al. 2022's formulas, for reference, in plan/korthikanti.py).

Three dtypes matter. `compute` is what the matmuls write (the autocast or FSDP parameter dtype). The
`residual` stream is that dtype too, except under autocast over fp32 weights (DDP, ZeRO-1, or FSDP with
fp32 parameters), where the embedding's output and every residual sum stay fp32. Logits are upcast to
fp32 for the loss. RMSNorm keeps its input and an fp32 reciprocal RMS (torch's fused CUDA kernel;
counted on a GPU by benchmarks/dryrun_vs_real.py --saved-by-device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.models.shape import ModelShape
from disttrain.plan.dtypes import FP32, autocast, dtype_bytes  # noqa: F401 (re-exported)
from disttrain.plan.eager_scores import eager_held_scores, eager_mask_bytes, eager_scores_bytes  # noqa: F401
from disttrain.plan.korthikanti import korthikanti_in_flight_factor
from disttrain.plan.mixer_backward import mixer_backward_bytes
from disttrain.plan.mixers import mixer_bytes
from disttrain.plan.norms import norm_bytes, norm_fused
from disttrain.plan.params import layer_params, rank_params, stage_layers
from disttrain.plan.per_layer_inputs import carried_bytes, counts_layers, has_moe_branch
from disttrain.plan.per_layer_recompute import (after_attention_bytes, average_layer_bytes, layer_transient_bytes,
                                                stage_saved_bytes)
from disttrain.plan.routed import skew_change
from disttrain.plan.schedule_memory import HeldAt, schedule_order, schedule_peak, weight_gradient_inputs_bytes

TOKEN_ID = 8  # int64 token ids the embedding's backward keeps


@dataclass
class LayerActivations:
    saved: float  # held from a layer's forward to its backward, per micro-batch
    transient: float  # extra while that layer's backward runs (recomputed tensors)


def rotary_input_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """FSDP2's mixed precision casts each block's floating-point inputs to the parameter dtype, the rotary
    tables among them: one copy per block, which its rotary products keep for the backward. Whole tables
    (max_seq_len rows) unless positions pick this rank's rows (context parallelism). transformers' models
    compute theirs per forward in the hidden states' dtype, which FSDP2 leaves alone."""
    if not shape.rotary_tables or layout.zero_stage < 2 or layout.engine != "torch" or layout.param_dtype == "fp32":
        return 0.0
    rows = micro_batch * seq_len if layout.cp > 1 else shape.max_seq_len
    return 2 * DTYPE_BYTES[layout.param_dtype] * rows * shape.head_dim


def layer_activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout,
                           fused_norm: bool = True, accumulating: bool = False) -> LayerActivations:
    """Saved tensors of one `TransformerBlock` of models/llama (checked against saved-tensor hooks in
    tests/test_plan.py): each RMSNorm's input and reciprocal RMS, and its output as the next matmul
    keeps it (under autocast each matmul keeps its own cast copy: three for q/k/v, two for w1/w3;
    whole under sequence parallelism: the all-gathered copy); q, k, v, the attention output and its
    log-sum-exp (flash attention keeps no s×s scores); the w1 and w3 outputs, SiLU's output and the gated
    product. Head- and FFN-split tensors divide by tp; with sequence parallelism so does the residual.
    `accumulating`: FSDP's gradients accumulate over micro-batches (Gemma 4's layers differ: what the layers after
    the fullest one release counts)."""
    ec, er = dtype_bytes(layout)
    if layout.activation_checkpointing == "none":  # recomputed norms: see norm_fused
        fused_norm = norm_fused(shape, fused_norm)
    if counts_layers(shape, layout):  # Gemma 4 (plan/per_layer_recompute.py): the model's average layer
        return LayerActivations(saved=average_layer_bytes(shape, layout, micro_batch, seq_len),
                                transient=layer_transient_bytes(shape, layout, micro_batch, seq_len, accumulating))
    t = layout.tp
    r = t if layout.sequence_parallel else 1
    sb = seq_len * micro_batch
    h, f = shape.dim, shape.ffn_hidden_dim
    kv, q = shape.n_kv_heads * shape.head_dim, shape.n_heads * shape.head_dim  # q: h unless a head size is set
    copies = (3, 2) if autocast(layout) else (1, 1)
    norms = 2 * norm_bytes(er, sb, h, r, fused_norm, shape.norm_kind) + ec * sb * h * sum(copies)
    scores = eager_scores_bytes(shape, micro_batch, seq_len, layout)
    # Under autocast the probabilities' product with v keeps its own compute-dtype copy of them.
    kept_scores = scores * (1 + ec / er) if autocast(layout) else scores
    if scores:  # eager: k and v repeated to every query head, the probabilities instead of the log-sum-exp
        attention = ec * sb * 4 * q / t + kept_scores
    else:
        attention = ec * sb * (2 * q + 2 * kv) / t + FP32 * micro_batch * (shape.n_heads // t) * seq_len  # q k v out, lse
    attention_kept = attention
    mixer = mixer_bytes(shape, micro_batch, seq_len, t, ec, attention, layout.cp)  # latent or linear attention
    if mixer is not None:
        attention, attention_kept = mixer
    mlp = 4 * ec * sb * f / t
    rotary = rotary_input_bytes(shape, micro_batch, seq_len, layout)  # kept whatever the checkpointing
    full = norms + attention + mlp + rotary
    residual = er * sb * h / r + rotary
    mode = layout.activation_checkpointing
    backward = eager_held_scores(mode) * scores  # beside the saved ones at the attention's fullest moment
    if mode == "full":
        return LayerActivations(saved=residual, transient=full + backward)
    if mode == "selective":
        # Kept: block input, every matmul output (q, k, v, wo, w1, w3, w2; row-parallel outputs are
        # full-size partial sums) and the attention output; the rest is recomputed.
        kept = residual + attention_kept + ec * sb * 2 * f / t + 2 * ec * sb * h
        # Eager: the q·kᵀ product is kept, not the probabilities; their recomputation is among the held scores.
        product = scores * ec / er
        kept += product - kept_scores
        return LayerActivations(saved=kept, transient=max(full - kept - (kept_scores - product), 0.0) + backward)
    return LayerActivations(saved=full, transient=backward)


def mlp_backward_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """The gradients a block's MLP backward holds at once beyond the layer's saved and recomputed tensors, at
    the gated product's backward: the w2 input's gradient and the product's two input gradients (three
    FFN-sized tensors, while the w2 input itself is freed: two more in all), in the compute dtype, and w2's
    fresh weight gradient in the compute dtype where gradients are kept apart from it (FSDP2's unsharded
    gradients; autocast over fp32 weights). Found by the dry run's tracker at the peak (`tiny`, pp=2 1F1B,
    no data parallelism: three FFN-sized temporaries in every checkpointing mode; 13b, pp=2 ZeRO-3: the
    bf16 weight gradient besides). Dense blocks only: a mixture of experts' backward is counted in plan/moe.py."""
    if shape.moe is not None:
        return 0.0
    ec, _ = dtype_bytes(layout)
    f = shape.ffn_hidden_dim / layout.tp
    fresh = layout.zero_stage >= 2 or autocast(layout)
    return ec * micro_batch * seq_len * 2 * f + (ec * shape.dim * f if fresh else 0.0)


def mlp_product_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """The SwiGLU's gated product, among a dense block's saved tensors without checkpointing (compute dtype)."""
    if shape.moe is not None or layout.activation_checkpointing != "none":
        return 0.0
    return dtype_bytes(layout)[0] * micro_batch * seq_len * shape.ffn_hidden_dim / layout.tp


def last_stage_output_bytes(shape: ModelShape, layout: Layout) -> float:
    """One micro-batch's output of a pipeline's last stage: the logits in the compute dtype, which torch's
    schedules keep for the stage's backward (and the last forward's to the step's end); a chunked loss head
    returns the loss sum instead (nothing to count)."""
    if layout.loss_chunk_tokens:
        return 0.0
    ec, _ = dtype_bytes(layout)
    return ec * layout.micro_batch * (layout.seq_len // layout.cp) * shape.vocab_size / layout.tp


def chunked_loss_bytes(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """(kept, transient) of the output head computing the loss in chunks (models/output_head.py). Kept from its
    forward to its backward: the gradients it computed on the way, the hidden states' (the residual's dtype) and
    the weight's vocabulary slice (fp32; fp64 in an fp64 run). Transient while a chunk is at hand: its logits in
    the compute dtype, their fp32 copy, the exponentials and the difference they are taken of; or later the logits
    and their gradient (compute dtype) with the weight gradient's chunk term (compute dtype, then its fp32 copy);
    and the head's input, the final norm's output
    (under sequence parallelism its slice and the gathered whole)."""
    ec, er = dtype_bytes(layout)
    stat = 8 if layout.compute_dtype == "fp64" else FP32
    tokens = layout.micro_batch * (layout.seq_len // layout.cp)
    vocab = shape.vocab_size / layout.tp
    chunk = min(tokens, layout.loss_chunk_tokens)
    kept = er * tokens * shape.dim + stat * vocab * shape.dim
    head_input = er * tokens * shape.dim * (1 + (1 / layout.tp if layout.sequence_parallel else 0))
    copy = stat if stat != ec else 0  # a cast to the dtype a tensor already has makes no copy
    transient = max((ec + copy + 2 * stat) * chunk * vocab,
                    2 * ec * chunk * vocab + (ec + copy) * vocab * shape.dim)
    return kept, head_input + transient


def stage_output_bytes(shape: ModelShape, layout: Layout, stage: int = 0) -> float:
    """One micro-batch's output of a pipeline stage other than the last (the residual stream, split by
    sequence parallelism, and what Gemma 4's `stage` carries besides), which torch's `PipelineStage` keeps from
    its forward to its backward (`fwd_cache`); no layer of the stage saves it."""
    _, er = dtype_bytes(layout)
    r = layout.tp if layout.sequence_parallel else 1
    return er * layout.micro_batch * (layout.seq_len // layout.cp) * shape.dim / r + carried_bytes(shape, layout, stage)


def input_grad_bytes(shape: ModelShape, layout: Layout) -> float:
    """Zero-bubble: the gradient of a micro-batch's input that a stage's input-gradient pass (torch's
    `stage_backward_input`) leaves as its receive buffer's `.grad` until the next step (all but the first stage)."""
    return stage_output_bytes(shape, layout) if layout.pp_schedule == "zero_bubble" else 0.0


def pipeline_recv_bytes(shape: ModelShape, layout: Layout, pp_rank: int) -> float:
    """The receive buffers torch's `PipelineStage` allocates once, for every micro-batch of the step, and
    keeps across steps (`_prepare_forward_infra`, `_setup_backward_recv_info`): each stage but the first
    receives its input, each but the last its output's gradient, both shaped like a stage output."""
    ends = 0.0
    for local in range(layout.stages_per_rank):
        stage = local * layout.pp + pp_rank
        ends += (stage > 0) * stage_output_bytes(shape, layout, stage - 1)
        ends += (stage < layout.n_stages - 1) * stage_output_bytes(shape, layout, stage)
    return layout.microbatches * ends


def pipeline_batch_bytes(layout: Layout) -> float:
    """The token ids and targets of every micro-batch of the step, which the pipeline engine hands the
    schedule as one batch on every rank (the schedule splits it)."""
    return 2 * TOKEN_ID * layout.microbatches * layout.micro_batch * layout.seq_len


@dataclass
class StageActivations:
    saved: float  # every in-flight micro-batch's saved tensors, and the loss's
    transient: float  # the most that backward adds on top at one time
    in_flight: float
    logits: float = 0.0  # the fp32 log-softmax the loss keeps (last stage)
    layer: float = 0.0  # one layer's recomputed tensors (checkpointing)
    # Several stages per rank (interleaved 1F1B, zero-bubble): what is held at a block's backward and at the
    # loss's, from the schedule's order (activations there are in `saved` and `saved_at_loss`).
    at_block: HeldAt | None = None
    at_loss: HeldAt | None = None
    saved_at_loss: float = 0.0
    layer_saved: float = 0.0  # one layer's saved tensors (one micro-batch), freed once its backward is done
    block_freed: float = 0.0  # saved tensors gone by the fullest moment of a block's backward (block_backward_bytes)
    # of `layer`, what attention's backward (its ring, its kernel's gradients) holds beyond the MLP's or experts'
    # moment: it runs after them, once an MoE block's experts have been reduced (plan/peak_moments.py)
    attention_excess: float = 0.0
    loss_inputs: float = 0.0  # of those, the final norm's and the output layer's saved inputs (last stage)
    # Of a block's parameters, the share whose gradient exists at the fullest moment of its backward (inside
    # the MLP's: the output projection's, w2); the rest are made after it (1.0 where not counted: MoE blocks).
    grad_share: float = 1.0
    chunk: float = 0.0  # one chunk's temporaries in a chunked loss head's forward (last stage)
    input_grads: float = 0.0  # zero-bubble: every micro-batch's input gradient, kept to the next step

    @property
    def peak(self) -> float:
        """The fuller of the loss's backward (everything saved, the logits' gradients) and a block's (less what it
        has freed by its fullest moment, plus what it holds then)."""
        return max(self.saved + 2 * self.logits, self.saved - self.logits - self.block_freed + self.layer)


def stage_activation_bytes(shape: ModelShape, layout: Layout, pp_rank: int, fused_norm: bool = True,
                           routing_skew: float = 1.0, accumulated_grads: float = 0.0) -> StageActivations:
    """`accumulated_grads`: the unsharded gradients this rank accumulates (zero-bubble's peak may come
    before some stages' first weight pass, where they do not exist yet)."""
    mb, s = layout.micro_batch, layout.seq_len // layout.cp  # a context rank holds seq_len / cp tokens
    ec, er = dtype_bytes(layout)
    final_fused = norm_fused(shape, fused_norm)  # the final norm's, never recomputed
    held = rank_params(shape, layout, pp_rank)
    layer = layer_activation_bytes(shape, mb, s, layout, fused_norm, accumulated_grads > 0)
    attention = layer_activation_bytes(replace(shape, ffn_hidden_dim=0, moe=None), mb, s, layout, fused_norm,
                                       accumulated_grads > 0)
    recounted = counts_layers(shape, layout) and layout.activation_checkpointing != "none"  # Gemma 4, recomputed
    if recounted:  # its attention's moment: without what follows the attention
        attention = replace(layer, transient=layer.transient - after_attention_bytes(shape, layout, mb, s))
    ring = mixer_backward_bytes(shape, mb, s, layout, ec, er)  # the widest token mixer's backward, beyond the average
    ring_forward = extra = 0.0
    if layout.cp > 1:
        from disttrain.plan.context import context_extra_bytes, context_recomputed_bytes, ring_temporary_bytes

        extra, (ring_forward, ring_backward) = context_extra_bytes(shape, layout, ec), \
            ring_temporary_bytes(shape, layout, ec)
        ring += ring_backward
        remade = context_recomputed_bytes(shape, layout, ec)  # attention's too: remade for its backward
        ring += 0.0 if recounted else remade  # Gemma 4: among the recomputed tensors from its backward's first op
        layer, attention = (replace(part, saved=part.saved + extra, transient=part.transient + remade * recounted)
                            for part in (layer, attention))
    first = korthikanti_in_flight_factor(layout.pp, layout.microbatches, layout.pp_schedule, layout.stages_per_rank)
    if pp_rank == 0 or layout.pp_schedule == "gpipe":
        in_flight = first
    else:  # later stages start their backwards sooner: rank r of 1F1B keeps p - r in flight
        in_flight = max(1.0, first * (layout.pp - pp_rank) / layout.pp)
    layers_saved = stage_saved_bytes(shape, layout, pp_rank) + held.layers * extra if counts_layers(shape, layout) \
        else held.layers * layer.saved
    if shape.moe is not None and not counts_layers(shape, layout):  # MoE blocks beside any dense ones, routed as
        # `routing_skew` says (Gemma 4's MoE branch: among its layers' own tensors)
        from disttrain.plan.moe import experts_before_attention, stage_layers
        layers_saved, layer = stage_layers(shape, layout, pp_rank, layer, attention, ec, routing_skew, er)
        layer, experts_reduced = experts_before_attention(shape, layout, layer, attention, mb, s)
    else:
        experts_reduced = False
        if has_moe_branch(shape) and routing_skew != 1.0:  # Gemma 4's branch: its layers count balanced routing
            more_kept, more_held = skew_change(shape, layout, mb * s, ec, er, routing_skew)
            layers_saved += held.layers * more_kept
            layer = replace(layer, saved=layer.saved + more_kept, transient=layer.transient + more_held)
    grad_share, freed = 1.0, 0.0
    # a pipeline's blocks: its schedule's terms (in-flight micro-batches)
    if (shape.moe is None or counts_layers(shape, layout)) and layout.pp == 1:
        held_more, freed = (0.0, 0.0) if recounted else block_backward_bytes(shape, mb, s, layout)
        layer = replace(layer, transient=layer.transient + held_more)
        grad_share = shape.dim * shape.ffn_hidden_dim / layout.tp / layer_params(shape, layout.tp)
    excess = 0.0
    if ring or ring_forward:
        before = layer.transient
        layer = _ring_backward(layer, attention, ring, ring_forward, layout.activation_checkpointing == "none")
        excess = layer.transient - before
    saved = (layers_saved + (eager_mask_bytes(shape, mb, s, layout) if held.layers else 0.0)) * in_flight
    logits = chunk = head = 0.0
    if held.embedding:
        saved += TOKEN_ID * mb * s * in_flight
    if held.output:
        r = layout.tp if layout.sequence_parallel else 1
        if layout.loss_chunk_tokens:  # the head's gradients, computed in its forward
            head, chunk = chunked_loss_bytes(shape, layout)
        else:  # the output layer's saved input and the fp32 log-softmax kept by the loss
            logits = FP32 * mb * s * shape.vocab_size / layout.tp
            head = ec * mb * s * shape.dim
        # A pipeline's last stage also holds its output (the logits in the compute dtype) for the schedule's
        # backward; GPipe runs every micro-batch's forward and loss first, so it holds all of them.
        output = last_stage_output_bytes(shape, layout) if layout.pp > 1 else 0.0
        losses = in_flight if layout.pp > 1 and layout.pp_schedule == "gpipe" else 1.0
        final_norm = norm_bytes(er, mb * s, shape.dim, r, final_fused, shape.norm_kind)
        saved += losses * (final_norm + head + logits + output)
    if layout.pp > 1 and layout.pp_schedule in ("interleaved_1f1b", "zero_bubble"):
        return _multi_stage(shape, layout, pp_rank, layer, logits, saved - held.layers * layer.saved * in_flight,
                            accumulated_grads, last=held.output, chunk=chunk, experts_reduced=experts_reduced)
    if layout.pp > 1 and not held.output:  # the schedule keeps each in-flight micro-batch's stage output
        saved += stage_output_bytes(shape, layout, pp_rank) * in_flight
    loss_inputs = 0.0
    if held.output and layout.pp == 1:  # the final norm's and output layer's saved inputs, gone by any block's backward
        loss_inputs = norm_bytes(er, mb * s, shape.dim, r, final_fused, shape.norm_kind) + head
    return StageActivations(saved, max(layer.transient, 2 * logits, chunk), in_flight, logits, layer.transient,
                            layer_saved=layers_saved / held.layers if held.layers else 0.0, grad_share=grad_share,
                            block_freed=freed + loss_inputs, loss_inputs=loss_inputs, chunk=chunk,
                            attention_excess=excess)


def block_backward_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> tuple[float, float]:
    """(held beyond the recomputed tensors, saved ones freed) at the fullest moment of a dense block's backward,
    inside its MLP's: the gradient arriving at the block (residual dtype), and the gradients of the SwiGLU's
    product and of both its factors (FFN-sized, compute dtype), with the product itself freed once w2's backward
    is done. Selective checkpointing also recomputes the rotated q and k, both norms' outputs and the residual
    between them (what its cache does not keep), and frees the cached outputs of wq, wk and wo once the
    recomputation has used them. Listed op by op from the dry run's tracker (`tiny` ZeRO-3, each checkpointing
    mode, fp32 and bf16; `13b` ZeRO-3 selective fp32 at 32 ranks: equal to the MiB in activations and
    temporaries)."""
    ec, er = dtype_bytes(layout)
    t = layout.tp
    sb = seq_len * micro_batch
    h, kv = shape.dim, shape.n_kv_heads * shape.head_dim
    ffn = ec * sb * shape.ffn_hidden_dim / t
    arriving = er * sb * h / (t if layout.sequence_parallel else 1)
    mode = layout.activation_checkpointing
    if mode == "none":  # the product is among the saved tensors
        return arriving + 3 * ffn, ffn
    if mode == "selective":
        rotated = ec * sb * (h + kv) / t
        return arriving + 2 * ffn + 2 * ec * sb * h + rotated, rotated + ec * sb * h
    return arriving + 2 * ffn, 0.0


def _ring_backward(layer: LayerActivations, attention: LayerActivations, ring: float,
                   forward: float = 0.0, in_forward: bool = False) -> LayerActivations:
    """Context parallelism's backward temporaries (plan/context.py: the ring's, or all-gather's K/V and mask
    remade under checkpointing) add to the layer's transient only beyond its MLP's (or MoE's) tensors, saved
    or recomputed, which that part's backward frees before attention's runs (`attention`: the layer without its
    MLP; `debug` at seq 128, cp=2, ZeRO-2: 14.7% over the dry run with the ring's on top). The ring's `forward`
    (recomputed for the backward under checkpointing) comes before the MLP's tensors are remade or made; without
    checkpointing (`in_forward`) it runs in the step's forward, before the layer's MLP has saved anything (a tiny
    gpt-oss at cp=4: the ring's forward placed over the last layer's MLP tensors had been 5% over the dry run)."""
    freed = layer.saved + layer.transient - attention.saved - attention.transient
    not_yet = layer.transient - attention.transient + (layer.saved - attention.saved if in_forward else 0.0)
    return replace(layer, transient=layer.transient + max(0.0, ring - freed, forward - not_yet))


def _multi_stage(shape: ModelShape, layout: Layout, pp_rank: int, layer: LayerActivations, logits: float,
                 loss_and_ids: float, accumulated_grads: float = 0.0, last: bool = False,
                 chunk: float = 0.0, experts_reduced: bool = False) -> StageActivations:
    """A rank holding several stages: each local stage's micro-batches are held from their forward to their
    backward, in torch's order for the schedule. Zero-bubble (no checkpointing: the layout rules refuse it
    with checkpointing) holds them to the weight pass, and the ones past their input-gradient pass hold those
    gradients besides; the last stage's include the logits' gradient (`last`: this rank holds the last stage)."""
    mb, s, v = layout.micro_batch, layout.seq_len, layout.stages_per_rank
    counts = stage_layers(shape, layout)[pp_rank]
    owned = layout.owned_stages(pp_rank)
    mask = eager_mask_bytes(shape, mb, s // layout.cp, layout)
    kept = [n * layer.saved + (0.0 if last and i == len(counts) - 1 else stage_output_bytes(shape, layout, owned[i]))
            + mask * (n > 0) for i, n in enumerate(counts)]
    pending = [0.0] * len(counts)
    whole = {i for i, stage in enumerate(owned) if stage == 0 and layout.pp_schedule == "zero_bubble"}
    if layout.pp_schedule == "zero_bubble":  # the first stage's input-gradient pass keeps nothing (whole: its W)
        ec, _ = dtype_bytes(layout)
        pending = [n * weight_gradient_inputs_bytes(shape, mb, s, layout) * (i not in whole)
                   for i, n in enumerate(counts)]
        if logits:  # the last stage: its output layer's input gradient, vocabulary-sized (none when chunked)
            pending[-1] += ec * mb * s * shape.vocab_size / layout.tp
    # Each stage's share of the accumulated gradients: its layers, and the embedding (first stage) or the
    # output layer and final norm (last stage).
    table = shape.vocab_size * shape.dim // layout.tp
    params = [n * layer_params(shape, layout.tp, layout.ep) + (table if pp_rank == 0 and i == 0 else 0)
              + (table + shape.dim if last and i == len(counts) - 1 else 0) for i, n in enumerate(counts)]
    grads = [accumulated_grads * n / max(sum(params), 1) for n in params]
    order = schedule_order(layout.pp_schedule, layout.pp, layout.microbatches, v, pp_rank)
    gathered = None
    if layout.zero_stage >= 3 and layout.reshard_after_forward and not layout.reduces_every_microbatch:
        gathered = [DTYPE_BYTES[layout.param_dtype] * n for n in params]  # reduced every micro-batch: resharded
    unit = layer_params(shape, layout.tp, layout.ep)  # `experts_reduced`: by the fullest moment, the experts' own
    # FSDP unit has reduced the fresh gradients of its experts (plan/moe.py experts_before_attention)
    if experts_reduced:
        from disttrain.plan.moe import layer_params as moe_layer_params
        unit -= moe_layer_params(shape, shape.n_layers - 1, layout.tp, layout.ep)[1]
    fresh = [DTYPE_BYTES[layout.param_dtype] * unit * (n > 0) for n in counts] if accumulated_grads else None
    loose = None
    pb, rb = DTYPE_BYTES[layout.param_dtype], DTYPE_BYTES[layout.reduce_dtype]
    if layout.pp_schedule == "zero_bubble" and accumulated_grads and pb != rb:
        loose = [g * pb / rb for g in grads]
    sent = [input_grad_bytes(shape, layout) * (stage > 0) for stage in owned]
    at_block, at_loss = schedule_peak(order, kept, pending, grads, len(counts) - 1 if last else None, gathered, fresh,
                                      loose, sent, counts, whole, mlp_backward_bytes(shape, mb, s, layout))
    return StageActivations(at_block.activations + loss_and_ids, max(layer.transient, 2 * logits, chunk),
                            at_block.activations / (sum(kept) / len(kept)) / v if sum(kept) else 0.0,
                            logits, layer.transient, at_block, at_loss, at_loss.activations + loss_and_ids, chunk=chunk,
                            input_grads=layout.microbatches * sum(sent))
