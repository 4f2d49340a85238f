"""A training layout as the planner sees it, and the rules that make one valid for a model shape.

The same rules back config validation (`parallel.tp` must divide the heads, ...), so the planner
never proposes a layout the runtime would refuse.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from disttrain.models.registry import ModelShape

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several virtual stages per rank
RECOMPUTE = ("none", "selective", "full")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    """One point of the search space. `dp_shard` is the ZeRO/FSDP sharding degree; DDP (stage 0/1)
    replicates over dp_replicate x dp_shard, which is why stage 0/1 layouts keep dp_replicate=1."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    seq_len: int = 2048
    global_batch_size: int = 1  # sequences per optimizer step
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0: one pipeline micro-batch per micro-batch of the data-parallel rank
    virtual_stages: int = 2  # per rank, for interleaved / zero-bubble schedules
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    param_dtype: str = "bf16"  # dtype of the weights matmuls see
    reduce_dtype: str = "fp32"
    cpu_offload: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sequences_per_rank(self) -> int:
        return self.global_batch_size // self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        if self.pp > 1 and self.pp_microbatches:
            return self.pp_microbatches
        return max(1, self.sequences_per_rank // self.micro_batch_size)

    @property
    def micro_batch(self) -> int:
        """Sequences per forward pass (per pipeline micro-batch when pp > 1)."""
        return max(1, self.sequences_per_rank // self.microbatches)

    @property
    def stages_per_rank(self) -> int:
        return self.virtual_stages if self.pp > 1 and self.pp_schedule in MULTI_STAGE_SCHEDULES else 1

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, balanced by count. The first stage also holds the embeddings and the most
    micro-batches in flight, so a remainder goes to the last stages."""
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    for i in range(extra):
        counts[n_stages - 1 - i] += 1
    return counts


def split_problems(shape: ModelShape, tp: int, pp: int, stages_per_rank: int = 1,
                   sequence_parallel: bool = False, seq_len: int = 1) -> list[str]:
    """Reasons the model cannot be cut this way, whatever the world size and batch."""
    problems = []
    for key, value in (("model.n_heads", shape.n_heads), ("model.n_kv_heads", shape.n_kv_heads),
                       ("model.ffn_hidden_dim", shape.ffn_hidden_dim), ("model.vocab_size", shape.vocab_size)):
        if value % tp:
            problems.append(f"parallel.tp={tp} does not divide {key}={value}")
    if sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel=true needs parallel.tp > 1")
    if sequence_parallel and seq_len % tp:
        problems.append(f"parallel.tp={tp} does not divide data.seq_len={seq_len} (sequence parallel)")
    stages = pp * stages_per_rank
    if stages > shape.n_layers:
        problems.append(f"parallel.pp={pp} x {stages_per_rank} stage(s) per rank = {stages} stages "
                        f"exceeds model.n_layers={shape.n_layers}")
    return problems


def layout_problems(shape: ModelShape, layout: Layout) -> list[str]:
    """Every reason this layout cannot run this model (empty list: valid). Messages name config keys."""
    problems = split_problems(shape, layout.tp, layout.pp, layout.stages_per_rank, layout.sequence_parallel,
                              layout.seq_len)
    if layout.pp > 1:
        m = layout.microbatches
        what = (f"parallel.pp_microbatches={m}" if layout.pp_microbatches else
                f"{m} pipeline micro-batches (per-rank batch {layout.sequences_per_rank} / train.micro_batch_size="
                f"{layout.micro_batch_size}; set parallel.pp_microbatches)")
        if layout.pp_schedule in MULTI_STAGE_SCHEDULES and m % layout.pp:
            problems.append(f"{what} must be a multiple of parallel.pp={layout.pp} for pp_schedule={layout.pp_schedule}")
        if layout.pp_schedule != "gpipe" and m < layout.pp:
            problems.append(f"{what} must be at least parallel.pp={layout.pp} for pp_schedule={layout.pp_schedule}")
    if layout.global_batch_size % layout.dp:
        problems.append(f"train.global_batch_size={layout.global_batch_size} is not divisible by the "
                        f"data-parallel size {layout.dp}")
    elif layout.pp > 1 and layout.pp_microbatches:
        if layout.sequences_per_rank % layout.pp_microbatches:
            problems.append(f"parallel.pp_microbatches={layout.pp_microbatches} does not divide the per-rank "
                            f"batch {layout.sequences_per_rank}")
    elif layout.sequences_per_rank % layout.micro_batch_size:
        problems.append(f"train.micro_batch_size={layout.micro_batch_size} does not divide the per-rank batch "
                        f"{layout.sequences_per_rank}")
    if (layout.tp > 1 or layout.pp > 1) and layout.dp > 1 and layout.zero_stage < 2:
        key = f"parallel.tp={layout.tp}" if layout.tp > 1 else f"parallel.pp={layout.pp}"
        problems.append(f"{key} with {layout.dp} data-parallel ranks needs parallel.zero_stage 2 or 3, not "
                        f"{layout.zero_stage} (FSDP2 composes with tensor and pipeline parallelism on the mesh; "
                        "DDP and ZeRO-1 take neither DTensor parameters nor a schedule's many backward passes)")
    if layout.cpu_offload and layout.zero_stage < 2:
        problems.append("parallel.cpu_offload=true needs parallel.zero_stage 2 or 3")
    if layout.activation_checkpointing not in RECOMPUTE:
        problems.append(f"parallel.activation_checkpointing={layout.activation_checkpointing} "
                        f"(allowed: {', '.join(RECOMPUTE)})")
    if layout.pp_schedule not in SCHEDULES:
        problems.append(f"parallel.pp_schedule={layout.pp_schedule} (allowed: {', '.join(SCHEDULES)})")
    return problems


def layout_from_config(cfg, world_size: int, param_dtype: str | None = None) -> Layout:
    """The Layout a RunConfig describes on `world_size` ranks (dp_shard=-1 takes the rest)."""
    p = cfg.parallel
    fixed = p.dp_replicate * p.tp * p.pp
    dp_shard = p.dp_shard if p.dp_shard != -1 else max(1, world_size // fixed)
    dp = p.dp_replicate * dp_shard
    per_rank = max(1, cfg.train.global_batch_size // dp)
    if param_dtype is None:
        prec = cfg.precision
        param_dtype = (prec.param_dtype if prec.param_dtype != "auto" else "bf16") if p.zero_stage >= 2 \
            else prec.compute_dtype
    return Layout(dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage,
                  micro_batch_size=cfg.train.micro_batch_size or per_rank, seq_len=cfg.data.seq_len,
                  global_batch_size=cfg.train.global_batch_size, pp_schedule=p.pp_schedule,
                  pp_microbatches=p.pp_microbatches, sequence_parallel=p.sequence_parallel,
                  activation_checkpointing=p.activation_checkpointing, param_dtype=param_dtype,
                  reduce_dtype=cfg.precision.reduce_dtype, cpu_offload=p.cpu_offload)
