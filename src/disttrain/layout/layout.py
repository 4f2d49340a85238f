"""The one resolved Layout: how a run is cut across ranks.

Built once per process from the config and the world size (`config/resolve.py` calls `Layout.from_config`);
the runtime (meshes, parallelize, engines, checkpoints, metrics), the dry run and the planner all read it, and
`to_config` is its one inverse (the planner's proposed configs, the DeepSpeed JSON). The rules that make a cut
valid are rules.py and the families beside it (expert_rules.py, context_rules.py, balance_rules.py). Pure
Python (no torch).

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallel is
innermost so its ranks share a node (NVLink), context parallel next to it (K/V traffic every layer);
pipeline outermost so its point-to-point traffic is what crosses nodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from disttrain.layout.splits import balance_shares, split_layers
from disttrain.layout.world_rules import resolve_dp_shard

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several virtual stages per rank
VIRTUAL_STAGES = 2  # stages per rank for the multi-stage schedules (rank r owns stages r and r + pp)
RECOMPUTE = ("none", "selective", "full")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


def stages_per_rank(pp: int, schedule: str, virtual_stages: int = VIRTUAL_STAGES) -> int:
    return virtual_stages if pp > 1 and schedule in MULTI_STAGE_SCHEDULES else 1



# Tokens per chunk of the output head's loss (models/output_head.py): one chunk of a 128K vocabulary's logits
# in bf16 is 0.5 GiB (its fp32 statistics twice that), and a 2048-row matmul still fills a GPU.
LOSS_CHUNK_TOKENS = 2048


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
    gradient_accumulation: str = "unsharded"  # "sharded": FSDP2 reduce-scatters every micro-batch's gradients
    engine: str = "torch"
    balance: str = "off"  # "auto": re-split the global batch by measured speed
    balance_weights: tuple[float, ...] = ()  # one per data-parallel rank; (): equal (or auto's start)
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS  # the output head and loss in chunks of this many tokens (0: whole)
    float8: str = "off"  # "rowwise": float8 matmuls in the blocks' Linear layers (parallel/float8.py)

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
    def reduces_every_microbatch(self) -> bool:
        """ZeRO-2/3 reduce-scatters each micro-batch's gradients into the sharded ones (and reshards after its
        backward), instead of keeping whole gradients until the last micro-batch."""
        return self.gradient_accumulation == "sharded" and self.gradient_wrapper == "fsdp"

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
    # ------------------------------------------------------------ construction, its inverse, its description
    def replace(self, **changes) -> "Layout":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, cfg, world_size: int | None, device_type: str = "cuda") -> "Layout":
        """The Layout a RunConfig describes on `world_size` ranks; raises UserError when the degrees
        do not multiply to the world size. `device_type` resolves `precision.param_dtype=auto`
        (bf16 weights for GPU matmuls, fp32 on CPU). Without a world size (validation before launch)
        `dp_shard=-1` stands as 1: only `cut_problems` may be asked of such a layout."""
        parallel, prec = cfg.parallel, cfg.precision
        dp_shard = resolve_dp_shard(parallel, world_size) if world_size is not None else max(1, parallel.dp_shard)
        dp = parallel.dp_replicate * dp_shard
        per_rank = max(1, cfg.train.global_batch_size // dp)
        if prec.compute_dtype == "fp64":  # double precision throughout (debugging numerics)
            param_dtype = "fp64"
        elif parallel.zero_stage >= 2 and cfg.engine == "torch":
            auto = "bf16" if device_type == "cuda" else "fp32"
            param_dtype = prec.param_dtype if prec.param_dtype != "auto" else auto
        else:
            param_dtype = prec.compute_dtype
        reduce_dtype = prec.reduce_dtype if prec.reduce_dtype != "auto" else (
            "fp64" if prec.compute_dtype == "fp64" else "fp32")
        return cls(dp_replicate=parallel.dp_replicate, dp_shard=dp_shard, tp=parallel.tp, pp=parallel.pp,
                   ep=parallel.ep, cp=parallel.cp, cp_method=parallel.cp_method, zero_stage=parallel.zero_stage,
                   micro_batch_size=cfg.train.micro_batch_size or per_rank, seq_len=cfg.data.seq_len,
                   global_batch_size=cfg.train.global_batch_size, pp_schedule=parallel.pp_schedule,
                   pp_microbatches=parallel.pp_microbatches, pp_layers=tuple(parallel.pp_layers),
                   sequence_parallel=parallel.sequence_parallel,
                   activation_checkpointing=parallel.activation_checkpointing,
                   param_dtype=param_dtype, compute_dtype=prec.compute_dtype, reduce_dtype=reduce_dtype,
                   cpu_offload=parallel.cpu_offload, gradient_accumulation=parallel.gradient_accumulation,
                   engine=cfg.engine, balance=parallel.balance,
                   balance_weights=tuple(float(w) for w in parallel.balance_weights),
                   loss_chunk_tokens=cfg.train.loss_chunk_tokens, float8=prec.float8)

    def to_config(self) -> dict:
        """The config sections that give this Layout back through `from_config` (on its world size): the one
        mapping from a Layout to config keys. `virtual_stages` has no key (it is always VIRTUAL_STAGES)."""
        parallel = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp,
                    "ep": self.ep, "cp": self.cp, "cp_method": self.cp_method, "zero_stage": self.zero_stage,
                    "pp_schedule": self.pp_schedule, "pp_microbatches": self.pp_microbatches,
                    "pp_layers": list(self.pp_layers), "sequence_parallel": self.sequence_parallel,
                    "activation_checkpointing": self.activation_checkpointing, "cpu_offload": self.cpu_offload,
                    "gradient_accumulation": self.gradient_accumulation, "balance": self.balance,
                    "balance_weights": list(self.balance_weights)}
        # from_config reads precision.param_dtype only under FSDP's mixed precision (torch engine, ZeRO-2/3) and
        # outside fp64; elsewhere the weights take the compute dtype, and `auto` says so
        own_param_dtype = self.zero_stage >= 2 and self.engine == "torch" and self.compute_dtype != "fp64"
        precision = {"param_dtype": self.param_dtype if own_param_dtype else "auto",
                     "compute_dtype": self.compute_dtype, "reduce_dtype": self.reduce_dtype, "float8": self.float8}
        return {"engine": self.engine, "parallel": parallel, "precision": precision,
                "train": {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                          "loss_chunk_tokens": self.loss_chunk_tokens},
                "data": {"seq_len": self.seq_len}}

    def describe(self, micro_batch: bool = False) -> str:
        """How the run is cut, in the config's words (the one spelling: the start line, metrics.jsonl's `started`
        event, the planner's tables): `dp=2 zero=3`, `ep=2`, `cp=2 ring`, `tp=2 sp`, `pp=2 interleaved_1f1b m=8`;
        `micro_batch`: and the sequences per forward pass (`mbs=4`), which the planner chooses too."""
        # replicas of one shard still differ from one group of shards under ZeRO-2/3 (whose shards span cp too)
        hsdp = self.dp_replicate > 1 and (self.dp_shard > 1 or self.zero_stage >= 2)
        dp = f"dp={self.dp}" + (f" ({self.dp_replicate} replicas x {self.dp_shard} shard"
                                f"{'s' if self.dp_shard > 1 else ''})" if hsdp else "")
        parts = [dp, ("deepspeed " if self.engine == "deepspeed" else "") + f"zero={self.zero_stage}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.cp > 1:
            parts.append(f"cp={self.cp} {self.cp_method}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + (" sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"pp={self.pp} {self.pp_schedule} m={self.microbatches}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac={self.activation_checkpointing}")
        if self.cpu_offload:
            parts.append("cpu_offload")
        if self.gradient_accumulation != "unsharded":
            parts.append(f"accumulation={self.gradient_accumulation}")
        if micro_batch:
            parts.append(f"mbs={self.micro_batch}")
        return " ".join(parts)
