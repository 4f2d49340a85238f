"""The planner against the dry run (disttrain.dryrun) at cluster scale: peak bytes and each category
for one rank of a 32-rank job, and how long each dry run takes on this machine.

    python benchmarks/dryrun_vs_planner.py --models 1b,7b,13b,70b --out benchmarks/results/dryrun_vs_planner.json

Each row's time is the whole `dry_run` (every simulated rank: 3 pipeline ranks for PP=4).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from disttrain.cli.dryrun import dry_run
from disttrain.config import load_config

LAYOUTS = {  # name -> (overrides, data-parallel ranks at 32); bf16 compute (autocast under DDP, FSDP2's policy)
    "DDP": (["parallel.dp_shard=1", "parallel.dp_replicate=32", "parallel.zero_stage=0", "precision.compute_dtype=bf16"], 32),
    "ZeRO-1": (["parallel.dp_shard=1", "parallel.dp_replicate=32", "parallel.zero_stage=1", "precision.compute_dtype=bf16"], 32),
    "ZeRO-2": (["parallel.dp_shard=32", "parallel.zero_stage=2", "precision.param_dtype=bf16"], 32),
    "ZeRO-3": (["parallel.dp_shard=32", "parallel.zero_stage=3", "precision.param_dtype=bf16"], 32),
    "TP=8 + ZeRO-3": (["parallel.dp_shard=4", "parallel.tp=8", "parallel.zero_stage=3", "precision.param_dtype=bf16"], 4),
    "PP=4 (1F1B) + ZeRO-2": (["parallel.dp_shard=8", "parallel.pp=4", "parallel.zero_stage=2", "precision.param_dtype=bf16",
                              "parallel.pp_microbatches=8"], 8),
}


def config(model: str, name: str, seq_len: int):
    overrides, dp = LAYOUTS[name]
    # two micro-batches of one sequence per rank (accumulation is part of what is measured); 8 = 2 x pp
    # for the pipeline, where 1F1B's peak is reached
    per_rank = 8 if "pp_microbatches=8" in " ".join(overrides) else 2
    return load_config(None, [f"model.name={model}", f"data.seq_len={seq_len}", "train.micro_batch_size=1",
                              f"train.global_batch_size={per_rank * dp}",
                              "parallel.activation_checkpointing=selective", *overrides])


def replan(path: str) -> None:
    """Recompute the planner's side of saved rows with the current planner (the dry-run side does not
    depend on it) and print the markdown table."""
    from disttrain.cli.dryrun import default_ranks, pp_rank_of
    from disttrain.plan.memory import estimate_memory
    from disttrain.resolve import resolve_run

    data = json.loads(Path(path).read_text())
    for row in data["rows"]:
        cfg = config(row["model"], row["layout"], data["seq_len"])
        resolved = resolve_run(cfg, data["ranks"], "cuda")
        layout = resolved.layout
        worst = max(row["per_rank"], key=lambda r: r["peak_bytes"])
        planned = estimate_memory(resolved.shape, layout, pp_rank=pp_rank_of(layout, worst["rank"]))
        row["planner_peak_bytes"] = planned.total
        row["replanned"] = True
        err = planned.total / row["peak_bytes"] - 1
        print(f"| {row['model']} | {row['layout']} | {row['peak_bytes'] / 2**30:.2f} | {planned.total / 2**30:.2f} | "
              f"{err:+.1%} | {row['seconds']:.0f} s | {row['max_rss_bytes'] / 2**30:.2f} |")
    Path(path).write_text(json.dumps(data, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b,7b,13b,70b")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/dryrun_vs_planner.json")
    parser.add_argument("--replan", default=None, help="a results file: recompute its planner side only")
    args = parser.parse_args()
    if args.replan:
        return replan(args.replan)
    rows = []
    for model in args.models.split(","):
        for name in args.layouts.split(","):
            cfg = config(model, name, args.seq_len)
            t0 = time.perf_counter()
            result = dry_run(cfg, 32, gpu_name="a100-80g")
            row = {"model": model, "layout": name, "seconds": round(time.perf_counter() - t0, 1),
                   "ranks_simulated": [r["rank"] for r in result["ranks"]],
                   "peak_bytes": result["peak_bytes"], "planner_peak_bytes": result["planner"]["peak_bytes"],
                   "bytes": result["bytes"], "planner": result["planner"], "error": result["error"],
                   "per_rank": [{k: r[k] for k in ("rank", "role", "peak_bytes", "bytes", "planner", "seconds")}
                                for r in result["ranks"]], "fits_a100_80g": result["fits"],
                   "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            rows.append(row)
            print(f"| {model} | {name} | {row['peak_bytes'] / 2**30:.2f} | {row['planner_peak_bytes'] / 2**30:.2f} | "
                  f"{result['error']['peak_bytes']:+.1%} | {row['seconds']:.0f} s | "
                  f"{row['max_rss_bytes'] / 2**30:.2f} |", flush=True)
            Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "seq_len": args.seq_len,
                                                  "ranks": 32, "rows": rows}, indent=1))
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "seq_len": args.seq_len, "ranks": 32,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
