"""Layout search: enumerate what the runtime can run, drop what does not fit, rank by tokens/s.

Every micro-batch size of every family is estimated (pure Python, cheap): memory is not monotonic in the
size (a GPipe rank holds each in-flight micro-batch's loss-head gradients, fewer and larger ones hold less;
one micro-batch a step holds no gradient before its backward), so stopping at the first size that does not
fit would lose layouts (tests/test_plan.py).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Iterator

from disttrain.core.errors import UserError
from disttrain.models.registry import ModelShape
from disttrain.plan.context import cp_degrees
from disttrain.plan.estimate import Estimate, estimate
from disttrain.plan.objective import ObjectiveTerms
from disttrain.layout.layout import RECOMPUTE, SCHEDULES, VIRTUAL_STAGES, Layout
from disttrain.layout.rules import layout_problems
from disttrain.plan.timing import Cluster, single_gpu_tokens_per_s


MICRO_BATCH_KEYS = ("train.micro_batch_size", "parallel.pp_microbatches")  # rules the micro-batch size can fix


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    seq_len: int
    global_batch_size: int
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    schedules: tuple[str, ...] = SCHEDULES
    max_micro_batch_size: int = 64
    allow_offload: bool = False
    param_dtype: str = "bf16"
    virtual_stages: int = VIRTUAL_STAGES
    lora_rank: int = 0  # > 0: LoRA adapters on a frozen base
    ep: tuple[int, ...] | None = None  # expert-parallel degrees to try (None: every one that divides; plan/moe.py)
    routing_skew: float = 1.0  # MoE: the busiest expert-parallel rank's load over a balanced one
    optimizer: str = "adamw"  # or muon: one moment for the block matrices (train/muon.py)
    state_dtype: str = "fp32"  # optim.state_dtype: bf16 moments take half the bytes
    context_parallel: bool = True  # False: the model cannot shard its sequence (cp = 1; models/hf/published.py)
    pipeline_sequence_parallel: bool = True  # False: sequence parallelism only without a pipeline (transformers')
    pipeline_context_parallel: bool = True  # False: context parallelism only without a pipeline (transformers')
    objective: ObjectiveTerms = ObjectiveTerms()  # train.objective's pairs and frozen model (plan/objective.py)


def expert_degrees(shape: ModelShape, dp_shard: int, space: SearchSpace) -> list[int]:
    """`parallel.ep` values to try: 1 for a dense model, else the divisors of both num_experts and `dp_shard`
    (pass dp_shard x cp: the runtime splits it into efsdp x ep); the layout rules drop what ep does not compose
    with."""
    if shape.moe is None:
        return [1]
    return [d for d in divisors(dp_shard) if shape.moe.num_experts % d == 0 and (space.ep is None or d in space.ep)]


def layout_families(shape: ModelShape, cluster: Cluster, space: SearchSpace) -> Iterator[Layout]:
    """Every valid layout except the micro-batch size (left at 1)."""
    gpus, gpn = cluster.gpus, cluster.gpus_per_node
    tps = divisors(min(gpn, gpus))
    for tp, cp in ((t, c) for t in tps if gpus % t == 0
                   for c in (cp_degrees(space.seq_len, gpus // t) if space.context_parallel else [1])):
        for pp in divisors(gpus // (tp * cp)):
            if pp > 1 and cp > 1 and not space.pipeline_context_parallel:
                continue
            dp = gpus // (tp * pp * cp)
            schedules = space.schedules if pp > 1 else ("1f1b",)
            for stage in space.zero_stages:
                replicas = divisors(dp) if stage >= 2 else [1]
                offloads = (False, True) if space.allow_offload and stage >= 2 else (False,)
                if stage and dp * cp == 1:  # sharding over one rank changes nothing, unless it offloads
                    offloads = tuple(o for o in offloads if o)
                degrees = [(dr, ep) for dr in replicas
                           for ep in expert_degrees(shape, dp // dr * cp, space)]
                for (dr, ep), schedule, sp, ac, offload in itertools.product(
                        degrees, schedules, sequence_parallel(tp, pp, space), space.recompute, offloads):
                    layout = Layout(dp_replicate=dr, dp_shard=dp // dr, tp=tp, pp=pp, cp=cp, zero_stage=stage,
                                    micro_batch_size=1, seq_len=space.seq_len,
                                    global_batch_size=space.global_batch_size, pp_schedule=schedule,
                                    virtual_stages=space.virtual_stages, sequence_parallel=sp,
                                    activation_checkpointing=ac, param_dtype=space.param_dtype,
                                    compute_dtype=space.param_dtype, cpu_offload=offload, ep=ep)
                    # Validity that does not depend on the micro-batch size:
                    if any(p.key not in MICRO_BATCH_KEYS for p in layout_problems(shape, layout)):
                        continue
                    yield layout


def sequence_parallel(tp: int, pp: int, space: SearchSpace) -> tuple[bool, ...]:
    if tp == 1:
        return (False,)
    return (False, True) if pp == 1 or space.pipeline_sequence_parallel else (False,)


def micro_batch_sizes(layout: Layout, space: SearchSpace) -> list[int]:
    per_rank = layout.sequences_per_rank
    return [b for b in divisors(per_rank) if b <= space.max_micro_batch_size]


def reduced_every_microbatch(shape: ModelShape, layout: Layout) -> Layout | None:
    """The layout with `parallel.gradient_accumulation=sharded`, where that changes what a rank holds (ZeRO-2/3
    accumulating over micro-batches, or a pipeline's deferred reduction) and the rules take it; else None. It is
    never faster (a reduce-scatter per micro-batch), so the search tries it only where the default does not fit."""
    if layout.zero_stage < 2 or (layout.microbatches == 1 and layout.pp == 1):
        return None
    sharded = layout.replace(gradient_accumulation="sharded")
    return None if layout_problems(shape, sharded) else sharded


@dataclass
class SearchResult:
    ranked: list[Estimate]  # fitting layouts, fastest first
    considered: int
    fitting: int
    budget_bytes: float
    rejected_examples: list[str] = field(default_factory=list)


def memory_budget(gpu_memory_bytes: float, headroom: float = 0.1) -> float:
    """Bytes a rank may use: the GPU's memory less the fraction kept free (the CUDA context, the caching
    allocator's fragmentation, NCCL's buffers). Every fits / does-not-fit answer uses this one budget."""
    return gpu_memory_bytes * (1 - headroom)


def fits(est: Estimate, budget: float) -> bool:
    return est.memory.total <= budget


def drop_disproved(result: SearchResult, measured: dict[int, float]) -> SearchResult:
    """The ranking without the layouts whose measured peak (`measured`: index in `result.ranked` -> bytes,
    from dry runs) exceeds the budget: a layout a dry run disproved is neither ranked nor compared with."""
    kept = [e for i, e in enumerate(result.ranked) if measured.get(i, 0.0) <= result.budget_bytes]
    dropped = len(result.ranked) - len(kept)
    return SearchResult(kept, result.considered, result.fitting - dropped, result.budget_bytes,
                        result.rejected_examples)


def search(shape: ModelShape, cluster: Cluster, space: SearchSpace, headroom: float = 0.1,
           model: str = "custom") -> SearchResult:
    budget = memory_budget(cluster.gpu.memory_bytes, headroom)
    ranked, considered = [], 0

    def estimated(layout: Layout) -> Estimate:
        return estimate(shape, layout, cluster, model=model, lora_rank=space.lora_rank,
                        routing_skew=space.routing_skew, muon=space.optimizer == "muon",
                        state_dtype=space.state_dtype, objective=space.objective)

    for family in layout_families(shape, cluster, space):
        for mbs in micro_batch_sizes(family, space):
            layout = family.replace(micro_batch_size=mbs)
            if layout_problems(shape, layout):
                continue
            considered += 1
            est = estimated(layout)
            if not fits(est, budget) and (sharded := reduced_every_microbatch(shape, layout)) is not None:
                # whole gradients kept over the micro-batches do not fit: reduce-scatter each micro-batch's
                considered += 1
                est = estimated(sharded)
            if fits(est, budget):
                ranked.append(est)
    ranked.sort(key=lambda e: (-e.time.tokens_per_s, e.memory.total))
    return SearchResult(ranked, considered, len(ranked), budget)


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BINARY = {"k": 2 ** 10, "m": 2 ** 20, "b": 2 ** 30, "g": 2 ** 30, "t": 2 ** 40}


def parse_count(flag: str, text: str, binary: bool = False) -> float:
    """'4M', '300e9', '1.5T', '13b' -> a number. Suffixes are decimal, or powers of two with
    `binary` (batch sizes: Llama's "4M tokens" is 1024 x 4096 = 4·2^20)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if not match:
        raise UserError(f"{flag}={text}: expected a number like 4M, 300e9 or 1.5T")
    return float(match.group(1)) * (_BINARY if binary else _SUFFIX).get(match.group(2), 1)


def gpu_memory(gpu: str, hardware: str | None = None) -> tuple[str, float]:
    """The GPU `--gpu` (or a `--hardware` profile) names, and its memory in bytes."""
    from disttrain.core.gpus import find_gpu

    if hardware:
        from disttrain.plan.profile import load_profile

        profile = load_profile(hardware)
        return f"profile:{profile.get('host', '?')}", profile["memory_gb_per_rank"] * 1e9
    try:
        found = find_gpu(gpu)
    except KeyError as exc:
        raise UserError(f"--gpu={exc.args[0]}") from None
    return found.name, found.memory_bytes


def global_batch(sequences: int | None, tokens: str | None, seq_len: int) -> int:
    """Sequences per step from `--global-batch-size` or `--global-batch-tokens` (default 4M tokens)."""
    if sequences and tokens:
        raise UserError("--global-batch-size and --global-batch-tokens: give one of them")
    if sequences:
        return sequences
    return max(1, round(parse_count("--global-batch-tokens", tokens or "4M", binary=True) / seq_len))


def parse_counts(text: str | None) -> list[int]:
    """`--scaling 2,4,8` -> [2, 4, 8]."""
    if not text:
        return []
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--scaling={text}: expected comma-separated GPU counts like 2,4,8,16,32") from None
    if any(c < 1 for c in counts):
        raise UserError(f"--scaling={text}: GPU counts must be positive")
    return counts


def why_winner(result: SearchResult) -> list[str]:
    """Plain reasons: what the winner avoids that the runners-up pay for."""
    if not result.ranked:
        return []
    win = result.ranked[0]
    wt = win.time
    lines = [f"{result.considered} layouts considered, {result.fitting} fit in "
             f"{result.budget_bytes / 2**30:.1f} GiB per GPU; the winner needs {win.memory.total / 2**30:.1f} GiB."]
    shown = 0
    seen = {win.layout.describe(micro_batch=True)}
    for other in result.ranked[1:]:
        key = other.layout.describe(micro_batch=True)
        if key in seen:
            continue
        seen.add(key)
        ot = other.time
        diffs = {"exposed data-parallel communication": ot.dp_exposed_s - wt.dp_exposed_s,
                 "tensor-parallel communication": ot.tp_comm_s - wt.tp_comm_s,
                 "pipeline bubble": ot.bubble_s - wt.bubble_s,
                 "pipeline transfers": ot.pp_comm_s - wt.pp_comm_s,
                 "expert all-to-all": ot.ep_comm_s - wt.ep_comm_s,
                 "compute (recomputation, efficiency)": ot.compute_s - wt.compute_s}
        cause, delta = max(diffs.items(), key=lambda kv: kv[1])
        gain = wt.tokens_per_s / ot.tokens_per_s - 1
        if delta * 1e3 < 0.5:
            saved = (other.memory.total - win.memory.total) / 2**30
            lines.append(f"as fast as [{key}] but needs {saved:.1f} GiB less per GPU.")
        else:
            lines.append(f"{gain:+.1%} over [{key}], which spends {delta * 1e3:.0f} ms more per step on {cause}.")
        shown += 1
        if shown == 3:
            break
    return lines


def scaling_table(shape: ModelShape, space: SearchSpace, headroom: float, name: str,
                  clusters: dict[int, Cluster]) -> list[dict]:
    """Best layout per GPU count (`clusters`: count -> its cluster) at the same global batch, with efficiency
    against one GPU."""
    rows = []
    for gpus, cluster in clusters.items():
        if space.global_batch_size % gpus and space.global_batch_size < gpus:
            continue
        result = search(shape, cluster, space, headroom, name)
        base = single_gpu_tokens_per_s(shape, space.seq_len, cluster, space.param_dtype)
        if result.ranked:
            best = result.ranked[0]
            rows.append({"gpus": gpus, "tokens_per_s": best.time.tokens_per_s,
                         "tokens_per_s_per_gpu": best.time.tokens_per_s_per_gpu,
                         "efficiency": best.time.tokens_per_s_per_gpu / base,
                         "layout": best.layout.describe(micro_batch=True)})
        else:
            rows.append({"gpus": gpus, "tokens_per_s": None, "tokens_per_s_per_gpu": None, "efficiency": None,
                         "layout": "does not fit"})
    return rows
