"""disttrain's expert parallelism (`parallel.ep=2`, ZeRO-3) against a hand-written loop on torch.distributed alone
(workloads/plain_moe_ep.py): `debug-moe` on 2 processes, global batch 16 x 128 tokens, micro-batches of 4, fp32,
no balancing loss or bias. Start-up cancels out (a short and a long run, as in overhead.py); repetitions
interleave; ratios are disttrain over the hand-written loop within a repetition.

    python benchmarks/moe_vs_handwritten.py --reps 4 --short 2 --long 12
"""

from __future__ import annotations

import argparse
import statistics
import sys

from overhead import REPO, WORKLOADS, disttrain_command, measure_command, write_results

TOKENS_PER_STEP = 16 * 128


def command(name: str, steps: int, run_dir) -> list[str]:
    if name == "hand-written":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                str(WORKLOADS / "plain_moe_ep.py"), "--steps", str(steps)]
    return disttrain_command(["model.name=debug-moe", "parallel.ep=2", "parallel.zero_stage=3",
                              "model.moe.aux_loss_coef=0", "model.moe.bias_update_rate=0",
                              "metrics.log_every=1000", "metrics.sync_check_every=0",
                              "metrics.comm_profile_every=0"], steps, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--short", type=int, default=2)
    parser.add_argument("--long", type=int, default=12)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "moe_vs_handwritten.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-moe"
    names = ["disttrain ep=2", "hand-written"]
    results: dict = {n: [] for n in names}
    tokens = TOKENS_PER_STEP * (args.long - args.short)
    for rep in range(args.reps):
        for name in names[rep % 2:] + names[:rep % 2]:
            w1, c1 = measure_command(command(name, args.short, run_dir))
            w2, c2 = measure_command(command(name, args.long, run_dir))
            row = {"tokens_per_s": tokens / (w2 - w1), "cpu_s_per_token": (c2 - c1) / tokens}
            results[name].append(row)
            print(f"rep {rep + 1}/{args.reps} {name:>15}: {row['tokens_per_s']:7.0f} tok/s, "
                  f"{1e3 * row['cpu_s_per_token']:6.3f} CPU-ms/token", flush=True)
    ours, theirs = results[names[0]], results[names[1]]
    speed = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
    cpu = [a["cpu_s_per_token"] / b["cpu_s_per_token"] for a, b in zip(ours, theirs)]
    summary = {"throughput_ratio_median": statistics.median(speed), "throughput_ratio_range": [min(speed), max(speed)],
               "cpu_per_token_ratio_median": statistics.median(cpu), "cpu_per_token_ratio_range": [min(cpu), max(cpu)]}
    print(summary)
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})


if __name__ == "__main__":
    main()
