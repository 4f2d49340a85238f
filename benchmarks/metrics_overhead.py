"""Metrics overhead: the same training run with every sink on (console, metrics.jsonl, TensorBoard,
Prometheus on every rank, logging every step, replica check every 10 steps) and with all of them off
(no logging steps, no jsonl, no sync check). 2 processes, start-up removed and interleaved as in
overhead.py.

    python benchmarks/metrics_overhead.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from overhead import REPO, print_table, steady_state, summarize

VARIANTS = {
    "sinks off": ["metrics.log_every=0", "metrics.jsonl=false", "metrics.sync_check_every=0"],
    "all sinks on": ["metrics.log_every=1", "metrics.jsonl=true", "metrics.tensorboard=true",
                     "metrics.prometheus_port=29650", "metrics.sync_check_every=10"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=60)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "metrics_overhead.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-metrics"
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for rep in range(args.reps):
        for name in names[rep % 2:] + names[:rep % 2]:
            cmd = lambda steps: [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "bench.yaml"),  # noqa: E731
                                 f"train.steps={steps}", f"run.dir={run_dir}", *VARIANTS[name], "--nproc-per-node", "2"]
            row = steady_state(cmd, args.short, args.long)
            results[name].append(row)
            print(f"rep {rep + 1}/{args.reps} {name:>13}: {row['tokens_per_s']:8.0f} tok/s", flush=True)
    summary = summarize(results, "sinks off")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": results, "summary": summary}, indent=2))
    print_table(summary, "sinks off")


if __name__ == "__main__":
    main()
