"""The planner against the dry run (disttrain.dryrun) over a grid of models, layouts, activation
checkpointing, micro-batches per rank and compute dtypes: one rank of a 32-rank job, seq 4096.

    python benchmarks/dryrun_vs_planner.py                         # the sampled grid, about an hour here
    python benchmarks/dryrun_vs_planner.py --sample full --models 1b   # every row of one model
    python benchmarks/dryrun_vs_planner.py --replan benchmarks/results/dryrun_vs_planner_grid.json

The full product (570 valid rows) would take days on 2 CPU cores, so by
default the grid is sampled: an all-pairs sample (every value of each factor meets every value of every
other factor in at least one row), chosen greedily by new pairs per estimated second, so that the cheap
models carry most rows. 70b is held to the layouts that shard its states (ZeRO-3, HSDP, TP, PP 1F1B) at 1 and 2
micro-batches per rank (4 for the pipeline): its other rows would each take 5 to 20 minutes here. Rows are written as they finish,
and a rerun with the same --out skips the rows already there. `--replan` recomputes the planner's side of
saved rows (the dry run's side does not depend on it) and prints the table and the error distribution.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import time
from pathlib import Path

GIB = 2 ** 30
RANKS = 32
MODELS = ("1b", "7b", "13b", "70b")
CHECKPOINTING = ("none", "selective", "full")
PER_RANK = (1, 2, 8)  # micro-batches per data-parallel rank (pipelines: 1F1B-like schedules need at least pp)
PIPELINE_PER_RANK = (4, 8)  # 1F1B, interleaved and zero-bubble: at least pp, a multiple of pp for the latter two
DTYPES = ("bf16", "fp32")
PP = 4


def _pp(schedule: str) -> list[str]:
    return ["parallel.dp_shard=8", f"parallel.pp={PP}", f"parallel.pp_schedule={schedule}", "parallel.zero_stage=2"]


LAYOUTS = {  # name -> overrides at 32 ranks
    "DDP": ["parallel.dp_shard=1", f"parallel.dp_replicate={RANKS}", "parallel.zero_stage=0"],
    "ZeRO-1": ["parallel.dp_shard=1", f"parallel.dp_replicate={RANKS}", "parallel.zero_stage=1"],
    "ZeRO-2": [f"parallel.dp_shard={RANKS}", "parallel.zero_stage=2"],
    "ZeRO-3": [f"parallel.dp_shard={RANKS}", "parallel.zero_stage=3"],
    "HSDP 4x8": ["parallel.dp_replicate=4", "parallel.dp_shard=8", "parallel.zero_stage=3"],
    "TP=8": ["parallel.dp_shard=4", "parallel.tp=8", "parallel.zero_stage=3"],
    "TP=8+SP": ["parallel.dp_shard=4", "parallel.tp=8", "parallel.sequence_parallel=true", "parallel.zero_stage=3"],
    "PP=4 gpipe": _pp("gpipe"),
    "PP=4 1f1b": _pp("1f1b"),
    "PP=4 interleaved": _pp("interleaved_1f1b"),
    "PP=4 zero_bubble": _pp("zero_bubble"),
}
LARGEST = ("ZeRO-3", "HSDP 4x8", "TP=8", "TP=8+SP", "PP=4 1f1b")  # 70b: the layouts that shard its states
# Seconds of one dry run here at two micro-batches per rank (measured: docs/benchmarks/dryrun.md), for the sampler.
_BASE_S = {"1b": 12, "7b": 35, "13b": 60, "70b": 130}


def dp_of(name: str) -> int:
    return RANKS // (8 if name.startswith("TP") else PP if name.startswith("PP") else 1)


def per_rank_values(model: str, name: str) -> tuple[int, ...]:
    """Micro-batches per rank a row may run: pipelines other than GPipe need at least pp of them (and the
    interleaved ones a multiple of pp); 70b runs 1 and 2 only (8 would quadruple its longest dry runs; what
    accumulation adds is measured on the smaller models)."""
    values = PIPELINE_PER_RANK if name.startswith("PP") and "gpipe" not in name else PER_RANK
    return tuple(v for v in values if v <= 4) if model == "70b" else values


def microbatches(name: str, per_rank: int) -> int:
    return per_rank


def config(model: str, name: str, checkpointing: str, per_rank: int, dtype: str, seq_len: int = 4096):
    from disttrain.config.load import load_config

    m = microbatches(name, per_rank)
    overrides = [f"model.name={model}", f"data.seq_len={seq_len}", "train.micro_batch_size=1",
                 f"train.global_batch_size={m * dp_of(name)}", f"parallel.activation_checkpointing={checkpointing}",
                 *LAYOUTS[name]]
    if name.startswith("PP"):
        overrides.append(f"parallel.pp_microbatches={m}")
    # bf16: autocast under DDP/ZeRO-1, FSDP2's parameter dtype otherwise; fp32: neither.
    sharded = "zero_stage=2" in " ".join(overrides) or "zero_stage=3" in " ".join(overrides)
    overrides.append(f"precision.param_dtype={dtype}" if sharded else f"precision.compute_dtype={dtype}")
    if sharded:
        overrides.append(f"precision.compute_dtype={dtype}")
    return load_config(None, overrides)


def key(row: dict) -> tuple:
    return row["model"], row["layout"], row["checkpointing"], row["per_rank"], row["dtype"]


def full_grid(models) -> list[tuple]:
    rows = []
    for model, name, ac, dtype in itertools.product(models, LAYOUTS, CHECKPOINTING, DTYPES):
        if model == "70b" and name not in LARGEST or ("zero_bubble" in name and ac != "none"):
            continue  # zero-bubble's split backward refuses activation checkpointing (a layout rule)
        rows += [(model, name, ac, per_rank, dtype) for per_rank in per_rank_values(model, name)]
    return rows


def cost_s(row: tuple) -> float:
    model, name, ac, per_rank, dtype = row
    passes = (1 + microbatches(name, per_rank)) / 3  # two steps of m micro-batches, plus set-up
    wrapper = 3.0 if name in ("DDP", "ZeRO-1") else 1.0  # measured: MemTracker's DDP path is slower
    ranks = 0.75 if name.startswith("PP") else 1.0  # three simulated ranks of a quarter of the layers
    return _BASE_S[model] * wrapper * ranks * passes * (2.0 if name.startswith("PP") else 1.0)


def pairwise_sample(models) -> list[tuple]:
    """Every pair of factor values (model x layout, layout x checkpointing, checkpointing x dtype, ...) that
    occurs in the full grid occurs in some sampled row. Greedy: the next row covers the most uncovered pairs
    per estimated second; ties go to the earlier row of the full grid, so the sample is deterministic."""
    candidates = full_grid(models)

    def pairs(row):
        return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(5), 2)}

    uncovered = set().union(*(pairs(r) for r in candidates))
    chosen = []
    while uncovered:
        best = max(candidates, key=lambda r: (len(pairs(r) & uncovered) / cost_s(r), -candidates.index(r)))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def issue_rows() -> list[tuple]:
    """13b ZeRO-3 at one micro-batch per rank, each checkpointing mode: the rows the grid began from."""
    return [("13b", "ZeRO-3", ac, 1, "bf16") for ac in CHECKPOINTING]


def planner_side(row: dict) -> dict:
    """The planner's total and categories for the simulated rank that peaked."""
    from disttrain.cli.dryrun import pp_rank_of
    from disttrain.plan.memory import estimate_memory
    from disttrain.config.resolve import resolve_run

    cfg = config(row["model"], row["layout"], row["checkpointing"], row["per_rank"], row["dtype"], row["seq_len"])
    resolved = resolve_run(cfg, RANKS, "cuda")
    worst = max(row["per_rank_runs"], key=lambda r: r["peak_bytes"])
    planned = estimate_memory(resolved.shape, resolved.layout, pp_rank=pp_rank_of(resolved.layout, worst["rank"]))
    return {**{k: float(v) for k, v in planned.categories().items()}, "peak_bytes": float(planned.total)}


def errors(row: dict) -> dict:
    """Planner / dry run - 1 for the peak and for each category of at least 1 GiB (smaller ones: None)."""
    out = {"peak_bytes": row["planner"]["peak_bytes"] / row["peak_bytes"] - 1}
    for k, measured in row["bytes"].items():
        out[k] = row["planner"][k] / measured - 1 if measured >= GIB else None
    return out


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | layout | checkpointing | micro-batches per rank | dtype | dry run (GiB) | planner (GiB) | error "
             "| worst category (>= 1 GiB) | dry-run time |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        err = errors(row)
        cats = {k: v for k, v in err.items() if k != "peak_bytes" and v is not None}
        worst = max(cats, key=lambda k: abs(cats[k])) if cats else None
        lines.append(f"| {row['model']} | {row['layout']} | {row['checkpointing']} | {row['microbatches']} | "
                     f"{row['dtype']} | {row['peak_bytes'] / GIB:.2f} | {row['planner']['peak_bytes'] / GIB:.2f} | "
                     f"{err['peak_bytes']:+.1%} | {f'{worst} {cats[worst]:+.1%}' if worst else '-'} | "
                     f"{row['seconds']:.0f} s |")
    return lines


def distribution(rows: list[dict]) -> list[str]:
    peak = [errors(r)["peak_bytes"] for r in rows]
    cats = [(v, r, k) for r in rows for k, v in errors(r).items() if k != "peak_bytes" and v is not None]
    worst = max(rows, key=lambda r: abs(errors(r)["peak_bytes"]))
    worst_cat = max(cats, key=lambda c: abs(c[0])) if cats else None
    lines = [f"rows: {len(rows)}; peak error: median {statistics.median(peak):+.1%}, median |error| "
             f"{statistics.median(abs(e) for e in peak):.1%}, within ±5%: {sum(abs(e) <= 0.05 for e in peak)}/{len(rows)}; "
             f"worst row {worst['model']} {worst['layout']} {worst['checkpointing']} m={worst['microbatches']} "
             f"{worst['dtype']}: {errors(worst)['peak_bytes']:+.1%}"]
    if worst_cat:
        v, r, k = worst_cat
        lines.append(f"categories of at least 1 GiB: {len(cats)}, within ±10%: {sum(abs(c[0]) <= 0.10 for c in cats)}; "
                     f"worst {k} of {r['model']} {r['layout']} {r['checkpointing']} m={r['microbatches']} "
                     f"{r['dtype']}: {v:+.1%}")
    lines.append(f"dry-run time: {sum(r['seconds'] for r in rows) / 60:.0f} min in all")
    return lines


def run_row(spec: tuple, seq_len: int) -> dict:
    from disttrain.cli.dryrun import dry_run

    model, name, ac, per_rank, dtype = spec
    cfg = config(model, name, ac, per_rank, dtype, seq_len)
    t0 = time.perf_counter()
    result = dry_run(cfg, RANKS)
    row = {"model": model, "layout": name, "checkpointing": ac, "per_rank": per_rank, "dtype": dtype,
           "microbatches": microbatches(name, per_rank), "seq_len": seq_len,
           "seconds": round(time.perf_counter() - t0, 1), "peak_bytes": result["peak_bytes"],
           "bytes": result["bytes"], "per_rank_runs": [{k: r[k] for k in ("rank", "role", "peak_bytes", "bytes")}
                                                      for r in result["ranks"]],
           "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    row["planner"] = planner_side(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sample", choices=("pairwise", "full"), default="pairwise")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/dryrun_vs_planner_grid.json")
    parser.add_argument("--list", action="store_true", help="print the rows and their estimated time, run nothing")
    parser.add_argument("--replan", default=None, help="a results file: recompute its planner side only")
    parser.add_argument("--rerun", action="append", default=[],
                        help="measure this row again (model,layout,checkpointing,per_rank,dtype; repeatable), then stop")
    args = parser.parse_args()
    if args.replan:
        data = json.loads(Path(args.replan).read_text())
        for row in data["rows"]:
            row["planner"] = planner_side(row)
        Path(args.replan).write_text(json.dumps(data, indent=1))
        print("\n".join(table(data["rows"]) + [""] + distribution(data["rows"])))
        return
    if args.rerun:
        out = Path(args.out)
        data = json.loads(out.read_text())
        for text in args.rerun:
            model, name, ac, per_rank, dtype = text.split(",")
            spec = (model, name, ac, int(per_rank), dtype)
            row = run_row(spec, args.seq_len)
            data["rows"] = [r for r in data["rows"] if key(r) != spec or r["seq_len"] != args.seq_len] + [row]
            out.write_text(json.dumps(data, indent=1))
            print(table([row])[-1], flush=True)
        return
    models = args.models.split(",")
    specs = full_grid(models) if args.sample == "full" else pairwise_sample(models)
    specs += [r for r in issue_rows() if r not in specs and r[0] in models]
    specs.sort(key=cost_s)
    if args.list:
        for s in specs:
            print(f"{cost_s(s):6.0f} s  {s}")
        print(f"{len(specs)} rows, about {sum(map(cost_s, specs)) / 60:.0f} min")
        return
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"ranks": RANKS, "rows": []}
    done = {key(r) for r in data["rows"] if r["seq_len"] == args.seq_len}
    for spec in specs:
        if spec in done:
            continue
        row = run_row(spec, args.seq_len)
        data["rows"].append(row)
        data["date"] = time.strftime("%Y-%m-%d")
        out.write_text(json.dumps(data, indent=1))
        print(table([row])[-1], flush=True)
    print("\n".join(distribution(data["rows"])))


if __name__ == "__main__":
    main()
