"""Muon's step on 2 CPU processes: disttrain's Muon (each matrix orthogonalised on one rank, its update
broadcast) against the naive distributed Muon (plain DDP + torch.optim.Muon: every rank orthogonalises every
matrix; workloads/plain_ddp_muon.py), and against disttrain's AdamW on the same layout (DDP). Short sequences,
so that the optimizer step is a visible share of the step. Each variant runs `--short` and `--long` steps
(start-up cancels out); the variants are interleaved in rotated order; ratios within a repetition.

    python benchmarks/muon.py --reps 4 [--shape tiny --seq-len 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overhead import REPO, WORKLOADS, add_common_args, disttrain_command, interleaved, print_table, summarize, \
    write_results

GLOBAL_BATCH, MICRO_BATCH = 16, 4


def command(name: str, steps: int, shape: str, seq_len: int, run_dir: Path) -> list[str]:
    if name == "naive muon (DDP + torch.optim.Muon)":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                str(WORKLOADS / "plain_ddp_muon.py"), "--steps", str(steps), "--shape", shape, "--seq-len", str(seq_len)]
    optimizer = "muon" if name.startswith("disttrain muon") else "adamw"
    return disttrain_command([f"model.name={shape}", f"data.seq_len={seq_len}", f"optim.name={optimizer}",
                              "metrics.log_every=1000"], steps, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "muon.json")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    names = ["naive muon (DDP + torch.optim.Muon)", "disttrain muon", "disttrain adamw"]
    run_dir = REPO / "runs" / "bench-muon"
    results = interleaved(names, lambda name, steps: command(name, steps, args.shape, args.seq_len, run_dir),
                          args.reps, args.short, args.long, tokens_per_step=GLOBAL_BATCH * args.seq_len)
    summary = summarize(results, names[0])
    summary["disttrain muon vs disttrain adamw"] = summarize(results, "disttrain adamw")["disttrain muon"]
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})
    print_table({k: v for k, v in summary.items() if k != "disttrain muon vs disttrain adamw"}, names[0])
    s = summary["disttrain muon vs disttrain adamw"]
    print(f"\ndisttrain muon / disttrain adamw: throughput {s['throughput_ratio_median']:.3f} "
          f"({s['throughput_ratio_range'][0]:.3f}-{s['throughput_ratio_range'][1]:.3f})")


if __name__ == "__main__":
    main()
