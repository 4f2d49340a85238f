"""The one resolved Layout: how a run is cut across ranks, and every rule that makes a cut valid.

Built once from the config and the world size (`Layout.from_config`); config validation, the
runtime (meshes, parallelize, engines, checkpoints, metrics) and the planner all read it, so no
other module re-derives a layout rule. Pure Python (no torch).

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallel is
innermost so its ranks share a node (NVLink); pipeline outermost so its point-to-point traffic is
what crosses nodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from disttrain.errors import UserError
from disttrain.models.shape import ModelShape

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several virtual stages per rank
VIRTUAL_STAGES = 2  # stages per rank for the multi-stage schedules (rank r owns stages r and r + pp)
RECOMPUTE = ("none", "selective", "full")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


def stages_per_rank(pp: int, schedule: str, virtual_stages: int = VIRTUAL_STAGES) -> int:
    return virtual_stages if pp > 1 and schedule in MULTI_STAGE_SCHEDULES else 1


@dataclass(frozen=True)
class Layout:
    """One way to cut a run. `dp_shard` is the ZeRO/FSDP sharding degree; DDP (stage 0/1)
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
    pp_layers: tuple[int, ...] = ()  # layers per stage; (): balanced
    virtual_stages: int = VIRTUAL_STAGES  # per rank, for interleaved / zero-bubble schedules
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    param_dtype: str = "bf16"  # dtype of the weights matmuls see (FSDP's parameter dtype at stage 2/3)
    compute_dtype: str = "bf16"  # autocast dtype (fp32: none)
    reduce_dtype: str = "fp32"
    cpu_offload: bool = False
    engine: str = "torch"
    balance: str = "off"  # "auto": re-split the global batch by measured speed
    balance_weights: tuple[float, ...] = ()  # one per data-parallel rank; (): equal (or auto's start)

    # ------------------------------------------------------------ degrees and batches
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def sequences_per_rank(self) -> int:
        return self.global_batch_size // self.dp

    @property
    def balanced(self) -> bool:
        """Data-parallel ranks take uneven shares of the global batch (in whole micro-batches)."""
        return self.balance == "auto" or bool(self.balance_weights)

    @property
    def total_microbatches(self) -> int:
        """Micro-batches of the whole global batch, over every data-parallel rank."""
        return max(1, self.global_batch_size // self.micro_batch_size)

    def initial_shares(self) -> list[int]:
        """Micro-batches per data-parallel rank before any measurement."""
        return balance_shares(self.total_microbatches, list(self.balance_weights) or [1.0] * self.dp)

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

    # ------------------------------------------------------------ what each technique does
    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.pp, self.pp_schedule, self.virtual_stages)

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def owned_stages(self, pp_rank: int) -> list[int]:
        """The pipeline stages pipeline rank `pp_rank` runs (looped placement)."""
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def stage_layer_ranges(self, n_layers: int) -> list[range]:
        counts = list(self.pp_layers) if self.pp_layers else split_layers(n_layers, self.n_stages)
        ranges, start = [], 0
        for c in counts:
            ranges.append(range(start, start + c))
            start += c
        return ranges

    @property
    def gradient_wrapper(self) -> str:
        """How gradients are reduced over data parallel: 'fsdp' (ZeRO-2/3, HSDP), 'ddp' (ZeRO-0/1 on
        several ranks), 'deepspeed' (its own engine) or 'none' (one data-parallel rank)."""
        if self.engine == "deepspeed":
            return "deepspeed"
        if self.zero_stage >= 2:
            return "fsdp"
        return "ddp" if self.dp > 1 else "none"

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3 frees gathered parameters after each block's forward; ZeRO-2 keeps them to backward.
        Under uneven shares ZeRO-3 keeps them too (ranks with fewer micro-batches would otherwise
        miss all-gathers the others issue): its step then holds ZeRO-2's gathered parameters."""
        return self.zero_stage == 3 and not self.balanced

    @property
    def sharded_optimizer(self) -> bool:
        """ZeRO-1: replicated parameters and gradients, optimizer state split over data parallel."""
        return self.engine == "torch" and self.zero_stage == 1

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """Mesh dims FSDP spans: 2-D (replicate, shard) for HSDP, else the shard dim."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    @property
    def replica_dims(self) -> tuple[str, ...]:
        """Mesh dims over which ranks hold identical parameters (compared by the sync check): every
        data-parallel dim under DDP/ZeRO-1, dp_replicate under HSDP, none under plain FSDP or DeepSpeed."""
        wrapper = self.gradient_wrapper
        if wrapper in ("ddp", "none"):
            return ("dp_replicate", "dp_shard")
        if wrapper == "fsdp" and self.dp_replicate > 1:
            return ("dp_replicate",)
        return ()

    # ------------------------------------------------------------ construction
    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, cfg, world_size: int | None, device_type: str = "cuda") -> "Layout":
        """The Layout a RunConfig describes on `world_size` ranks; raises UserError when the degrees
        do not multiply to the world size. `device_type` resolves `precision.param_dtype=auto`
        (bf16 weights for GPU matmuls, fp32 on CPU). Without a world size (validation before launch)
        `dp_shard=-1` stands as 1: only `cut_problems` may be asked of such a layout."""
        p, prec = cfg.parallel, cfg.precision
        dp_shard = resolve_dp_shard(p, world_size) if world_size is not None else max(1, p.dp_shard)
        dp = p.dp_replicate * dp_shard
        per_rank = max(1, cfg.train.global_batch_size // dp)
        if prec.compute_dtype == "fp64":  # double precision throughout (debugging numerics)
            param_dtype = "fp64"
        elif p.zero_stage >= 2 and cfg.engine == "torch":
            auto = "bf16" if device_type == "cuda" else "fp32"
            param_dtype = prec.param_dtype if prec.param_dtype != "auto" else auto
        else:
            param_dtype = prec.compute_dtype
        reduce_dtype = prec.reduce_dtype if prec.reduce_dtype != "auto" else (
            "fp64" if prec.compute_dtype == "fp64" else "fp32")
        return cls(dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage,
                   micro_batch_size=cfg.train.micro_batch_size or per_rank, seq_len=cfg.data.seq_len,
                   global_batch_size=cfg.train.global_batch_size, pp_schedule=p.pp_schedule,
                   pp_microbatches=p.pp_microbatches, pp_layers=tuple(p.pp_layers),
                   sequence_parallel=p.sequence_parallel, activation_checkpointing=p.activation_checkpointing,
                   param_dtype=param_dtype, compute_dtype=prec.compute_dtype, reduce_dtype=reduce_dtype,
                   cpu_offload=p.cpu_offload, engine=cfg.engine, balance=p.balance,
                   balance_weights=tuple(float(w) for w in p.balance_weights))


def resolve_dp_shard(parallel, world_size: int) -> int:
    """`dp_shard=-1` takes what is left of the world size; the product must equal it."""
    fixed = parallel.dp_replicate * parallel.tp * parallel.pp
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        if world_size % fixed:
            raise UserError(f"parallel.dp_replicate={parallel.dp_replicate} x parallel.tp={parallel.tp} x "
                            f"parallel.pp={parallel.pp} = {fixed} does not divide the world size {world_size}")
        dp_shard = world_size // fixed
    if fixed * dp_shard != world_size:
        raise UserError(f"parallel.dp_replicate={parallel.dp_replicate} x parallel.dp_shard={dp_shard} x "
                        f"parallel.tp={parallel.tp} x parallel.pp={parallel.pp} = {fixed * dp_shard} does not equal "
                        f"the world size {world_size}")
    return dp_shard


def balance_shares(total: int, weights: list[float]) -> list[int]:
    """`total` micro-batches split in proportion to `weights`, at least one each (every rank joins the
    gradient reduction), by largest remainder; ties go to the lower rank, so every rank computes the
    same split from the same weights."""
    if total < len(weights):
        raise ValueError(f"{total} micro-batches cannot give each of {len(weights)} ranks one")
    s = float(sum(weights))
    ideal = [total * w / s for w in weights]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) > total:
        i = max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: (counts[i] - ideal[i], -i))
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(len(counts)), key=lambda i: (ideal[i] - counts[i], -i))
        counts[i] += 1
    return counts


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, balanced by count. The first stage also holds the embeddings and the most
    micro-batches in flight, so a remainder goes to the last stages."""
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    for i in range(extra):
        counts[n_stages - 1 - i] += 1
    return counts


def split_problems(shape: ModelShape | None, tp: int, pp: int, stages_per_rank: int = 1,
                   sequence_parallel: bool = False, seq_len: int = 1) -> list[str]:
    """Reasons the model cannot be cut this way, whatever the world size and batch (`shape` None: a
    model without known dimensions; its ModelSpec decides at build time)."""
    problems = shape.tp_problems(tp) if tp > 1 and shape is not None else []
    if sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel=true needs parallel.tp > 1")
    if sequence_parallel and seq_len % tp:
        problems.append(f"parallel.tp={tp} does not divide data.seq_len={seq_len} (sequence parallel)")
    stages = pp * stages_per_rank
    if shape is not None and stages > shape.n_layers:
        problems.append(f"parallel.pp={pp} x {stages_per_rank} stage(s) per rank = {stages} stages "
                        f"exceeds model.n_layers={shape.n_layers}")
    return problems


def layout_problems(shape: ModelShape | None, layout: Layout) -> list[str]:
    """Every reason this layout cannot run this model (empty list: valid). Messages name config keys."""
    return cut_problems(shape, layout) + batch_problems(layout)


def cut_problems(shape: ModelShape | None, layout: Layout) -> list[str]:
    """Rules that hold whatever the world size: how the model is split, and what composes with what."""
    problems = split_problems(shape, layout.tp, layout.pp, layout.stages_per_rank, layout.sequence_parallel,
                              layout.seq_len)
    if layout.pp_layers and shape is not None:
        n = layout.n_stages
        if len(layout.pp_layers) != n or sum(layout.pp_layers) != shape.n_layers or min(layout.pp_layers) < 1:
            problems.append(f"parallel.pp_layers={list(layout.pp_layers)}: needs {n} positive counts (pp x stages "
                            f"per rank for pp_schedule={layout.pp_schedule}) adding up to model.n_layers="
                            f"{shape.n_layers}")
    if layout.pp > 1 and layout.compute_dtype == "fp16":
        problems.append(f"precision.compute_dtype=fp16 with parallel.pp={layout.pp}: dynamic loss scaling does "
                        "not reach inside the pipeline schedule's backward passes (allowed with pp > 1: fp32, bf16)")
    if layout.pp > 1 and layout.pp_schedule == "zero_bubble" and layout.activation_checkpointing == "selective":
        # Found by `disttrain dryrun`, then seen in a real run: the schedule's separate input- and
        # weight-gradient passes are two backwards through each checkpointed region, which torch's
        # selective checkpointing refuses ("Trying to backward an extra time").
        problems.append("parallel.activation_checkpointing=selective with parallel.pp_schedule=zero_bubble: the "
                        "schedule runs two backward passes per block, which selective checkpointing refuses "
                        "(allowed with zero_bubble: none, full; or another pp_schedule)")
    if layout.engine == "deepspeed":
        problems += _deepspeed_problems(layout)
    if layout.balanced:
        problems += _balance_cut_problems(layout)
    if layout.cpu_offload and layout.zero_stage < 2:
        problems.append(f"parallel.cpu_offload=true needs parallel.zero_stage 2 or 3 (FSDP2), not {layout.zero_stage}")
    if layout.activation_checkpointing not in RECOMPUTE:
        problems.append(f"parallel.activation_checkpointing={layout.activation_checkpointing} "
                        f"(allowed: {', '.join(RECOMPUTE)})")
    if layout.pp_schedule not in SCHEDULES:
        problems.append(f"parallel.pp_schedule={layout.pp_schedule} (allowed: {', '.join(SCHEDULES)})")
    return problems


def batch_problems(layout: Layout) -> list[str]:
    """Rules that need the data-parallel size: how the global batch splits into ranks and micro-batches."""
    problems = []
    if layout.pp > 1:
        m = layout.microbatches
        what = (f"parallel.pp_microbatches={m}" if layout.pp_microbatches else
                f"{m} pipeline micro-batches (per-rank batch {layout.sequences_per_rank} / train.micro_batch_size="
                f"{layout.micro_batch_size}; set parallel.pp_microbatches)")
        if layout.pp_schedule in MULTI_STAGE_SCHEDULES and m % layout.pp:
            problems.append(f"{what} must be a multiple of parallel.pp={layout.pp} for pp_schedule={layout.pp_schedule}")
        if layout.pp_schedule != "gpipe" and m < layout.pp:
            problems.append(f"{what} must be at least parallel.pp={layout.pp} for pp_schedule={layout.pp_schedule}")
    if layout.balanced:
        problems += _balance_batch_problems(layout)
    elif layout.global_batch_size % layout.dp:
        problems.append(f"train.global_batch_size={layout.global_batch_size} is not divisible by the "
                        f"data-parallel size {layout.dp} (world size {layout.world_size})")
    elif layout.pp > 1 and layout.pp_microbatches:
        if layout.sequences_per_rank % layout.pp_microbatches:
            problems.append(f"parallel.pp_microbatches={layout.pp_microbatches} does not divide the per-rank "
                            f"batch {layout.sequences_per_rank}")
    elif layout.sequences_per_rank % layout.micro_batch_size:
        problems.append(f"train.micro_batch_size={layout.micro_batch_size} does not divide the per-rank batch "
                        f"{layout.sequences_per_rank} (train.global_batch_size={layout.global_batch_size} over "
                        f"{layout.dp} data-parallel ranks)")
    if layout.engine == "torch" and (layout.tp > 1 or layout.pp > 1) and layout.dp > 1 and layout.zero_stage < 2:
        key = f"parallel.tp={layout.tp}" if layout.tp > 1 else f"parallel.pp={layout.pp}"
        problems.append(f"{key} with {layout.dp} data-parallel ranks needs parallel.zero_stage 2 or 3, not "
                        f"{layout.zero_stage} (FSDP2 composes with tensor and pipeline parallelism on the mesh; "
                        "DDP and ZeRO-1 take neither DTensor parameters nor a schedule's many backward passes)")
    return problems


def _deepspeed_problems(layout: Layout) -> list[str]:
    problems = []
    if layout.tp > 1 or layout.pp > 1:
        problems.append(f"parallel.tp={layout.tp}, parallel.pp={layout.pp}: tensor and pipeline parallelism need "
                        "engine=torch (allowed with engine=deepspeed: tp=1, pp=1)")
    if layout.dp_replicate != 1:
        problems.append(f"parallel.dp_replicate={layout.dp_replicate} needs engine=torch (HSDP); DeepSpeed "
                        "partitions over the whole world (allowed with engine=deepspeed: 1)")
    return problems


def _balance_cut_problems(layout: Layout) -> list[str]:
    what = "parallel.balance=auto" if layout.balance == "auto" else "parallel.balance_weights"
    problems = []
    if layout.engine != "torch":
        problems.append(f"{what} needs engine=torch (DeepSpeed splits the batch evenly itself)")
    if layout.pp > 1:
        problems.append(f"{what} with parallel.pp={layout.pp}: a pipeline schedule runs the same number of "
                        "micro-batches on every rank (allowed: pp=1)")
    if any(not w > 0 for w in layout.balance_weights):
        problems.append(f"parallel.balance_weights={list(layout.balance_weights)}: every weight must be positive")
    return problems


def _balance_batch_problems(layout: Layout) -> list[str]:
    g, m, dp = layout.global_batch_size, layout.micro_batch_size, layout.dp
    problems = []
    if layout.balance_weights and len(layout.balance_weights) != dp:
        problems.append(f"parallel.balance_weights={list(layout.balance_weights)}: {len(layout.balance_weights)} "
                        f"weight(s) for {dp} data-parallel rank(s) (world size {layout.world_size}); give one per rank")
    if g % m:
        problems.append(f"train.micro_batch_size={m} does not divide train.global_batch_size={g} (uneven "
                        "shares are counted in whole micro-batches)")
    elif g // m < dp:
        problems.append(f"train.global_batch_size={g} / train.micro_batch_size={m} = {g // m} micro-batches, fewer "
                        f"than the {dp} data-parallel ranks (each needs at least one)")
    return problems
