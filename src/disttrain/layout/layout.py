"""The one resolved Layout: how a run is cut across ranks, and every rule that makes a cut valid.

Built once per process from the config and the world size (`resolve.resolve_run` calls
`Layout.from_config`); the runtime (meshes, parallelize, engines, checkpoints, metrics), the dry run
and the planner all read it. Rules return typed `Problem`s, so no other module re-derives a layout
rule or reads its message text. Pure Python (no torch).

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallel is
innermost so its ranks share a node (NVLink), context parallel next to it (K/V traffic every layer);
pipeline outermost so its point-to-point traffic is what crosses nodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from disttrain.core.errors import UserError
from disttrain.layout.expert_rules import expert_batch_problems, expert_problems
from disttrain.layout.problem import Problem
from disttrain.layout.splits import balance_shares, split_layers
from disttrain.models.shape import ModelShape

__all__ = ["Layout", "Problem", "batch_problems", "cut_problems", "layout_problems", "world_problems"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
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
    ep: int = 1  # expert parallel: experts split over ep of the dp_shard x cp ranks (contiguous, innermost)
    cp: int = 1  # context parallel: ranks sharing each sequence (rank r holds chunks r and 2cp-1-r)
    cp_method: str = "ring"
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
        return self.dp * self.cp * self.tp * self.pp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def gradient_ranks(self) -> int:
        """Ranks a parameter's gradient is reduced over: data parallel x context parallel (each context
        rank computes the gradient of its own tokens, like a data-parallel rank)."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP shards a parameter over (ZeRO-2/3): dp_shard x cp."""
        return self.dp_shard * self.cp

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

    @property
    def efsdp(self) -> int:
        """Gradient ranks holding the same experts: what expert gradients reduce (and ZeRO shards) over.
        Experts are split over ep of the dp_shard x cp ranks, so the context ranks count here too."""
        return self.gradient_ranks // self.ep

    @property
    def experts_outside_fsdp(self) -> bool:
        """ZeRO-2/3 with one rank per expert group (efsdp 1) and nothing to cast or offload: FSDP would only
        copy the experts in and out of its buffers, so they stay plain shards (parallel/expert_shards.py)."""
        return (self.zero_stage >= 2 and self.ep > 1 and self.efsdp == 1 and not self.cpu_offload
                and self.param_dtype in ("fp32", "fp64"))

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
        return "ddp" if self.gradient_ranks > 1 else "none"

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3 frees gathered parameters after each block's forward; ZeRO-2 keeps them to backward.
        Under uneven shares ZeRO-3 keeps them too (ranks with fewer micro-batches would otherwise
        miss all-gathers the others issue): its step then holds ZeRO-2's gathered parameters."""
        return self.zero_stage == 3 and not self.balanced

    @property
    def keep_gathered(self) -> bool:
        """Uneven shares under FSDP: parameters stay gathered over a rank's micro-batches (counts differ)."""
        return self.balanced and self.gradient_wrapper == "fsdp"

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
        return cls(dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp,
                   cp_method=p.cp_method, zero_stage=p.zero_stage,
                   micro_batch_size=cfg.train.micro_batch_size or per_rank, seq_len=cfg.data.seq_len,
                   global_batch_size=cfg.train.global_batch_size, pp_schedule=p.pp_schedule,
                   pp_microbatches=p.pp_microbatches, pp_layers=tuple(p.pp_layers),
                   sequence_parallel=p.sequence_parallel, activation_checkpointing=p.activation_checkpointing,
                   param_dtype=param_dtype, compute_dtype=prec.compute_dtype, reduce_dtype=reduce_dtype,
                   cpu_offload=p.cpu_offload, engine=cfg.engine, balance=p.balance,
                   balance_weights=tuple(float(w) for w in p.balance_weights))


def resolve_dp_shard(parallel, world_size: int) -> int:
    """`dp_shard=-1` takes what is left of the world size; the product must equal it."""
    problems = world_problems(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp, world_size,
                              parallel.cp)
    if problems:
        raise UserError(str(problems[0]))
    fixed = parallel.dp_replicate * parallel.tp * parallel.pp * parallel.cp
    return world_size // fixed if parallel.dp_shard == -1 else parallel.dp_shard


# ---------------------------------------------------------------- the rules (each a Problem: problem.py)
def world_problems(dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int,
                   cp: int = 1) -> list[Problem]:
    """The degrees must multiply to the world size (`dp_shard=-1`: whatever is left of it)."""
    fixed = dp_replicate * tp * pp * cp
    cp_text = f" x parallel.cp={cp}" if cp > 1 else ""
    if dp_shard == -1:
        if world_size % fixed:
            return [Problem("parallel.dp_shard", dp_shard, f"degrees whose product divides {world_size}",
                            f"parallel.dp_replicate={dp_replicate} x parallel.tp={tp} x parallel.pp={pp}{cp_text} = "
                            f"{fixed} does not divide the world size {world_size}")]
        dp_shard = world_size // fixed
    if fixed * dp_shard != world_size:
        return [Problem("parallel.dp_shard", dp_shard, f"degrees multiplying to {world_size}",
                        f"parallel.dp_replicate={dp_replicate} x parallel.dp_shard={dp_shard} x parallel.tp={tp} x "
                        f"parallel.pp={pp}{cp_text} = {fixed * dp_shard} does not equal the world size {world_size}")]
    return []


def split_problems(shape: ModelShape | None, tp: int, pp: int, stages_per_rank: int = 1,
                   sequence_parallel: bool = False, seq_len: int = 1) -> list[Problem]:
    """Reasons the model cannot be cut this way, whatever the world size and batch (`shape` None: a
    model without known dimensions; its ModelSpec decides at build time)."""
    problems = []
    if tp > 1 and shape is not None:  # heads, FFN width and vocabulary are split tp ways
        problems += [Problem("parallel.tp", tp, f"a divisor of {key}={value}",
                             f"parallel.tp={tp} does not divide {key}={value}")
                     for key, value in (("model.n_heads", shape.n_heads), ("model.n_kv_heads", shape.n_kv_heads),
                                        ("model.ffn_hidden_dim", shape.ffn_hidden_dim),
                                        ("model.vocab_size", shape.vocab_size)) if value % tp]
    if sequence_parallel and tp == 1:
        problems.append(Problem("parallel.sequence_parallel", True, "false with parallel.tp=1",
                                "parallel.sequence_parallel=true needs parallel.tp > 1"))
    if sequence_parallel and seq_len % tp:
        problems.append(Problem("parallel.tp", tp, f"a divisor of data.seq_len={seq_len}",
                                f"parallel.tp={tp} does not divide data.seq_len={seq_len} (sequence parallel)"))
    stages = pp * stages_per_rank
    if shape is not None and stages > shape.n_layers:
        problems.append(Problem("parallel.pp", pp, f"at most model.n_layers={shape.n_layers} stages",
                                f"parallel.pp={pp} x {stages_per_rank} stage(s) per rank = {stages} stages "
                                f"exceeds model.n_layers={shape.n_layers}"))
    return problems


def layout_problems(shape: ModelShape | None, layout: Layout) -> list[Problem]:
    """Every reason this layout cannot run this model (empty list: valid)."""
    return cut_problems(shape, layout) + batch_problems(layout)


def cut_problems(shape: ModelShape | None, layout: Layout) -> list[Problem]:
    """Rules that hold whatever the world size: how the model is split, and what composes with what."""
    lay = layout
    problems = split_problems(shape, lay.tp, lay.pp, lay.stages_per_rank, lay.sequence_parallel, lay.seq_len)
    if lay.pp_layers and shape is not None:
        n = lay.n_stages
        if len(lay.pp_layers) != n or sum(lay.pp_layers) != shape.n_layers or min(lay.pp_layers) < 1:
            problems.append(Problem("parallel.pp_layers", list(lay.pp_layers), f"{n} positive counts adding up to "
                                    f"{shape.n_layers}", f"parallel.pp_layers={list(lay.pp_layers)}: needs {n} "
                                    f"positive counts (pp x stages per rank for pp_schedule={lay.pp_schedule}) "
                                    f"adding up to model.n_layers={shape.n_layers}"))
    if lay.pp > 1 and lay.compute_dtype == "fp16":
        problems.append(Problem("precision.compute_dtype", "fp16", "fp32, bf16", f"precision.compute_dtype=fp16 with "
                                f"parallel.pp={lay.pp}: dynamic loss scaling does not reach inside the pipeline "
                                "schedule's backward passes (allowed with pp > 1: fp32, bf16)"))
    if lay.pp > 1 and lay.pp_schedule == "zero_bubble" and (ac := lay.activation_checkpointing) != "none":
        # Two backwards per block: selective checkpointing refuses that; full keeps its first recomputation for
        # the second (dry run, tiny, 2 ranks: 49/52 MB against 42/45 MB without checkpointing).
        why = ("which selective checkpointing refuses" if ac == "selective" else
               "and full checkpointing recomputes each block in both, holding more memory than no checkpointing")
        problems.append(Problem("parallel.activation_checkpointing", ac, "none", f"parallel.activation_checkpointing={ac} "
                                f"with parallel.pp_schedule=zero_bubble: the schedule runs two backward passes per block, "
                                f"{why} (allowed with zero_bubble: none; or another pp_schedule)"))
    problems += expert_problems(shape, lay)
    if lay.cp > 1:
        from disttrain.layout.context_rules import cp_problems

        problems += cp_problems(shape, lay)
    if lay.engine == "deepspeed":
        problems += _deepspeed_problems(lay)
    if lay.balanced:
        from disttrain.layout.balance_rules import balance_cut_problems

        problems += balance_cut_problems(lay)
    if lay.cpu_offload and lay.zero_stage < 2:
        problems.append(Problem("parallel.cpu_offload", True, "false with zero_stage 0 or 1", "parallel.cpu_offload="
                                f"true needs parallel.zero_stage 2 or 3 (FSDP2), not {lay.zero_stage}"))
    if lay.activation_checkpointing not in RECOMPUTE:
        problems.append(Problem("parallel.activation_checkpointing", lay.activation_checkpointing, ", ".join(RECOMPUTE),
                                f"parallel.activation_checkpointing={lay.activation_checkpointing} "
                                f"(allowed: {', '.join(RECOMPUTE)})"))
    if lay.pp_schedule not in SCHEDULES:
        problems.append(Problem("parallel.pp_schedule", lay.pp_schedule, ", ".join(SCHEDULES),
                                f"parallel.pp_schedule={lay.pp_schedule} (allowed: {', '.join(SCHEDULES)})"))
    return problems


def batch_problems(layout: Layout) -> list[Problem]:
    """Rules that need the data-parallel size: how the global batch splits into ranks and micro-batches."""
    lay, problems = layout, []
    if lay.pp > 1:
        m = lay.microbatches
        what = (f"parallel.pp_microbatches={m}" if lay.pp_microbatches else
                f"{m} pipeline micro-batches (per-rank batch {lay.sequences_per_rank} / train.micro_batch_size="
                f"{lay.micro_batch_size}; set parallel.pp_microbatches)")
        if lay.pp_schedule in MULTI_STAGE_SCHEDULES and m % lay.pp:
            problems.append(Problem("parallel.pp_microbatches", m, f"a multiple of parallel.pp={lay.pp}",
                                    f"{what} must be a multiple of parallel.pp={lay.pp} for pp_schedule={lay.pp_schedule}"))
        if lay.pp_schedule != "gpipe" and m < lay.pp:
            problems.append(Problem("parallel.pp_microbatches", m, f"at least parallel.pp={lay.pp}",
                                    f"{what} must be at least parallel.pp={lay.pp} for pp_schedule={lay.pp_schedule}"))
    problems += expert_batch_problems(lay)
    if lay.balanced:
        from disttrain.layout.balance_rules import balance_batch_problems

        problems += balance_batch_problems(lay)
    elif lay.global_batch_size % lay.dp:
        problems.append(Problem("train.global_batch_size", lay.global_batch_size, f"a multiple of {lay.dp}",
                                f"train.global_batch_size={lay.global_batch_size} is not divisible by the "
                                f"data-parallel size {lay.dp} (world size {lay.world_size})"))
    elif lay.pp > 1 and lay.pp_microbatches:
        if lay.sequences_per_rank % lay.pp_microbatches:
            problems.append(Problem("parallel.pp_microbatches", lay.pp_microbatches, f"a divisor of "
                                    f"{lay.sequences_per_rank}", f"parallel.pp_microbatches={lay.pp_microbatches} "
                                    f"does not divide the per-rank batch {lay.sequences_per_rank}"))
    elif lay.sequences_per_rank % lay.micro_batch_size:
        problems.append(Problem("train.micro_batch_size", lay.micro_batch_size, f"a divisor of "
                                f"{lay.sequences_per_rank}", f"train.micro_batch_size={lay.micro_batch_size} does "
                                f"not divide the per-rank batch {lay.sequences_per_rank} (train.global_batch_size="
                                f"{lay.global_batch_size} over {lay.dp} data-parallel ranks)"))
    if lay.engine == "torch" and (lay.tp > 1 or lay.pp > 1) and lay.gradient_ranks > 1 and lay.zero_stage < 2:
        key = f"parallel.tp={lay.tp}" if lay.tp > 1 else f"parallel.pp={lay.pp}"
        problems.append(Problem("parallel.zero_stage", lay.zero_stage, "2, 3", f"{key} with {lay.gradient_ranks} data-parallel "
                                f"ranks needs parallel.zero_stage 2 or 3, not {lay.zero_stage} (FSDP2 composes with "
                                "tensor and pipeline parallelism on the mesh; DDP and ZeRO-1 take neither DTensor "
                                "parameters nor a schedule's many backward passes)"))
    return problems


def _deepspeed_problems(layout: Layout) -> list[Problem]:
    problems = []
    if layout.tp > 1 or layout.pp > 1:
        key, value = ("parallel.tp", layout.tp) if layout.tp > 1 else ("parallel.pp", layout.pp)
        problems.append(Problem(key, value, "1 with engine=deepspeed", f"parallel.tp={layout.tp}, parallel.pp="
                                f"{layout.pp}: tensor and pipeline parallelism need engine=torch (allowed with "
                                "engine=deepspeed: tp=1, pp=1)"))
    if layout.dp_replicate != 1:
        problems.append(Problem("parallel.dp_replicate", layout.dp_replicate, "1 with engine=deepspeed",
                                f"parallel.dp_replicate={layout.dp_replicate} needs engine=torch (HSDP); DeepSpeed "
                                "partitions over the whole world (allowed with engine=deepspeed: 1)"))
    return problems
