"""Metrics overhead: the same training run with every sink on (console, metrics.jsonl, TensorBoard,
Prometheus on every rank, logging every step, replica check every 10 steps) and with all of them off
(no logging steps, no jsonl, no sync check). 2 processes, start-up removed and interleaved as in
overhead.py.

    python benchmarks/metrics_overhead.py --reps 3 --short 10 --long 210
"""

from __future__ import annotations

import argparse

from overhead import REPO, add_common_args, disttrain_command, interleaved, print_table, summarize, write_results

VARIANTS = {
    "sinks off": ["metrics.log_every=0", "metrics.jsonl=false", "metrics.sync_check_every=0",
                  "metrics.comm_profile_every=0"],
    "all sinks on": ["metrics.log_every=1", "metrics.jsonl=true", "metrics.tensorboard=true",
                     "metrics.prometheus_port=29650", "metrics.sync_check_every=10",
                     "metrics.comm_profile_every=200"],  # the default: run with --long 210 to include one
}


def main() -> None:
    parser = argparse.ArgumentParser()
    add_common_args(parser, "metrics_overhead.json")
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-metrics"
    results = interleaved(list(VARIANTS), lambda name, steps: disttrain_command(VARIANTS[name], steps, run_dir),
                          args.reps, args.short, args.long)
    summary = summarize(results, "sinks off")
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})
    print_table(summary, "sinks off")


if __name__ == "__main__":
    main()
