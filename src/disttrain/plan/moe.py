"""The planner's mixture-of-experts terms: expert shards per rank, their model states on the experts' own
data-parallel group, the dispatch buffers a layer holds, and the all-to-all time of token dispatch.

Routing is data-dependent; the planner assumes it: `routing_skew` = 1 is balanced routing (every expert gets
tokens x top-k / num_experts), and a skew s > 1 sends the busiest expert-parallel rank s times its balanced
share (at most all ep ranks' tokens), which sizes its receive buffers, its expert matmuls and the all-to-all it
waits for. Tensor-parallel ranks keep the experts whole (dense layers split, experts not) and route the same
tokens: all of their sequence, with sequence parallelism too (the MoE block's input is gathered from the sequence
shards, models/hf/tp_plans.py; the built-in MoE family takes no sequence parallelism). A context-parallel rank
routes its 1/cp of each sequence: expert parallelism borrows the context ranks as it borrows the data-parallel
ones.
"""

from __future__ import annotations

from dataclasses import fields, replace

from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.models.shape import ModelShape
from disttrain.layout.splits import split_layers
from disttrain.plan.eager_scores import eager_held_scores, eager_scores_bytes
from disttrain.plan.mixers import mixer_params
from disttrain.plan.per_layer_inputs import layer_params_change
from disttrain.plan.routed import (FP32, INDEX, ROUTING_SKEW, received, routed_buffer_bytes, routed_bytes,
                                   routed_kept_bytes)

ALL_TO_ALLS_PER_LAYER = 4  # dispatch and combine in forward, their gradients in backward


def expert_layout(layout: Layout) -> Layout:
    """The layout the experts' states follow (the runtime's expert mesh, distributed/mesh.py: dp_shard x cp
    split into efsdp x ep, ep innermost): the dp_shard x cp / ep ranks holding the same experts shard them
    under ZeRO and dp_replicate replicates them; under DDP the dp x cp / ep ranks holding the same experts
    replicate them, and under ZeRO-1 split their optimizer states (a ZeroRedundancyOptimizer of their own:
    parallel/zero1.py). The same sequences per rank, so the same micro-batches: the group is smaller, not
    the work (its cp is folded into efsdp: the experts' group has no context dimension)."""
    if layout.ep <= 1:
        return layout
    efsdp = layout.dp_shard * layout.cp // layout.ep
    return replace(layout, dp_shard=efsdp, cp=1, ep=1, global_batch_size=layout.sequences_per_rank * efsdp *
                   layout.dp_replicate)


def held_layers(shape: ModelShape, layout: Layout, pp_rank: int) -> list[int]:
    """Indices of the layers pipeline rank `pp_rank` holds (its virtual stages, as `params.stage_layers`)."""
    counts = split_layers(shape.n_layers, layout.n_stages)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [layer for stage in range(pp_rank, layout.n_stages, layout.pp)
            for layer in range(starts[stage], starts[stage] + counts[stage])]


def moe_layers(shape: ModelShape, layers: list[int]) -> int:
    return sum(1 for layer in layers if shape.moe is not None and shape.moe.is_moe_layer(layer))


def routed_params(shape: ModelShape) -> int:
    """One layer's routed experts, all of them: num_experts SwiGLU experts of moe_intermediate_size (and their
    biases: gpt-oss)."""
    moe = shape.moe
    biases = 2 * moe.moe_intermediate_size + shape.dim if shape.extras is not None and shape.extras.expert_bias else 0
    return moe.num_experts * (3 * shape.dim * moe.moe_intermediate_size + biases)


def layer_params(shape: ModelShape, layer: int, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(parameters, of which routed experts) one rank holds of `layer`: attention and dense MLP split tp ways,
    the router whole, the shared experts split like a dense MLP, the routed experts num_experts / ep, whole."""
    x = shape.extras
    norms = (x.norms_per_block if x is not None else 2) * shape.dim  # replicated over tp
    attention = mixer_params(shape, tp, layer) + norms + layer_params_change(shape, layer, tp)  # Gemma 4's own
    moe = shape.moe
    if moe is None or not moe.is_moe_layer(layer):
        return attention + 3 * shape.dim * shape.ffn_hidden_dim // tp, 0
    experts = routed_params(shape) // ep
    shared = moe.n_shared_experts * 3 * shape.dim * moe.moe_intermediate_size // tp
    router = shape.dim * moe.num_experts + (moe.num_experts if x is not None and x.router_bias else 0)
    gate = shape.dim if x is not None and x.shared_expert_gate else 0
    if x is not None and x.dense_mlp_beside_experts:  # Gemma 4: the dense MLP split tp ways, three more norms and
        # the router's scale (whole), its per-expert scales
        gate += 3 * shape.dim * shape.ffn_hidden_dim // tp + 4 * shape.dim + moe.num_experts
    return attention + router + gate + shared + experts, experts


def block_params(shape: ModelShape, layout: Layout, layers: list[int]) -> tuple[int, int]:
    """(parameters, of which routed experts) of these layers on one rank."""
    held = [layer_params(shape, layer, layout.tp, layout.ep) for layer in layers]
    return sum(h[0] for h in held), sum(h[1] for h in held)


def largest_layer(shape: ModelShape, tp: int = 1, ep: int = 1) -> int:
    """The largest block one rank holds (FSDP's largest unit): a dense leading block or an MoE one."""
    kinds = {0, shape.n_layers - 1}  # the first is dense when first_k_dense_replace > 0, the last is MoE
    return max(layer_params(shape, layer, tp, ep)[0] for layer in kinds)


def expert_tensor(shape: ModelShape, ep: int = 1) -> int:
    """The largest expert tensor: the fused gate/up projection [num_experts / ep, 2 x width, dim]."""
    return shape.moe.num_experts // ep * 2 * shape.moe.moe_intermediate_size * shape.dim if shape.moe else 0


def expert_shard_padding(shape: ModelShape, layout: Layout) -> float:
    """How much more than an even 1/efsdp share of its experts' states the fullest rank holds under ZeRO-2/3. FSDP2
    splits a tensor on its first dimension, here the num_experts / ep experts this rank's expert-parallel group
    holds, and pads every rank's share to the largest: fewer experts than ranks sharing them would leave whole
    experts on the first ranks and nothing on the last. The runtime splits such stacks along their rows instead
    where those divide evenly (parallel/fsdp.py `split_experts_evenly`): an even share (gpt-oss-20b at ep=8 over
    64 ranks: 4 experts a group, 8 ranks). Where they do not, chunks of ceil(experts / efsdp) experts, the first
    ranks' twice the even share for 4 experts over 8 ranks."""
    if shape.moe is None or layout.ep <= 1 or layout.zero_stage < 2 or layout.experts_outside_fsdp:
        return 1.0
    experts, ranks = shape.moe.num_experts // layout.ep, expert_layout(layout).shard_ranks
    if experts % ranks and shape.moe.moe_intermediate_size % ranks == 0 and shape.dim % ranks == 0:
        return 1.0
    return -(-experts // ranks) * ranks / experts


def model_states(model_state_bytes, held, layout: Layout, accounting: str, largest_tensor: float,
                 shape: ModelShape, muon: bool = False, state_dtype: str = "fp32"):
    """Dense parameters' states over the data-parallel group, the experts' over theirs (`expert_layout`),
    added field by field. `model_state_bytes` is memory's (passed in: memory imports this module). `muon`: the
    block matrices (all but norms and routers; every expert matrix) keep Muon's one moment."""
    kinds = [layer_params(shape, layer, layout.tp, layout.ep) for layer in (0, shape.n_layers - 1)]
    dense_unit, expert_unit = max(total - experts for total, experts in kinds), max(e for _, e in kinds)
    routers = held.layers * shape.moe.num_experts * shape.dim if shape.moe else 0
    dense_muon = held.block - held.experts - held.layers * 2 * shape.dim - routers if muon else 0.0
    dense = model_state_bytes(held.total - held.experts, layout, accounting, largest_unit=dense_unit,
                              root_params=held.root, largest_tensor=largest_tensor, muon=max(0.0, dense_muon),
                              muon_matrix=shape.dim * max(shape.dim, shape.ffn_hidden_dim) if muon else 0.0,
                              state_dtype=state_dtype)
    if not held.experts:
        return dense
    padding = expert_shard_padding(shape, layout)  # FSDP2 gathers and reduces the padded rows too
    routed = model_state_bytes(held.experts, expert_layout(layout), accounting, largest_unit=expert_unit * padding,
                               root_params=0, largest_tensor=expert_tensor(shape, layout.ep),
                               muon=held.experts if muon else 0.0,
                               muon_matrix=expert_tensor(shape, layout.ep) if muon else 0.0, state_dtype=state_dtype)
    for name in ("params", "grads", "optimizer", "step_temporary"):
        setattr(routed, name, getattr(routed, name) * padding)
    for f in fields(dense):
        setattr(dense, f.name, getattr(dense, f.name) + getattr(routed, f.name))
    return dense


# ---------------------------------------------------------------- activations


def moe_layer_bytes(shape: ModelShape, layout: Layout, attention, ec: int, skew: float = ROUTING_SKEW,
                    er: int | None = None):
    """One MoE block's activations: `attention`, the dense block's without its MLP (`activations.
    layer_activation_bytes` of ffn_hidden_dim 0), plus the MoE layer's own tensors per micro-batch, for T tokens
    routed to k experts each, as models/moe keeps them (checked against saved-tensor hooks,
    tests/test_plan_moe.py):
    - the router's fp32 probabilities [T, E] and its sort's int64 indices [T, E] (the top-k are a view of them);
      per routed row its int64 position in expert order and its token, and its combine weight (compute dtype);
      the grouped matmuls' int32 offsets per local expert;
    - the rows each expert matmul keeps, T·k·skew x dim as received, their w1 and w3 outputs, SiLU's output and
      the gated product (4 x T·k·skew x width; gpt-oss's clamped GLU keeps 7, listed with saved-tensor hooks on
      transformers' experts); back on this rank the expert outputs and the weighted outputs
      the combine keeps (2 x T·k x dim);
    - shared experts as a dense SwiGLU MLP of n_shared x width;
    - transient: the all-to-all's send and receive buffers (T·k + T·k·skew rows of dim) while it runs, and
      their gradients in backward.
    Under autocast over fp32 weights (DDP, ZeRO-1) the combine's weighted outputs are kept in the residual
    dtype (index_add keeps its source, cast back to the input's dtype), the block's norm output is cast once
    for the router (and twice more for shared experts) where the dense block counts two casts, and an expert
    tensor's gradient is made in the compute dtype and cast to fp32 in backward (measured by the dry run:
    6 bytes per element of one [experts, width, dim] tensor at Qwen3-30B-A3B's first pipeline stage).
    `ec`/`er`: the compute and residual dtypes' bytes (activations.dtype_bytes; they differ under autocast).
    Selective checkpointing (parallel/activation_checkpoint.py) keeps every matmul's output: the router's
    logits, the grouped expert matmuls' (w1 and w3 outputs, T·k·skew x width each; w2's, T·k·skew x dim) and the
    shared experts' projections; and the all-to-alls' results (the counts, the received rows, the combined
    rows back: T·k·skew + T·k rows of dim); the routing, SiLU, the gated product and the combine are
    recomputed. Full keeps the block input and recomputes all of it."""
    er = ec if er is None else er
    autocast = er != ec
    base, micro_batch, seq_len = attention, layout.micro_batch, layout.seq_len
    moe = shape.moe
    t = layout.tp
    tokens = micro_batch * seq_len / layout.cp  # every tensor-parallel rank routes them all (module doc)
    k, h, width, e = moe.num_experts_per_tok, shape.dim, moe.moe_intermediate_size, moe.num_experts
    rows = tokens * k * received(layout, skew)
    sb, shared = micro_batch * seq_len / layout.cp, moe.n_shared_experts * width / t
    buffers = routed_buffer_bytes(shape, layout, tokens, ec, er, skew)
    casts = (2 * (moe.n_shared_experts > 0) - 1) * ec * sb * h if autocast else 0.0
    full = routed_bytes(shape, layout, tokens, ec, er, skew) + 4 * ec * sb * shared + casts
    if shape.extras is not None and shape.extras.expert_bias:  # gpt-oss's clamped GLU: both halves clamped, the
        full += 3 * ec * rows * width  # scaled gate and its sigmoid, the shifted up: three more than SiLU x up
        # and its expert biases, given to every row (gate/up's and down's) beside the products they are added to,
        # all alive at the down projection's bias (the fullest moment of the layer's forward, or of its
        # recomputation: gpt-oss-120b at 131,072 tokens, full checkpointing, 8.4 GiB the dry run found)
        buffers += (1 if layout.activation_checkpointing == "selective" else 2) * ec * rows * (2 * width + h)
    mode = layout.activation_checkpointing
    if mode == "full":
        return replace(base, transient=base.transient + full + buffers)
    if mode == "selective":  # the attention part counted two matmul outputs of dim: wo's and the MLP's w2
        kept = routed_kept_bytes(shape, layout, tokens, ec, skew)
        kept += 2 * ec * sb * shared if shared else -ec * sb * h / (t if layout.sequence_parallel else 1)
        return replace(base, saved=base.saved + kept, transient=base.transient + full - kept + buffers)
    return replace(base, saved=base.saved + full, transient=base.transient + buffers)


def experts_before_attention(shape: ModelShape, layout: Layout, layer, attention, micro_batch: int, seq_len: int):
    """(`layer` as its backward's fullest moment holds it, whether that moment is the attention's). A block's backward
    runs its experts' first (they come after the attention) and frees their tensors before the attention's: where
    eager attention's backward holds its score-sized tensors (plan/eager_scores.py), the block holds the fuller of
    the two, not both; and by the attention's, the experts' own FSDP unit has reduced their fresh gradients. On
    gpt-oss-120b's last pipeline rank (interleaved, full checkpointing, 4,096 tokens) the dry run's fullest backward
    is the last layer's attention: three score-sized temporaries, no expert tensor (the plan had been 5.9% over it
    with both). `attention`: the layer without its MLP (plan/activations.py)."""
    scores = eager_scores_bytes(shape, micro_batch, seq_len, layout)
    held = eager_held_scores(layout.activation_checkpointing) * scores
    # selective checkpointing recomputes the layer's probabilities when the experts' backward unpacks its first
    # tensor: live through the experts' backward (listed by the dry run's tracker on a tiny gpt-oss under sequence
    # parallelism, whose experts decide its peak); full checkpointing counts them among the recomputed tensors
    experts = layer.transient - attention.transient + scores * (layout.activation_checkpointing == "selective")
    if not held:
        return layer, False
    return replace(layer, transient=attention.transient + max(0.0, experts - held)), held >= experts


def stage_layers(shape: ModelShape, layout: Layout, pp_rank: int, dense, attention, ec: int,
                 skew: float = ROUTING_SKEW, er: int | None = None):
    """(saved bytes of every layer this rank holds, the fullest layer) for one micro-batch; `dense` is a dense
    block's LayerActivations, `attention` the same without its MLP, `ec` the compute dtype's bytes."""
    layers = held_layers(shape, layout, pp_rank)
    n_moe = moe_layers(shape, layers)
    moe = moe_layer_bytes(shape, layout, attention, ec, skew, er)
    saved = (len(layers) - n_moe) * dense.saved + n_moe * moe.saved
    kinds = ([dense] if len(layers) > n_moe else []) + ([moe] if n_moe else [])
    return saved, max(kinds or [dense], key=lambda layer: layer.transient)


# ---------------------------------------------------------------- time


def all_to_all_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Pairwise exchange: each of n ranks sends and receives `nbytes` in n − 1 steps, 1/n of it staying
    local: (n−1)·α + (n−1)/n · M/B (NCCL's all-to-all bus bandwidth convention)."""
    return 0.0 if n <= 1 else (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


def dispatch_s(shape: ModelShape, layout: Layout, cluster, skew: float = ROUTING_SKEW) -> float:
    """All-to-all time of one step on the fullest pipeline rank: per MoE layer and micro-batch, dispatch and
    combine in forward and their gradients in backward (full recomputation repeats the forward two; selective
    keeps their results), each
    moving T·k rows of dim out and T·k·skew in on the busiest rank, over ep x tp consecutive ranks (intra-node
    while they fit one). Exposed: tokens must arrive before the experts run, and nothing else is queued."""
    if shape.moe is None or layout.ep <= 1:
        return 0.0
    n_moe = max(moe_layers(shape, held_layers(shape, layout, r)) for r in range(layout.pp))
    e = DTYPE_BYTES[layout.param_dtype]
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    nbytes = e * tokens * shape.moe.num_experts_per_tok * shape.dim * received(layout, skew)
    bw, lat = cluster.link(layout.ep * layout.tp, "all_to_all")
    per_layer = ALL_TO_ALLS_PER_LAYER + (2 if layout.activation_checkpointing == "full" else 0)
    return layout.microbatches * n_moe * per_layer * all_to_all_s(layout.ep, nbytes, bw, lat)


def routed_flops_per_token(shape: ModelShape, layers: int, recompute: str = "none") -> float:
    """Routed experts' matmul FLOPs per token over `layers` MoE layers: 6 per active expert parameter (8 with
    full recomputation; selective keeps the grouped expert matmuls' outputs)."""
    moe = shape.moe
    return (8.0 if recompute == "full" else 6.0) * layers * moe.num_experts_per_tok * 3 * shape.dim * \
        moe.moe_intermediate_size


def expert_excess_flops(shape: ModelShape, layout: Layout, skew: float = ROUTING_SKEW) -> float:
    """Routed-expert FLOPs per step the busiest rank does beyond its 1/(tp·cp·pp) share of its replica's work (what
    the FLOP count divides over every rank): tensor-parallel ranks each run the experts whole on the same
    tokens, and a skewed router gives the busiest expert-parallel rank skew x its share."""
    if shape.moe is None:
        return 0.0
    n_moe = max(moe_layers(shape, held_layers(shape, layout, r)) for r in range(layout.pp))
    tokens = layout.sequences_per_rank * layout.seq_len / layout.cp
    per_token = routed_flops_per_token(shape, n_moe, layout.activation_checkpointing)
    share = per_token * layout.sequences_per_rank * layout.seq_len / (layout.tp * layout.cp)
    return max(0.0, per_token * tokens * received(layout, skew) - share)


def summary(shape: ModelShape, layout: Layout, held_experts: int, skew: float) -> dict:
    """What `estimate --json` reports of an MoE model."""
    moe = shape.moe
    return {"num_experts": moe.num_experts, "experts_per_rank": moe.num_experts // layout.ep, "ep": layout.ep,
            "expert_params_per_rank": held_experts, "expert_data_parallel": expert_layout(layout).gradient_ranks,
            "active_params": shape.num_params(active=True), "routing_skew": skew,
            "moe_layers": moe_layers(shape, list(range(shape.n_layers)))}


# ---------------------------------------------------------------- command line (`disttrain estimate` / `plan`)


def add_args(parser, search: bool) -> None:
    """--ep (one degree for `estimate`, the degrees to try for `plan`) and --routing-skew."""
    if search:
        parser.add_argument("--ep", default=None, help="MoE: expert-parallel degrees to consider, e.g. 8 or 1,4,8 "
                            "(default: every divisor of the expert count and the data-parallel size)")
    else:
        parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree of an MoE model (default: "
                            "the config's parallel.ep, else 1)")
    parser.add_argument("--routing-skew", type=float, default=1.0, help="MoE: tokens the busiest expert-parallel "
                        "rank receives over a balanced share (1: balanced routing)")


def routing_skew(value: float, shape: ModelShape) -> float:
    from disttrain.core.errors import UserError

    if not value >= 1:
        raise UserError(f"--routing-skew={value}: must be at least 1 (1: balanced routing)")
    if value != 1 and shape.moe is None:
        raise UserError(f"--routing-skew={value} needs a mixture-of-experts model (allowed: 1)")
    return value


def expert_degrees(text: str | None, shape: ModelShape, gpus: int) -> tuple[int, ...] | None:
    """`plan --ep 1,4,8` -> (1, 4, 8), each checked against the experts and the GPU count (None: search all)."""
    from disttrain.core.errors import UserError
    from disttrain.layout.expert_rules import expert_problems

    if text is None:
        return None
    try:
        degrees = tuple(sorted({int(x) for x in str(text).split(",")}))
    except ValueError:
        raise UserError(f"--ep={text}: expected comma-separated expert-parallel degrees like 1,4,8") from None
    for ep in degrees:
        problems = expert_problems(shape, Layout(dp_shard=ep, ep=ep))
        if problems:
            raise UserError(str(problems[0]).replace("parallel.ep=", "--ep="))
        if gpus % ep:
            raise UserError(f"--ep={ep} does not divide --gpus={gpus} (expert-parallel ranks are data- or "
                            "context-parallel ones)")
    return degrees


def no_lora(lora_rank: int, shape: ModelShape) -> int:
    from disttrain.core.errors import UserError

    if lora_rank and shape.moe is not None:
        raise UserError(f"--lora-rank={lora_rank}: LoRA on a mixture-of-experts model is not planned yet (allowed: "
                        "full training)")
    return lora_rank


def _count(n: int) -> str:
    """Billions ('6.74 B'), or millions below one billion ('3.28 M': a small model is not '0.00 B')."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def size_text(shape: ModelShape, short: bool = False) -> str:
    """'30.53 B parameters, 3.35 B active (128 experts, top-8)'; `short`: '30.53 B; 3.35 B active: 128 experts,
    top-8' (a dense model: '6.74 B')."""
    text = _count(shape.num_params()) + ("" if short else " parameters")
    moe = shape.moe
    if moe is None:
        return text
    experts = f"{moe.num_experts} experts, top-{moe.num_experts_per_tok}" + \
        (f", {moe.n_shared_experts} shared" if moe.n_shared_experts else "")
    active = f"{_count(shape.num_params(active=True))} active"
    return f"{text}; {active}: {experts}" if short else f"{text}, {active} ({experts})"
