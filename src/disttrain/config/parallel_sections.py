"""The config sections that say how a run is cut over ranks (`parallel`) and in which dtypes (`precision`);
`Layout.from_config` reads them. Every key described (docs/config.md is generated from these)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from disttrain.config.sections import PARALLELISM_DOC, Section

DOC = f"; {PARALLELISM_DOC}"


class ParallelConfig(Section):
    """How the run is cut: data, tensor, pipeline, expert and context parallelism on one device mesh."""

    dp_replicate: int = Field(1, gt=0, description="replica groups of data parallel; with zero_stage 2-3 and more "
                              "than 1: HSDP (shard within dp_shard ranks, replicate across groups)")
    dp_shard: int = Field(-1, ge=-1, description="data-parallel ranks that shard (ZeRO-2/3) or replicate (DDP); "
                          "-1: whatever is left of the world size")
    tp: int = Field(1, gt=0, description="tensor parallel (DTensor): heads, FFN width and vocabulary split over this "
                    "many ranks (it must divide heads, kv-heads, FFN width and vocabulary); with data parallel it "
                    "needs zero_stage 2-3" + DOC)
    pp: int = Field(1, gt=0, description="pipeline stages over this many ranks; with data parallel it needs "
                    "zero_stage 2-3" + DOC)
    ep: int = Field(1, gt=0, description="expert parallel: an MoE model's experts split over this many of the "
                    "dp_shard x cp ranks, tokens sent to them by all-to-all (divides model.moe.num_experts)" + DOC)
    cp: int = Field(1, gt=0, description="context parallel: each sequence cut into 2 x cp chunks over this many ranks "
                    "(data.seq_len a multiple of 2 x cp)" + DOC)
    cp_method: Literal["ring", "allgather", "ulysses"] = Field(
        "ring", description="how attention sees the other shards: ring (K/V passed round), allgather (K/V "
        "gathered once per layer), ulysses (all-to-all to head shards; heads divisible by cp)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = Field(
        "1f1b", description="pipeline schedule; interleaved_1f1b and zero_bubble run 2 stages per rank")
    pp_microbatches: int = Field(0, ge=0, description="pipeline micro-batches per step; 0: per-rank batch / "
                                 "train.micro_batch_size")
    pp_layers: list[int] = Field(default_factory=list, description="layers per pipeline stage; []: balanced")
    zero_stage: int = Field(0, ge=0, le=3, description="0 DDP; 1 optimizer states sharded (ZeroRedundancyOptimizer); "
                            "2 and gradients sharded (FSDP2, parameters kept from forward to backward); 3 everything "
                            "sharded (FSDP2)")
    sequence_parallel: bool = Field(False, description="with tp > 1: norms and the residual stream sharded over the "
                                    "sequence too")
    cpu_offload: bool = Field(False, description="zero_stage 2-3: parameters, gradients and optimizer states in host "
                              "memory (FSDP2's CPUOffloadPolicy)")
    gradient_accumulation: Literal["unsharded", "sharded"] = Field(
        "unsharded", description="zero_stage 2-3, how a rank's micro-batches add up their gradients. unsharded: "
        "whole gradients (in reduce_dtype) kept over the micro-batches and reduce-scattered once, after the last "
        "(a pipeline stage also stays gathered until then); sharded: every micro-batch's gradients reduce-scattered "
        "and added to the sharded ones (in host memory with cpu_offload), so no whole gradient outlives its "
        "micro-batch, for one reduce-scatter per micro-batch (engine=torch; not with pp_schedule=zero_bubble or "
        "uneven shares)")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="full: recompute each block in backward; selective: keep matmul and attention outputs, "
        "recompute element-wise ops")
    compile: bool = Field(False, description="torch.compile each repeated block (on CPU not with tp > 1)")
    ddp_comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="DDP gradient compression (zero_stage 0-1)")
    powersgd_rank: int = Field(1, gt=0, description="PowerSGD's approximation rank")
    powersgd_start_iter: int = Field(2, ge=2, description="the step PowerSGD starts compressing at")
    ddp_bucket_cap_mb: float = Field(25.0, gt=0, description="DistributedDataParallel's bucket_cap_mb")
    ddp_broadcast_buffers: bool = Field(False, description="DistributedDataParallel's broadcast_buffers")
    ddp_find_unused_parameters: bool = Field(False, description="DistributedDataParallel's find_unused_parameters")
    ddp_static_graph: bool = Field(False, description="DistributedDataParallel's static_graph (one micro-batch per "
                                   "rank: with gradient accumulation this torch's DDP fails an internal assert)")
    ddp_gradient_as_bucket_view: bool = Field(True, description="DistributedDataParallel's gradient_as_bucket_view")
    balance_weights: list[float] = Field(default_factory=list, description="one weight per data-parallel rank: "
                                         "uneven shares of the global batch in whole micro-batches (mixed GPU types, "
                                         "stragglers); []: equal" + DOC)
    balance: Literal["off", "auto"] = Field("off", description="auto: re-split the global batch by measured speed")
    balance_every: int = Field(20, gt=0, description="steps between re-splits under balance=auto")


class PrecisionConfig(Section):
    """Dtypes of the weights, the compute and the gradient reduction."""

    param_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp64"] = Field(
        "auto", description="zero_stage 2-3: the dtype FSDP2 gathers parameters in for compute (auto: bf16 on GPUs, "
        "fp32 on CPU); the fp32 shards stay the master weights. DDP keeps fp32")
    compute_dtype: Literal["fp32", "bf16", "fp16", "fp64"] = Field(
        "fp32", description="bf16 or fp16 autocast (fp16 with dynamic loss scaling, not with pp > 1), or fp64: "
        "everything in double precision, for debugging numerics")
    reduce_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp64"] = Field(
        "auto", description="the dtype gradients are reduced in under zero_stage 2-3; auto: fp64 when "
        "compute_dtype=fp64, else fp32")
    float8: Literal["off", "rowwise"] = Field(
        "off", description="rowwise: torchao's float8 matmuls (rowwise scales) in the Linear layers of the repeated "
        "blocks whose dimensions are multiples of 16, not routers or LoRA factors; needs fp32 or bf16 compute, "
        "engine=torch, and on CUDA a GPU of compute capability 8.9 or newer (H100, H200, L40, B200)")
