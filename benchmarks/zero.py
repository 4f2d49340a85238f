"""ZeRO stages on this machine: per-rank model-state bytes (1, 2, 4 ranks) next to the ZeRO formulas,
and throughput of each stage against DDP (2 ranks, interleaved, start-up removed as in overhead.py).

    python benchmarks/zero.py --reps 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

from overhead import REPO, add_common_args, disttrain_command, interleaved, print_table, summarize, write_results

from disttrain.bench.model_states import launch
from disttrain.models.registry import MODEL_SHAPES

VARIANTS = {
    "ddp (stage 0)": ["parallel.zero_stage=0"],
    "zero1": ["parallel.zero_stage=1"],
    "zero2": ["parallel.zero_stage=2"],
    "zero3": ["parallel.zero_stage=3"],
    "zero3 + full AC": ["parallel.zero_stage=3", "parallel.activation_checkpointing=full"],
}


def memory_rows(nproc: int, run_dir: Path) -> list[dict]:
    return [r for r in launch(nproc, run_dir) if r["rank"] == 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_common_args(parser, "zero.json")
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
    results = interleaved(list(VARIANTS), lambda name, steps: disttrain_command(VARIANTS[name], steps, run_dir),
                          args.reps, args.short, args.long)
    summary = summarize(results, "ddp (stage 0)")
    write_results(args.out, {"args": vars(args), "memory": memory, "runs": results, "summary": summary})
    print_table(summary, "ddp (stage 0)")


if __name__ == "__main__":
    main()
