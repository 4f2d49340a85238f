"""The forward-only pass of a frozen model in a training step, for the step time (plan/timing.py): DPO's reference (a
frozen copy of the policy, or the policy itself with its LoRA adapters switched off) or a distillation teacher.

What the runtime does (train/objectives.py, train/preference_reference.py, train/pipeline_engine.py), and what is
counted for it, on the rows the trained model sees (a preference pair's two sequences):
- compute: a forward of every micro-batch at the frozen model's own shape, a third of a training step's FLOPs
  (6N + attention per token, the forward's 2N + a third of attention), never recomputed (no backward);
- tensor parallelism: the forward's two reductions per layer and the embedding's (as the trained model's);
- pipelines: the frozen model runs its own forward-only schedule over the same stages before the trained one's,
  with a bubble of (p-1)/v micro-batch forwards (no backward to fill it) and one transfer per micro-batch and stage;
- ZeRO-3: its blocks are gathered again for every micro-batch; a separate copy's root (embeddings, output layer) is
  resharded after each forward outside pipelines, so it is gathered again too. Under ZeRO-2 a separate copy outside
  pipelines is resharded after each block's forward as under ZeRO-3 (train/preference_reference.py: a backward,
  which it never runs, would be what ZeRO-2 keeps them for); elsewhere the blocks stay gathered after their first
  forward. The gathers hide behind the frozen forward as the trained model's hide behind its own (`exposed`);
- distillation with a chunked output head: the teacher's head weight made whole (fp32) for every micro-batch where
  it is sharded (tensor parallelism; ZeRO-2/3 outside pipelines);
- CPU offload: its parameter shards go up to the GPU for every micro-batch.
Not counted: a MoE frozen model's experts gathered over their own group (counted over the dense one); the whole
logits gathered over the vocabulary by distillation without a chunked head under tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.models import flops as F
from disttrain.models.shape import ModelShape
from disttrain.plan.memory import layer_params, rank_params
from disttrain.plan.moe import dispatch_s, expert_excess_flops
from disttrain.plan.timing import (PCIE_BYTES_PER_S, Cluster, StepTime, all_gather_s, all_reduce_s, exposed,
                                   measured_compute, p2p_s)


@dataclass(frozen=True)
class FrozenTime:
    compute_s: float = 0.0
    bubble_s: float = 0.0  # its own pipeline schedule's fill and drain
    comm_s: float = 0.0  # tensor-parallel, pipeline and expert traffic, all exposed
    gather_s: float = 0.0  # FSDP's gathers and the teacher head's, in all
    gather_exposed_s: float = 0.0
    flops_per_token: float = 0.0  # per token the trained model sees

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s + self.gather_exposed_s


def frozen_forward_time(frozen: ModelShape, layout: Layout, cluster: Cluster, *, peak: float, rate: float, own_copy: bool,
                        teacher_head: bool, routing_skew: float = 1.0) -> FrozenTime:
    """The pass of `frozen` in one step of `layout` (the trained model's, with a preference objective's rows
    counted). `peak`: the dtype's dense peak FLOP/s; `rate`: a measured profile's matmul rate; `own_copy`: a model
    of its own (False: the policy with its adapters off, whose parameters the step gathers anyway); `teacher_head`:
    distillation's chunked head, which takes the teacher's head weight whole."""
    lay = layout.replace(activation_checkpointing="none")  # nothing is kept for a backward
    s, mb, m, v = lay.seq_len, lay.micro_batch, lay.microbatches, lay.stages_per_rank
    per_token = F.model_flops_per_token(frozen, s) / 3
    tokens = lay.global_batch_size * s
    if cluster.elementwise_bytes_per_s is None:
        rate = peak * cluster.compute_efficiency
        compute = per_token * tokens / lay.world_size / rate
    else:
        compute = measured_compute(frozen, lay, cluster, rate)[0] / 3
    compute += expert_excess_flops(frozen, lay, routing_skew) / 3 / rate
    bubble = compute * (lay.pp - 1) / (v * m) if lay.pp > 1 else 0.0

    e = DTYPE_BYTES[lay.param_dtype]
    held = rank_params(frozen, lay, 0)
    comm = dispatch_s(frozen, lay, cluster, routing_skew) / 2  # forward's dispatch and combine
    if lay.tp > 1:
        bw, lat = cluster.link(lay.tp)
        one = all_reduce_s(lay.tp, e * mb * s // lay.cp * frozen.dim, bw, lat)
        measured = cluster.tp_collective
        if measured and measured.get("ranks") == lay.tp:
            one = max(one, measured["seconds"] + one - all_reduce_s(lay.tp, measured["bytes"], bw, lat))
        comm += m * (2 * held.layers + int(held.embedding)) * one
    if lay.pp > 1:
        bw, lat = cluster.link(lay.world_size)
        comm += m * v * p2p_s(e * mb * s // lay.cp * frozen.dim / (lay.tp if lay.sequence_parallel else 1), bw, lat)

    gather = gather_exposed = 0.0
    if lay.zero_stage >= 2 and lay.shard_ranks > 1:
        resharded = lay.zero_stage == 3 or (own_copy and lay.pp == 1 and not lay.balanced)  # ZeRO-2: see above
        gathered = (held.block if resharded else 0) + (held.root if own_copy and lay.pp == 1 else 0)
        bw, lat = cluster.link(lay.shard_ranks * lay.tp, "all_gather")
        rounds = m  # uneven shares keep the trained model gathered between micro-batches, not a frozen one
        one = all_gather_s(lay.shard_ranks, e * gathered, bw, lat)
        first = all_gather_s(lay.shard_ranks, e * (layer_params(frozen, lay.tp, lay.ep) if resharded
                                                   else gathered), bw, lat)
        gather = rounds * one
        gather_exposed = rounds * exposed(one, compute / m, cluster.overlap_efficiency, first)
    if teacher_head and lay.loss_chunk_tokens:  # the student's head takes the teacher's weight whole, in fp32
        # (under pipelines FSDP keeps the teacher stage's root gathered: a gather over tensor parallelism alone)
        n = (lay.shard_ranks if lay.zero_stage >= 2 and lay.pp == 1 else 1) * lay.tp
        if n > 1:
            head = m * all_gather_s(n, 4 * frozen.vocab_size * frozen.dim, *cluster.link(n, "all_gather"))
            gather += head
            gather_exposed += head
    if lay.cpu_offload and own_copy:
        gather_exposed += m * e * held.total / lay.shard_ranks / PCIE_BYTES_PER_S
    return FrozenTime(compute, bubble, comm, gather, gather_exposed, per_token)


def with_frozen_forward(time: StepTime, objective, layout: Layout, cluster: Cluster,
                        routing_skew: float = 1.0) -> StepTime:
    """`time` (plan/timing.py step_time of `layout` and `objective`) with the frozen model's forward added, if the
    objective runs one: its parts in frozen_s (compute and bubble apart), the throughput over the longer step, the
    MFU of the trained model's FLOPs (as the runtime logs it), the HFU with the frozen forward's."""
    shape = objective.forward_shape
    if shape is None:
        return time
    if objective.rows > 1:
        layout = layout.replace(micro_batch_size=layout.micro_batch_size * objective.rows,
                                global_batch_size=layout.global_batch_size * objective.rows)
    dtype = layout.param_dtype if layout.param_dtype != "fp32" else "tf32"
    peak = cluster.gpu.peak_flops(dtype)
    frozen = frozen_forward_time(shape, layout, cluster, peak=peak, rate=cluster.matmul_rate(layout.tp, dtype, peak),
                                 own_copy=objective.frozen is not None, teacher_head=objective.name == "distill",
                                 routing_skew=routing_skew)
    step = time.step_s + frozen.step_s
    scale = time.step_s / step
    per_gpu = time.tokens_per_s_per_gpu * scale
    return replace(time, step_s=step, tokens_per_s=time.tokens_per_s * scale, tokens_per_s_per_gpu=per_gpu,
                   mfu=time.mfu * scale, hfu=time.hfu * scale + F.mfu(frozen.flops_per_token, per_gpu, peak),
                   frozen_s=frozen.step_s, frozen_compute_s=frozen.compute_s, frozen_bubble_s=frozen.bubble_s)
