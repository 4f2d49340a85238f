"""Step overhead of this checkout against another one (a commit before a change), each against the same
hand-written loops: plain DDP and plain FSDP2 (ZeRO-2 and ZeRO-3), as benchmarks/sharded_vs_handwritten.py runs
them. Every repetition runs every variant (the hand-written loop, disttrain from the other tree, disttrain from
this one) in rotated order; ratios are taken within a repetition.

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before --reps 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from overhead import REPO, WORKLOADS, add_common_args, interleaved, write_results

STAGES = {"ddp": 0, "zero2": 2, "zero3": 3}


def command(name: str, steps: int, micro_batch: int, run_dir: Path, trees: dict[str, Path]) -> list[str]:
    layout, who = name.split()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    common = ["--steps", str(steps), "--micro-batch", str(micro_batch)]
    if who == "plain":
        if layout == "ddp":
            return [*torchrun, str(WORKLOADS / "plain_ddp.py"), *common]
        flag = "--reshard-after-forward" if layout == "zero3" else "--no-reshard-after-forward"
        return [*torchrun, str(WORKLOADS / "plain_fsdp.py"), *common, flag]
    import uuid

    tree = trees[who]
    return [sys.executable, "-m", "disttrain", "train", str(tree / "configs" / "bench.yaml"), f"train.steps={steps}",
            f"run.dir={run_dir}", f"run.name=bench-{uuid.uuid4().hex[:12]}", f"parallel.zero_stage={STAGES[layout]}",
            f"train.micro_batch_size={micro_batch}", "metrics.log_every=1000", "--nproc-per-node", "2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "before_after.json")
    parser.add_argument("--before", required=True, help="the other checkout (a git worktree of the earlier commit)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(STAGES))
    args = parser.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": REPO}
    layouts = [k for k in args.layouts.split(",") if k in STAGES]
    names = [f"{layout} {who}" for layout in layouts for who in ("plain", "before", "after")]
    run_dir = REPO / "runs" / "bench-before-after"
    results = interleaved(names, lambda name, steps: command(name, steps, args.micro_batch, run_dir, trees), args.reps,
                          args.short, args.long, src_for=lambda name: trees.get(name.split()[1], REPO) / "src"
                          if name.split()[1] != "plain" else None)
    summary = {}
    for layout in layouts:
        plain = results[f"{layout} plain"]
        row = {}
        for who in ("before", "after"):
            ours = results[f"{layout} {who}"]
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, plain)]
            cpu = [a["cpu_s_per_token"] / b["cpu_s_per_token"] for a, b in zip(ours, plain)]
            row[who] = {"throughput_ratio_median": statistics.median(ratios), "throughput_ratio_range": [min(ratios), max(ratios)],
                        "cpu_per_token_ratio_median": statistics.median(cpu), "cpu_per_token_ratio_range": [min(cpu), max(cpu)],
                        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in ours),
                        "cpu_us_per_token_median": 1e6 * statistics.median(r["cpu_s_per_token"] for r in ours)}
        row["plain tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in plain)
        summary[layout] = row
    write_results(args.out, {"args": vars(args), "before": str(trees["before"]), "runs": results, "summary": summary})
    print("\n| layout | before / hand-written: throughput (median, range) | CPU per token | after / hand-written: "
          "throughput (median, range) | CPU per token |\n|---|---|---|---|---|")
    for layout, row in summary.items():
        cells = []
        for who in ("before", "after"):
            s = row[who]
            lo, hi = s["throughput_ratio_range"]
            clo, chi = s["cpu_per_token_ratio_range"]
            cells += [f"{s['throughput_ratio_median']:.3f} ({lo:.3f}-{hi:.3f})",
                      f"{s['cpu_per_token_ratio_median']:.3f} ({clo:.3f}-{chi:.3f})"]
        print(f"| {layout} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
