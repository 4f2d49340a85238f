"""The rules that make a Layout valid for a model, each returning typed `Problem`s (the planner reads their
`key`, users their message): `cut_problems` hold whatever the world size, `batch_problems` need the
data-parallel size. Expert parallelism, context parallelism and uneven shares have their own families beside
this file. `shape` is the model's ModelShape (models/shape.py), or None when its dimensions are unknown.
Pure Python."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.layout.balance_rules import balance_batch_problems, balance_cut_problems
from disttrain.layout.context_rules import cp_problems
from disttrain.layout.expert_rules import expert_batch_problems, expert_problems
from disttrain.layout.layout import MULTI_STAGE_SCHEDULES, RECOMPUTE, SCHEDULES, Layout
from disttrain.layout.problem import Problem

if TYPE_CHECKING:  # the shape is read, never built, here
    from disttrain.models.shape import ModelShape


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
        linear = shape.extras.linear if shape.extras is not None else None
        global_kv = shape.extras.global_kv_heads if shape.extras is not None else 0  # Gemma 4's full-attention layers
        if global_kv % tp:
            problems.append(Problem("parallel.tp", tp, f"a divisor of num_global_key_value_heads={global_kv}",
                                    f"parallel.tp={tp} does not divide the full-attention layers' key-value heads "
                                    f"(num_global_key_value_heads={global_kv})"))
        if linear is not None and linear.num_key_heads % tp:  # Gated DeltaNet layers split by key heads
            problems.append(Problem("parallel.tp", tp, f"a divisor of linear_num_key_heads={linear.num_key_heads}",
                                    f"parallel.tp={tp} does not divide the linear-attention heads "
                                    f"(linear_num_key_heads={linear.num_key_heads})"))
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
    if lay.pp > 1 and lay.pp_schedule == "zero_bubble" and lay.reshard_after_forward and lay.engine == "torch":
        # torch's input-gradient pass looks for the stage's weights among its modules' parameters, and ZeRO-3 leaves
        # the sharded ones there after each forward: the weight pass of a micro-batch whose input-gradient pass came
        # after a forward of its stage computes nothing (tiny, pp=2: grad norm 8.52 where every other layout has 12.62).
        problems.append(Problem("parallel.zero_stage", 3, "0, 1 or 2 with zero_bubble", "parallel.zero_stage=3 with "
                                "parallel.pp_schedule=zero_bubble: the weight-gradient passes miss parameters ZeRO-3 "
                                "resharded after a forward, so some micro-batches' weight gradients are never "
                                "computed (allowed with zero_bubble: zero_stage 0, 1 or 2; or another pp_schedule)"))
    problems += expert_problems(shape, lay)
    if lay.cp > 1:
        problems += cp_problems(shape, lay)
    if lay.engine == "deepspeed":
        problems += _deepspeed_problems(lay)
    if lay.balanced:
        problems += balance_cut_problems(lay)
    if lay.cpu_offload and lay.zero_stage < 2:
        problems.append(Problem("parallel.cpu_offload", True, "false with zero_stage 0 or 1", "parallel.cpu_offload="
                                f"true needs parallel.zero_stage 2 or 3 (FSDP2), not {lay.zero_stage}"))
    problems += accumulation_problems(lay)
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


def accumulation_problems(layout: Layout) -> list[Problem]:
    """Where FSDP2's reduce-scatter every micro-batch cannot apply: DDP and ZeRO-1 hold whole gradients whatever
    the reduction; DeepSpeed reduces by its own rules; zero-bubble's input-gradient pass runs FSDP's post-backward
    before the weight pass made the gradients; uneven shares give ranks different numbers of reduce-scatters."""
    mode = layout.gradient_accumulation
    if mode == "unsharded":
        return []
    key = f"parallel.gradient_accumulation={mode}"  # the config's schema allows unsharded and sharded only
    if layout.engine != "torch":
        return [Problem("parallel.gradient_accumulation", mode, "unsharded with engine=deepspeed", f"{key} needs "
                        f"engine=torch, not {layout.engine} (allowed with engine={layout.engine}: unsharded)")]
    if layout.zero_stage < 2:
        return [Problem("parallel.gradient_accumulation", mode, "unsharded with zero_stage 0 or 1", f"{key} needs "
                        f"parallel.zero_stage 2 or 3 (FSDP2), not {layout.zero_stage}: DDP and ZeRO-1 keep whole "
                        "gradients either way (allowed with zero_stage 0 or 1: unsharded)")]
    if layout.pp > 1 and layout.pp_schedule == "zero_bubble":
        return [Problem("parallel.gradient_accumulation", mode, "unsharded with zero_bubble", f"{key} with "
                        "parallel.pp_schedule=zero_bubble: its input-gradient pass would reduce-scatter before the "
                        "weight pass made the gradients (allowed with zero_bubble: unsharded; or another pp_schedule)")]
    if layout.balanced:
        return [Problem("parallel.gradient_accumulation", mode, "unsharded with uneven shares", f"{key} with uneven "
                        "shares (parallel.balance or balance_weights): ranks running different numbers of "
                        "micro-batches would issue different numbers of reduce-scatters (allowed with uneven shares: "
                        "unsharded)")]
    return []


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
