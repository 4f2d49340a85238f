"""Tensor and pipeline parallelism on this machine (2 processes, gloo):
1. measured pipeline bubble of each schedule (pp=2, several micro-batch counts) next to theory;
2. throughput of tp=2, tp=2 + sequence parallel and pp=2 against DDP, interleaved as in overhead.py;
3. parameter bytes per rank of each layout (measured with disttrain.bench.model_states).

    python benchmarks/model_parallel.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from overhead import REPO, add_common_args, disttrain_command, interleaved, print_table, summarize, write_results

from disttrain.bench.model_states import launch
from disttrain.plan.timing import bubble_fraction

VARIANTS = {
    "ddp": [],
    "tp=2": ["parallel.tp=2"],
    "tp=2+sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp=2 1f1b": ["parallel.pp=2"],  # global 16, micro-batch 4 -> 4 pipeline micro-batches
}
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


def bubble(schedule: str, microbatches: int, steps: int, run_dir: Path) -> float:
    """Median measured pp_bubble over steps 2.. of one run with equal-cost stages (tiny: 4 equal
    blocks; the embedding lookup and the 256-word output layer are small next to a block)."""
    name = f"bubble-{schedule}-{microbatches}"
    cmd = [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "bench.yaml"), f"train.steps={steps}",
           f"run.dir={run_dir}", f"run.name={name}", "metrics.log_every=1", "data.seq_len=256",
           f"train.global_batch_size={2 * microbatches}", "train.micro_batch_size=2", "parallel.pp=2",
           f"parallel.pp_schedule={schedule}", "--nproc-per-node", "2"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    records = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["pp_bubble"] for r in records if "pp_bubble" in r and r["step"] > 1)


def param_bytes(overrides: list[str], run_dir: Path) -> list[int]:
    return [r["params"] for r in launch(2, run_dir, stages=[0], overrides=overrides)]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_common_args(parser, "model_parallel.json")
    parser.add_argument("--bubble-steps", type=int, default=12)
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-model-parallel"

    print("Measured pipeline bubble, pp=2, tiny, micro-batches of 2 x 256 tokens (median over steps 2..):\n")
    print("| schedule | micro-batches | theory | measured (reps) |\n|---|---|---|---|")
    bubbles = []
    for m in (2, 4, 8):
        for schedule in SCHEDULES:
            if schedule in ("interleaved_1f1b", "zero_bubble") and m % 2:
                continue
            v = 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
            measured = [bubble(schedule, m, args.bubble_steps, run_dir) for _ in range(args.reps)]
            theory = bubble_fraction(schedule, 2, m, v)
            bubbles.append({"schedule": schedule, "microbatches": m, "theory": theory, "measured": measured})
            print(f"| {schedule} | {m} | {theory:.1%} | {statistics.median(measured):.1%} "
                  f"({', '.join(f'{x:.1%}' for x in measured)}) |", flush=True)

    print("\nParameter bytes per rank (tiny, fp32; rank 0, rank 1):")
    memory = {}
    for name, overrides in VARIANTS.items():
        memory[name] = param_bytes(overrides, run_dir)
        print(f"  {name:>10}: {', '.join(f'{b / 2**20:.2f} MiB' for b in memory[name])}", flush=True)

    results = interleaved(list(VARIANTS), lambda name, steps: disttrain_command(VARIANTS[name], steps, run_dir),
                          args.reps, args.short, args.long)
    summary = summarize(results, "ddp")
    write_results(args.out, {"args": vars(args), "bubbles": bubbles, "param_bytes": memory, "runs": results,
                             "summary": summary})
    print_table(summary, "ddp")


if __name__ == "__main__":
    main()
