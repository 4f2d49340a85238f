"""ZeRO stages on this machine: per-rank model-state bytes (1, 2, 4 ranks) next to the ZeRO formulas,
and throughput of each stage against DDP (2 ranks, interleaved, start-up removed as in overhead.py).

    python benchmarks/zero.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import re
import os
import subprocess
import sys
from pathlib import Path

from overhead import REPO, print_table, steady_state, summarize

from disttrain.models.registry import MODEL_SHAPES

VARIANTS = {
    "ddp (stage 0)": ["parallel.zero_stage=0"],
    "zero1": ["parallel.zero_stage=1"],
    "zero2": ["parallel.zero_stage=2"],
    "zero3": ["parallel.zero_stage=3"],
    "zero3 + full AC": ["parallel.zero_stage=3", "parallel.activation_checkpointing=full"],
}


def memory_rows(nproc: int, run_dir: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           "-m", "disttrain.bench.model_states", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, check=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    return [r for r in (json.loads(m) for m in re.findall(r"MEM (\{[^{}]*\})", proc.stdout)) if r["rank"] == 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=60)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "zero.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-zero"
    psi = MODEL_SHAPES["tiny"].num_params()
    print(f"tiny: psi = {psi:,} parameters\n\n| ranks | stage | params MiB (formula) | grads MiB (formula) | "
          "optimizer MiB (formula) |\n|---|---|---|---|---|")
    memory = []
    for nproc in (1, 2, 4):
        for row in memory_rows(nproc, run_dir):
            s = row["stage"]
            f = {"params": 4 * psi / (nproc if s >= 2 else 1), "grads": 4 * psi / (nproc if s >= 2 else 1),
                 "optimizer": 8 * psi / (nproc if s >= 1 else 1)}
            memory.append({**row, "formula": f})
            cells = " | ".join(f"{row[k] / 2**20:.2f} ({f[k] / 2**20:.2f})" for k in ("params", "grads", "optimizer"))
            print(f"| {nproc} | {s} | {cells} |", flush=True)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            cmd = lambda steps: [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "bench.yaml"),  # noqa: E731
                                 f"train.steps={steps}", f"run.dir={run_dir}", *VARIANTS[name], "--nproc-per-node", "2"]
            row = steady_state(cmd, args.short, args.long)
            results[name].append(row)
            print(f"rep {rep + 1}/{args.reps} {name:>16}: {row['tokens_per_s']:8.0f} tok/s", flush=True)
    summary = summarize(results, "ddp (stage 0)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "memory": memory, "runs": results, "summary": summary},
                                         indent=2))
    print_table(summary, "ddp (stage 0)")


if __name__ == "__main__":
    main()
