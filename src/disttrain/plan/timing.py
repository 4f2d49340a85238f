"""Step time from FLOPs, an α-β model of each collective, and the pipeline bubble.

Ranks are laid out as the runtime's DeviceMesh does: (pp, dp_replicate, dp_shard, cp, tp), tensor
parallel innermost. A collective over a mesh dimension stays on NVLink when the ranks it spans
fit in one node, else it runs at the network's per-GPU bandwidth (every GPU has its own NIC in
the reference systems, so rings over nodes are limited by that NIC, not by NVLink).

Collective costs (n ranks, M bytes of the full tensor, bandwidth B per GPU and direction,
latency α per ring step), as NCCL's own performance notes define them:
  all-reduce       2(n−1)·α + 2(n−1)/n · M/B
  all-gather       (n−1)·α + (n−1)/n · M/B      (reduce-scatter the same)
  send/recv        α + M/B
Overlap follows what the runtime does: DDP and FSDP2 overlap gradient reduction with backward and
FSDP2 prefetches the next unit's all-gather during compute (minus `overlap_efficiency`, see
`exposed`); tensor-parallel collectives and pipeline transfers are counted as exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.models.registry import ModelShape
from disttrain.models import flops as F
from disttrain.core.gpus import GPUSpec
from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.plan.memory import layer_params, rank_params
from disttrain.plan.moe import dispatch_s, expert_excess_flops, expert_layout, routed_params

DDP_BUCKET_BYTES = 25 * 2 ** 20
TP_COLLECTIVES_PER_LAYER = 7
PCIE_BYTES_PER_S = 25e9  # host<->GPU, PCIe Gen4/5 x16 as reached in practice


@dataclass(frozen=True)
class Cluster:
    gpu: GPUSpec
    gpus_per_node: int = 8
    nodes: int = 1
    intra_node_gbs: float | None = None  # per GPU per direction; None: the GPU table's figure
    inter_node_gbs: float | None = None
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 15e-6
    compute_efficiency: float = 0.5  # fraction of dense peak the matmuls reach
    comm_efficiency: float = 0.8  # fraction of link bandwidth a collective reaches (NCCL bus bandwidth)
    # Overlapped collectives still share SMs and memory bandwidth with compute: this fraction of
    # their hidden time is treated as hidden, the rest still lengthens the step.
    overlap_efficiency: float = 0.9
    # A measured profile (`disttrain bench hardware`, plan/profile.py) sets these; the GPU table leaves
    # them None and folds element-wise work and the optimizer into `compute_efficiency`.
    elementwise_bytes_per_s: float | None = None
    attention_flops: float | None = None  # causal attention, FLOPs as flops.attention_flops_per_token counts
    optimizer_s_per_param: float = 0.0
    op_overhead_s: float = 0.0
    dtensor_op_s: float = 0.0  # host cost of one DTensor op (tensor parallelism), measured
    collective_links: dict | None = None  # kind -> (bytes/s, latency), measured
    # FSDP2's gather and reduce-scatter per byte of unsharded parameters with their copies and fresh
    # allocations, measured over `fsdp_ranks` ranks (bench/hardware.fsdp_round_trip); None: α-β only.
    fsdp_gather_s_per_byte: float | None = None
    fsdp_reduce_s_per_byte: float | None = None
    fsdp_ranks: int = 2
    tp_matmul_flops: dict | None = None  # tp degree -> dtype -> FLOP/s of a rank's slices, measured
    tp_collective: dict | None = None  # {"seconds", "bytes", "ranks"}: one TP collective as issued, measured

    def matmul_rate(self, tp: int, dtype: str, default: float) -> float:
        return ((self.tp_matmul_flops or {}).get(tp) or {}).get(dtype, default)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def link(self, span: int, kind: str = "all_reduce") -> tuple[float, float]:
        """(bytes/s, latency) for a collective whose ranks lie within `span` consecutive ranks; a measured
        profile has its own fit per collective kind."""
        if self.collective_links and kind in self.collective_links:
            return self.collective_links[kind]
        if span <= self.gpus_per_node:
            gbs = self.intra_node_gbs if self.intra_node_gbs is not None else self.gpu.intra_node_gbs
            return gbs * 1e9 * self.comm_efficiency, self.intra_latency_s
        gbs = self.inter_node_gbs if self.inter_node_gbs is not None else self.gpu.inter_node_gbs
        return gbs * 1e9 * self.comm_efficiency, self.inter_latency_s


def all_reduce_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def all_gather_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    return 0.0 if n <= 1 else (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


reduce_scatter_s = all_gather_s


def p2p_s(nbytes: float, bandwidth: float, latency: float) -> float:
    return latency + nbytes / bandwidth


def exposed(comm: float, compute: float, overlap_efficiency: float, floor: float = 0.0) -> float:
    """Communication time a step still pays when `comm` runs concurrently with `compute`: what does
    not fit under it, plus the overlap's own cost, and at least `floor` (the part that cannot start
    before compute ends, e.g. the last bucket)."""
    hidden = min(comm, compute)
    return max(comm - hidden + (1 - overlap_efficiency) * hidden, min(floor, comm))


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step: (p−1)/(m+p−1) for GPipe and 1F1B; interleaving with v stages
    per rank divides the bubble by v (Narayanan et al. 2021); zero-bubble schedules split backward
    into input- and weight-gradient passes and fill about two thirds of the remaining bubble with
    weight passes (Qi et al. 2023, ZB-H1), so (p−1)/3 units of bubble per v."""
    if pp <= 1:
        return 0.0
    bubble = float(pp - 1)
    if schedule == "interleaved_1f1b":
        bubble /= virtual_stages
    elif schedule == "zero_bubble":
        bubble /= 3 * virtual_stages
    return bubble / (microbatches + bubble)


@dataclass
class StepTime:
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # total time of the data-parallel collectives
    dp_exposed_s: float  # the part not hidden behind compute
    step_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    optimizer_s: float = 0.0  # measured profiles only: the GPU table folds it into compute
    ep_comm_s: float = 0.0  # expert parallel: the all-to-all dispatch and combine (plan/moe.py), exposed
    cp_comm_s: float = 0.0  # context parallel's K/V traffic (plan/context.py)
    cp_exposed_s: float = 0.0  # the part not hidden behind attention
    cp_recurrence_s: float = 0.0  # of compute: linear attention's recurrence waiting from context rank to rank
    frozen_s: float = 0.0  # a frozen model's forward (plan/frozen_time.py), in step_s: compute, bubble, exposed traffic
    frozen_compute_s: float = 0.0  # of which compute
    frozen_bubble_s: float = 0.0  # and its own pipeline schedule's bubble

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def step_time(shape: ModelShape, layout: Layout, cluster: Cluster, routing_skew: float = 1.0,
              muon: bool = False, objective=None) -> StepTime:
    """`objective`: train.objective's terms (plan/objective.py): a preference objective's pairs are twice the rows
    (the tokens, the MFU's and the throughput's count too, as the runtime logs them). A frozen model's forward is
    added to this step by plan/frozen_time.py."""
    if objective is not None and objective.rows > 1:  # the trained model sees rows, not samples
        layout = layout.replace(micro_batch_size=layout.micro_batch_size * objective.rows,
                                global_batch_size=layout.global_batch_size * objective.rows)
    gpu = cluster.gpu
    dtype = layout.param_dtype if layout.param_dtype != "fp32" else "tf32"
    peak = gpu.peak_flops(dtype)
    s, mb, m = layout.seq_len, layout.micro_batch, layout.microbatches
    tokens = layout.global_batch_size * s
    world = layout.world_size
    hw_per_token = F.hardware_flops_per_token(shape, s, layout.activation_checkpointing)
    model_per_token = F.model_flops_per_token(shape, s)
    compute = hw_per_token * tokens / world / (peak * cluster.compute_efficiency)
    optimizer, idle_share = 0.0, 1.0
    if cluster.elementwise_bytes_per_s is not None:
        compute, optimizer, idle_share = measured_compute(shape, layout, cluster,
                                                          cluster.matmul_rate(layout.tp, dtype, peak))
    if shape.moe is not None:  # experts run whole on tensor-parallel ranks; a skewed router loads one rank more
        rate = cluster.matmul_rate(layout.tp, dtype, peak) if cluster.elementwise_bytes_per_s is not None else \
            peak * cluster.compute_efficiency
        compute += expert_excess_flops(shape, layout, routing_skew) / rate
    ep_comm = dispatch_s(shape, layout, cluster, routing_skew)
    recurrence = 0.0
    if layout.cp > 1:  # linear attention's chunks in sequence order, one context rank after the other
        from disttrain.plan.context import recurrence_wait_flops

        rate = cluster.matmul_rate(layout.tp, dtype, peak) if cluster.elementwise_bytes_per_s is not None else \
            peak * cluster.compute_efficiency
        recurrence = recurrence_wait_flops(shape, layout) / rate
        compute += recurrence
    per_mb = compute / m  # one micro-batch through this rank's stage(s): forward + backward
    recompute_share = F.recompute_flops_per_token(shape, s, layout.activation_checkpointing) / hw_per_token
    fwd = per_mb * (1 - recompute_share) / 3
    bwd = per_mb - fwd

    bubble_frac = bubble_fraction(layout.pp_schedule, layout.pp, m, layout.stages_per_rank)
    bubble = compute * idle_share * bubble_frac / (1 - bubble_frac) if bubble_frac else 0.0

    e = DTYPE_BYTES[layout.param_dtype]
    # Tensor parallel (all-reduces, or all-gather + reduce-scatter with SP: the same bytes), per layer
    # and micro-batch: two in forward (after wo and w2); five in backward, one per column-parallel linear
    # (wq, wk, wv, w1, w3 each reduce their own input gradient: the plan's linears are separate modules,
    # counted with the profiler in docs/benchmarks/collectives.md); two more per recomputed forward. The vocabulary-
    # parallel embedding reduces its output and the output layer its input gradient.
    held = rank_params(shape, layout, 0)
    tp_comm = 0.0
    if layout.tp > 1:
        bw, lat = cluster.link(layout.tp)
        per_layer = TP_COLLECTIVES_PER_LAYER + (2 if layout.activation_checkpointing == "full" else 0)
        per_step = m * (held.layers * per_layer + int(held.embedding) + int(held.output))
        one = all_reduce_s(layout.tp, e * mb * s // layout.cp * shape.dim, bw, lat)
        measured = cluster.tp_collective
        if measured and measured.get("ranks") == layout.tp:  # as issued (DTensor, waits), moved to this size
            one = max(one, measured["seconds"] + one - all_reduce_s(layout.tp, measured["bytes"], bw, lat))
        tp_comm = per_step * one

    pp_comm = 0.0
    if layout.pp > 1:
        bw, lat = cluster.link(world)
        # activations forward and their gradients backward, per micro-batch and virtual stage
        pp_comm = 2 * m * layout.stages_per_rank * p2p_s(e * mb * s // layout.cp * shape.dim / (layout.tp if layout.sequence_parallel else 1), bw, lat)

    n_params = held.total
    unit = layer_params(shape, layout.tp, layout.ep)
    # (data-parallel layout, parameters, largest unit) per group that reduces together: the dense parameters
    # over dp; an MoE model's routed experts over the dp / ep ranks holding the same experts (plan/moe.py).
    groups = [(layout, n_params, unit)]
    if held.experts:
        expert_unit = routed_params(shape) // layout.ep
        groups = [(layout, n_params - held.experts, unit - expert_unit),
                  (expert_layout(layout), held.experts, expert_unit)]
    rb = DTYPE_BYTES[layout.reduce_dtype]
    dp_comm, dp_exposed = 0.0, 0.0
    dp = layout.gradient_ranks  # context ranks reduce gradients like data-parallel ones
    if dp > 1:
        if layout.zero_stage <= 1:
            bw, lat = cluster.link(dp * layout.tp)
            ar = sum(all_reduce_s(g.gradient_ranks, rb * n, bw, lat) for g, n, _ in groups)
            dp_comm = ar
            last_bucket = all_reduce_s(dp, min(DDP_BUCKET_BYTES, rb * groups[0][1]), bw, lat)
            dp_exposed = exposed(ar, bwd, cluster.overlap_efficiency, last_bucket)
            if layout.zero_stage == 1 and not muon:  # updated parameters broadcast from their owners after the
                # step (the experts' over the ranks holding them); with Muon only its updates travel (muon_step_s)
                link = cluster.link(dp * layout.tp, "all_gather")
                ag = sum(all_gather_s(g.gradient_ranks, 4 * n, *link) for g, n, _ in groups if g.zero_stage == 1)
                dp_comm += ag
                dp_exposed += ag
        else:
            ds, dr = layout.shard_ranks, layout.dp_replicate
            bw, lat = cluster.link(ds * layout.tp, "all_gather")
            rbw_s, rlat_s = cluster.link(ds * layout.tp, "reduce_scatter")
            gathers = 2 if layout.reshard_after_forward else 1  # stage 3 gathers again for backward
            # uneven shares keep parameters gathered across a rank's micro-batches: one gather per step
            rounds = 1 if layout.balanced else m
            ag = sum(all_gather_s(g.shard_ranks, e * n, bw, lat) for g, n, _ in groups)
            first_unit = sum(all_gather_s(g.shard_ranks, e * u, bw, lat) for g, _, u in groups)
            rs = sum(reduce_scatter_s(g.shard_ranks, rb * n, rbw_s, rlat_s) for g, n, _ in groups)
            last_unit = sum(reduce_scatter_s(g.shard_ranks, rb * u, rbw_s, rlat_s) for g, _, u in groups)
            if cluster.fsdp_gather_s_per_byte is not None and ds > 1:
                # measured round trips, scaled by the share of bytes a ring moves at each group's size
                def f(g):
                    return (g.shard_ranks - 1) / g.shard_ranks / ((cluster.fsdp_ranks - 1) / cluster.fsdp_ranks)
                ag, first_unit = (sum(f(g) * cluster.fsdp_gather_s_per_byte * e * p[i] for g, *p in groups)
                                  for i in (0, 1))
                rs, last_unit = (sum(f(g) * cluster.fsdp_reduce_s_per_byte * rb * p[i] for g, *p in groups)
                                 for i in (0, 1))
            if layout.dp_replicate > 1 or len(groups) > 1:
                rbw, rlat = cluster.link(layout.dp * layout.tp)
                rs += sum(all_reduce_s(g.dp_replicate, rb * n / g.shard_ranks, rbw, rlat) for g, n, _ in groups)
            reductions = m if layout.reduces_every_microbatch else 1  # parallel.gradient_accumulation=sharded
            dp_comm = rounds * gathers * ag + reductions * rs
            oe = cluster.overlap_efficiency
            exposed_fwd = exposed(ag, fwd, oe, first_unit)
            exposed_bwd = exposed(ag, bwd, oe, first_unit) if gathers == 2 else 0.0
            dp_exposed = rounds * (exposed_fwd + exposed_bwd) + reductions * exposed(rs, bwd, oe, last_unit)
    if layout.cpu_offload:  # parameter shards up every micro-batch, gradient shards down, over PCIe
        down = m if layout.reduces_every_microbatch else 1  # gradient shards down after each reduce-scatter
        dp_exposed += (m * e + 4 * down) * n_params / layout.shard_ranks / PCIE_BYTES_PER_S
    cp_comm, cp_exposed = 0.0, 0.0
    if layout.cp > 1:
        from disttrain.plan.context import context_comm_s

        cp_comm, cp_exposed = context_comm_s(shape, layout, cluster, compute, hw_per_token)

    if muon:  # optim.name=muon: Newton-Schulz on this rank's share of the matrices, and their traffic
        from disttrain.plan.optimizer import muon_step_s

        rate = cluster.matmul_rate(layout.tp, "bf16", gpu.peak_flops("bf16")) \
            if cluster.elementwise_bytes_per_s is not None else gpu.peak_flops("bf16") * cluster.compute_efficiency
        optimizer += muon_step_s(shape, layout, held.layers, rate, cluster.link, all_gather_s)
    step = compute + bubble + tp_comm + pp_comm + dp_exposed + optimizer + ep_comm + cp_exposed
    tps = tokens / step
    per_gpu = tps / world
    return StepTime(compute, bubble, tp_comm, pp_comm, dp_comm, dp_exposed, step, tps, per_gpu,
                    F.mfu(model_per_token, per_gpu, peak), F.mfu(hw_per_token, per_gpu, peak), optimizer, ep_comm,
                    cp_comm, cp_exposed, recurrence)


# Elements each token reads or writes per layer outside matmuls and attention, forward + backward,
# for models/llama (norms, rotary, SiLU gate, residual adds, casts): fitted by counting every
# non-matmul op's operands under a dispatch mode for six shapes (residual < 0.2%; docs/planning.md).
EW_PER_LAYER = {"dim": 107.0, "kv": 24.0, "ffn": 14.0, "heads": 4.3}
EW_ROOT_DIM, EW_VOCAB = 31.0, 5.0  # the final norm and embedding per token; log-softmax and loss per logit
OPS_PER_LAYER = 100  # eager ops per layer, forward + backward (76 element-wise, 21 matmuls, attention)
# Ops dispatched on DTensors under the runtime's tensor-parallel plan, forward + backward with the
# loss under loss_parallel, counted with a dispatch mode: per layer and outside the layers, without
# and with sequence parallelism.
DTENSOR_OPS_PER_LAYER = {False: 91, True: 144}
DTENSOR_OPS_ROOT = {False: 25, True: 50}


def measured_compute(shape: ModelShape, layout: Layout, cluster: Cluster, matmul_rate: float) -> tuple[float, float, float]:
    """(compute, optimizer, idle share) of one rank's step from a measured profile: matmul FLOPs at the
    measured matmul rate, attention at the measured attention rate, element-wise bytes at the measured
    bandwidth, a fixed cost per eager op, and AdamW + clipping per parameter this rank updates; for the
    slowest pipeline stage. The idle share scales the bubble: fill and drain idle for the *other* stages'
    work, so a cheaper first stage (no output layer) makes a shorter bubble."""
    stages = [_stage_compute(shape, layout, cluster, matmul_rate, pp_rank) for pp_rank in {0, layout.pp - 1}]
    compute, optimizer = max(stages, key=lambda times: times[0])
    other = min(times[0] for times in stages)
    return compute, optimizer, (other / compute if compute else 1.0)


def _stage_compute(shape: ModelShape, layout: Layout, cluster: Cluster, matmul_rate: float, pp_rank: int):
    s, m, mb = layout.seq_len, layout.microbatches, layout.micro_batch
    held = rank_params(shape, layout, pp_rank)
    tokens = mb * s // layout.cp * m  # this rank's tokens per step (tensor-parallel ranks share theirs)
    t, r = layout.tp, layout.tp if layout.sequence_parallel else 1
    full = layout.activation_checkpointing == "full"  # recomputes every block's forward: matmuls and attention
    layer_matmul = (8.0 if full else 6.0) * F.block_params(shape) / shape.n_layers
    matmul = held.layers * layer_matmul / t + (6.0 * shape.vocab_size * shape.dim / t if held.output else 0.0)
    attention = F.attention_flops_per_token(shape, s) / shape.n_layers * held.layers / t * (4 / 3 if full else 1.0)
    kv = shape.n_kv_heads * shape.head_dim
    c = EW_PER_LAYER
    per_layer = c["dim"] * shape.dim / r + c["kv"] * kv / t + c["ffn"] * shape.ffn_hidden_dim / t + c["heads"] * shape.n_heads / t
    rerun = {"full": 4 / 3, "selective": 7 / 6}.get(layout.activation_checkpointing, 1.0)
    elements = per_layer * held.layers * rerun + (EW_VOCAB * shape.vocab_size / t + EW_ROOT_DIM * shape.dim if held.output else 0)
    e = DTYPE_BYTES[layout.param_dtype]
    attention_rate = cluster.attention_flops or matmul_rate
    seconds = tokens * (matmul / matmul_rate + attention / attention_rate + e * elements / cluster.elementwise_bytes_per_s)
    seconds += m * OPS_PER_LAYER * held.layers * cluster.op_overhead_s
    if t > 1:
        sp = layout.sequence_parallel
        root = DTENSOR_OPS_ROOT[sp] if held.embedding or held.output else 0
        seconds += m * (DTENSOR_OPS_PER_LAYER[sp] * held.layers + root) * cluster.dtensor_op_s
    if layout.zero_stage == 1:  # this rank's share of the dense parameters and of the experts it holds
        updated = (held.total - held.experts) / layout.gradient_ranks + held.experts / layout.efsdp
    else:
        updated = held.total / (layout.shard_ranks if layout.zero_stage >= 2 else 1)
    return seconds, updated * cluster.optimizer_s_per_param


def single_gpu_tokens_per_s(shape: ModelShape, seq_len: int, cluster: Cluster, param_dtype: str = "bf16") -> float:
    """The scaling baseline: one GPU with enough memory, no communication, no recomputation."""
    dtype = param_dtype if param_dtype != "fp32" else "tf32"
    return cluster.gpu.peak_flops(dtype) * cluster.compute_efficiency / F.model_flops_per_token(shape, seq_len)
