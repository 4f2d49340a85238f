"""The planner's context-parallel terms (`parallel.cp`, `parallel.cp_method`): attention FLOPs per context
rank, K/V traffic per method, and what each method keeps beyond a 1/cp share of the activations.

Head-tail chunks balance causal attention, so each context rank computes 1/cp of the sequence's attention
FLOPs and holds seq_len/cp tokens of every activation. On top of that share:
  ring       keeps nothing more (masks only under document masking, one block at a time) but, under
             selective checkpointing, every block's kernel output (ring_selective_cache_bytes); it holds a few
             Q- and K/V-sized temporaries while a layer's backward runs (ring_temporary_bytes); per layer it
             sends cp-1 K/V blocks forward and, in backward, cp-1 K/V blocks plus cp dK/dV blocks, each
             overlapped with one block's attention;
  allgather  keeps the gathered K/V (whole sequence) and a boolean (seq_len/cp x seq_len) mask per layer;
             per layer one all-gather of K/V forward and one reduce-scatter of dK/dV backward, not overlapped;
  ulysses    keeps head-sharded q/k/v/out (the same bytes as its shard) and a (seq_len x seq_len) mask per
             layer (under selective checkpointing the exchanged q/k/v/out, the mask recomputed); per layer
             all-to-alls of q, k, v and the output forward, and of their gradients backward.
Pure Python.
"""

from __future__ import annotations

from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.models.shape import ModelShape


def attention_kinds(shape: ModelShape) -> list[tuple[ModelShape, float]]:
    """(a layer's attention shape, the share of the layers having it): one kind, but for Gemma 4's full-attention
    layers with their own head size and key-value heads (ModelShape.at_layer)."""
    own = shape.extras is not None and shape.extras.own_global_attention
    full = [i for i in range(shape.n_layers) if shape.is_global(i)] if own else []
    if not full:
        return [(shape, 1.0)]
    share = len(full) / shape.n_layers
    return [(shape.at_layer(full[0]), share), (shape, 1.0 - share)]


def kv_traffic_bytes(shape: ModelShape, layout: Layout) -> dict:
    """Bytes one context rank sends per layer per micro-batch (forward + backward), and whether compute
    hides them ("overlapped": the ring sends the next block while computing this one)."""
    cp, tp = layout.cp, layout.tp
    e = DTYPE_BYTES[layout.compute_dtype]
    local = layout.seq_len // cp * layout.micro_batch
    kinds = attention_kinds(shape)  # an average layer's
    kv = sum(2 * e * local * k.n_kv_heads * k.head_dim / tp * share for k, share in kinds)  # this rank's K and V
    q = sum(e * local * k.n_heads * k.head_dim / tp * share for k, share in kinds)
    if cp == 1:
        return {"method": layout.cp_method, "bytes": 0.0, "overlapped": True}
    if layout.cp_method == "ring":
        sent = (cp - 1) * kv + (cp - 1) * kv + cp * kv * (4 if e < 4 else e) / e  # dK/dV accumulate in fp32
        if layout.activation_checkpointing != "none":  # recomputing the block walks the forward's ring again
            sent += (cp - 1) * kv
        return {"method": "ring", "bytes": sent, "overlapped": True}
    if layout.cp_method == "allgather":
        return {"method": "allgather", "bytes": 2 * (cp - 1) * kv, "overlapped": False}
    # ulysses: q, k, v and the output out to the other ranks ((cp - 1)/cp of each), gradients back
    return {"method": "ulysses", "bytes": 2 * (cp - 1) / cp * (2 * q + kv), "overlapped": False}


def ring_temporary_bytes(shape: ModelShape, layout: Layout, element_bytes: int) -> tuple[float, float]:
    """(forward, backward): what the ring (parallel/ring_attention.py) holds besides the saved tensors while a
    layer's attention runs, per micro-batch, in each pass. Backward, while a block's kernel runs: the contiguous output
    gradient, the accumulating dQ and travelling dK/dV (at least fp32), this block's K/V and the next one
    arriving, the K/V expanded to every query head (grouped heads only) and the kernel's dQ, dK, dV for the
    block. Forward (or its recomputation for the backward under checkpointing), at a block's merge into the
    running output: that output and its log-sum-exp (at least fp32), the block's output (cached under selective
    checkpointing: counted there) and its copy at that precision, the rescaled running output, the rescaled
    block and their sum, besides the expanded and travelling K/V: five query-sized tensors at fp32 in bf16,
    more than backward's (a tiny gpt-oss at cp=4 whose ring holds its peak: 42% fewer temporaries counted
    with backward's alone). With attention sinks, backward ends with their gradient, three query-sized fp32 tensors
    more: the peak of a tiny gpt-oss at cp=4 without checkpointing (7% under its dry run without them and the
    norms' fp32 tensors); under checkpointing the dry run's peak stays at the recomputed forward's merge, where
    counting them put the same model 4 to 7 points over. plan/activations.py places each at its moment of the layer's
    backward. Of the layers' attention kinds (`attention_kinds`), the fullest."""
    if layout.cp == 1 or layout.cp_method != "ring":
        return 0.0, 0.0
    moments = [_ring_temporaries(kind, layout, element_bytes) for kind, _ in attention_kinds(shape)]
    return max(f for f, _ in moments), max(b for _, b in moments)


def _ring_temporaries(shape: ModelShape, layout: Layout, element_bytes: int) -> tuple[float, float]:
    """ring_temporary_bytes for a layer of `shape`'s attention."""
    e, acc = element_bytes, max(element_bytes, 4)
    tokens = layout.seq_len // layout.cp * layout.micro_batch
    q = tokens * shape.n_heads * shape.head_dim / layout.tp  # elements of Q (and of K/V expanded to its heads)
    kv = 2 * tokens * shape.n_kv_heads * shape.head_dim / layout.tp  # K and V stacked
    expanded = 2 * e * q if shape.n_heads != shape.n_kv_heads else 0.0
    backward = (e + acc) * q + (2 * e + acc) * kv + expanded + 3 * e * q
    if shape.extras is not None and shape.extras.attention_sinks and layout.activation_checkpointing == "none":
        # the sinks' gradient after the last block: the output gradient and the output upcast and their product,
        # while the last block's kernel gradients and expanded K/V are still held (the next block's K/V is not)
        backward += 3 * acc * q - e * kv
    block = 0.0 if layout.activation_checkpointing == "selective" else e * q
    copy = acc * q if acc != e else 0.0
    forward = 4 * acc * q + acc * q / shape.head_dim + block + copy + 2 * e * kv + expanded
    return forward, backward


def ring_selective_cache_bytes(shape: ModelShape, layout: Layout, element_bytes: int) -> float:
    """Selective checkpointing keeps the output of every attention kernel call (parallel/activation_checkpoint.py),
    and the ring calls the kernel once per block: each block's output and fp32 log-sum-exp stay cached from
    forward to backward, in place of the one attention output (and log-sum-exp) a layer keeps otherwise: the
    ring's merged output is recomputed from them, not kept. Context rank r computes its own block and r
    blocks from earlier ranks over all its query rows, and cp-1-r blocks from later ranks over half of them;
    the last context rank (cp blocks of full rows, cp - 1 more than a layer without the ring) holds the most,
    and the planner counts that rank (the 7b at 131,072 tokens, cp=4: as the 32-rank dry run measures).
    A sliding-window layer computes a block only over the query rows that reach its keys (`window_rows`): on the
    last rank, none but the window's first rows of the chunk after each earlier one (gpt-oss-20b, cp=16: its
    sliding layers had been counted as full ones, 5.8 GiB above the dry run on that rank). Linear-attention
    layers run no ring. Averaged over the layers, per layer and micro-batch."""
    if layout.cp == 1 or layout.cp_method != "ring" or layout.activation_checkpointing != "selective":
        return 0.0
    t = layout.seq_len // layout.cp
    x = shape.extras
    window = x.sliding_window if x is not None else 0
    sliding = x.sliding_layers if window else 0
    full = shape.n_layers - shape.linear_layers - sliding
    head_dim = attention_kinds(shape)[0][0].head_dim  # the full-attention layers' (Gemma 4's own)
    per_row = layout.micro_batch * shape.n_heads / layout.tp * 4
    per_value = layout.micro_batch * shape.n_heads / layout.tp * element_bytes
    rows = (per_row + per_value * head_dim) * full * (layout.cp - 1) * t + \
        (per_row + per_value * shape.head_dim) * sliding * window_rows(layout, window)
    return rows / shape.n_layers


def window_rows(layout: Layout, window: int) -> int:
    """Query rows of the ring's blocks from earlier context ranks that a sliding window lets the last context rank
    compute (parallel/ring_attention.py computes each block over the smallest range of rows that reach its keys):
    the block of the rank j places back holds the chunk ending (j - 1) chunks before this rank's first, whose
    last key the window's first `window - 1 - (j - 1) x chunk` rows still see."""
    t = layout.seq_len // layout.cp
    chunk = t // 2
    return sum(min(t, max(0, window - 1 - (j - 1) * chunk)) for j in range(1, layout.cp))


def context_extra_bytes(shape: ModelShape, layout: Layout, element_bytes: int) -> float:
    """What a layer keeps besides its seq_len/cp share of the activations, per micro-batch. Checkpointing
    recomputes all-gather's and Ulysses' extras in the layer's backward instead (`context_recomputed_bytes`),
    but for the all-to-alls' results selective checkpointing keeps."""
    if layout.cp_method == "ring":
        return ring_selective_cache_bytes(shape, layout, element_bytes)
    if layout.activation_checkpointing == "selective" and layout.cp_method == "ulysses":
        return ulysses_selective_cache_bytes(shape, layout, element_bytes)
    if layout.activation_checkpointing != "none":
        return 0.0
    return sum(_gathered_bytes(kind, layout, element_bytes) * share for kind, share in attention_kinds(shape))


def ulysses_selective_cache_bytes(shape: ModelShape, layout: Layout, element_bytes: int) -> float:
    """Selective checkpointing keeps all-to-alls' results (parallel/activation_checkpoint.py): Ulysses' rotated
    q, k and v in head shards and the attention output back in sequence shards, each as many elements as this
    rank's own q, k, v or output, beside the projections and the kernel output the layer keeps anyway."""
    if layout.cp == 1 or layout.cp_method != "ulysses" or layout.activation_checkpointing != "selective":
        return 0.0
    tokens = layout.seq_len // layout.cp * layout.micro_batch
    return sum(element_bytes * tokens * (2 * k.n_heads + 2 * k.n_kv_heads) * k.head_dim / layout.tp * share
               for k, share in attention_kinds(shape))


def context_recomputed_bytes(shape: ModelShape, layout: Layout, element_bytes: int) -> float:
    """All-gather's and Ulysses' extras under checkpointing: remade while the layer's backward runs."""
    if layout.cp_method == "ring" or layout.activation_checkpointing == "none":
        return 0.0
    return max(_gathered_bytes(kind, layout, element_bytes) for kind, _ in attention_kinds(shape))  # the fullest


def _gathered_bytes(shape: ModelShape, layout: Layout, element_bytes: int) -> float:
    """What all-gather or Ulysses attention keeps beyond the layer's own q/k/v/out. SDPA takes the bool mask
    and keeps it converted to the compute dtype (one per micro-batch without document masking: it has no batch
    dimension); the CPU flash kernel the dry run runs keeps grouped K/V as they are, not expanded to every
    query head (saved-tensor hooks on fake tensors; `tiny` at cp=4 was +10.6% with the K/V expanded and a
    one-byte mask counted)."""
    if layout.cp == 1:
        return 0.0
    s, mb, cp, tp = layout.seq_len, layout.micro_batch, layout.cp, layout.tp
    if layout.cp_method == "allgather":
        # The gathered K/V (whole sequence) in place of the rank's own shard, and the (seq/cp x seq) mask.
        kv = 2 * element_bytes * mb * shape.n_kv_heads * shape.head_dim / tp * (s - s // cp)
        return kv + element_bytes * (s // cp) * s
    return element_bytes * s * s  # ulysses: the (seq x seq) mask


def recurrence_wait_flops(shape: ModelShape, layout: Layout) -> float:
    """FLOPs' worth of time per step that one context rank spends on linear-attention layers (Gated DeltaNet) beyond
    its 1/cp share of their recurrence, which the FLOP count divides over every rank: the recurrent state goes
    from chunk to chunk along the sequence (parallel/linear_attention.py), so the 2 x cp chunks of a layer run one
    after the other, forward, and again in backward, which computes each chunk's forward once more before its
    gradients. A layer's recurrence then takes the whole sequence's time (forward, the forward again, backward:
    4/3 of the forward-and-backward FLOPs) on every rank instead of 1/cp of it. Heads split over tp; the
    projections, convolution and norms stay parallel. 0 without context parallelism or linear attention."""
    x = shape.extras
    lin = x.linear if x is not None else None
    if layout.cp <= 1 or lin is None:
        return 0.0
    from disttrain.plan.params import rank_params

    layers = max(rank_params(shape, layout, r).layers for r in range(layout.pp)) * lin.layers / shape.n_layers
    tokens = layout.microbatches * layout.micro_batch * layout.seq_len
    return layers * tokens * lin.flops_per_token() / layout.tp * (4 / 3 - 1 / layout.cp)


LONG_SEQUENCE = 16384  # the search tries cp > 1 from here on (shorter sequences fit without it)


def cp_degrees(seq_len: int, ranks: int, max_cp: int = 32) -> list[int]:
    """Context-parallel degrees the layout search tries on `ranks` ranks (after tensor parallel): 1, and
    for long sequences every power of two dividing the ranks and 2 x cp dividing the sequence."""
    if seq_len < LONG_SEQUENCE:
        return [1]
    out, cp = [1], 2
    while cp <= min(ranks, max_cp):
        if ranks % cp == 0 and seq_len % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def context_comm_s(shape: ModelShape, layout: Layout, cluster, compute_s: float,
                   hw_flops_per_token: float) -> tuple[float, float]:
    """(seconds of K/V traffic per step, the part not hidden): the ring's exchanges overlap the attention
    of the block in hand (exposed only where a block's transfer outlasts its attention); all-gather's and
    Ulysses' collectives are waited for."""
    from disttrain.models.flops import attention_flops_per_token
    from disttrain.plan.params import rank_params

    traffic = kv_traffic_bytes(shape, layout)
    bw, lat = cluster.link(layout.cp * layout.tp)
    layers = rank_params(shape, layout, 0).layers
    messages = {"ring": 3 * layout.cp - 2, "allgather": 2 * (layout.cp - 1), "ulysses": 8 * (layout.cp - 1)}
    per_mb = layers * (traffic["bytes"] / bw + messages[traffic["method"]] * lat)
    total = layout.microbatches * per_mb
    if not traffic["overlapped"]:
        return total, total
    attention_s = compute_s * attention_flops_per_token(shape, layout.seq_len) / hw_flops_per_token
    steps = 2 * layout.cp - 1  # forward and backward blocks, each overlapping one transfer
    per_block_comm = total / steps
    per_block_attention = attention_s / steps
    return total, steps * max(0.0, per_block_comm - cluster.overlap_efficiency * per_block_attention)
