"""disttrain's DDP, ZeRO-2 and ZeRO-3 against hand-written loops on the same workload: plain DDP and plain
FSDP2 (`fully_shard` per block and root; reshard after forward for ZeRO-3, not for ZeRO-2).

2 processes, the `tiny` model, global batch 16 x 128 tokens (benchmarks/workloads/common.py), fp32, AdamW,
clip 1.0; with accumulation (micro-batch 4: two per rank) or without (`--micro-batch 8`). Start-up cancels
out (short and long runs, as in overhead.py); repetitions interleave every variant; ratios are taken within
a repetition, disttrain over its hand-written counterpart, for throughput and CPU-seconds per token.

    python benchmarks/sharded_vs_handwritten.py --reps 4 [--micro-batch 8] [--layouts zero2,zero3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from overhead import REPO, WORKLOADS, add_common_args, disttrain_command, interleaved, write_results

PAIRS = {"ddp": ("disttrain ddp", "plain ddp"), "zero2": ("disttrain zero2", "plain fsdp2 zero2"),
         "zero3": ("disttrain zero3", "plain fsdp2 zero3")}


def command(name: str, steps: int, micro_batch: int, run_dir) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    common = ["--steps", str(steps), "--micro-batch", str(micro_batch)]
    if name == "plain ddp":
        return [*torchrun, str(WORKLOADS / "plain_ddp.py"), *common]
    if name.startswith("plain fsdp2"):
        flag = "--reshard-after-forward" if name.endswith("zero3") else "--no-reshard-after-forward"
        return [*torchrun, str(WORKLOADS / "plain_fsdp.py"), *common, flag]
    stage = {"ddp": 0, "zero2": 2, "zero3": 3}[name.split()[1]]
    return disttrain_command([f"parallel.zero_stage={stage}", f"train.micro_batch_size={micro_batch}",
                              "metrics.log_every=1000"], steps, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "sharded_vs_handwritten.json")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(PAIRS), help="comma-separated subset of ddp,zero2,zero3")
    args = parser.parse_args()
    pairs = {k: PAIRS[k] for k in args.layouts.split(",") if k in PAIRS}
    if not pairs:
        raise SystemExit(f"--layouts={args.layouts}: choose from {','.join(PAIRS)}")
    run_dir = REPO / "runs" / "bench-sharded"
    names = [n for pair in pairs.values() for n in pair]
    results = interleaved(names, lambda name, steps: command(name, steps, args.micro_batch, run_dir), args.reps,
                          args.short, args.long)
    summary = {}
    for key, (ours, theirs) in pairs.items():
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results[ours], results[theirs])]
        cpu = [a["cpu_s_per_token"] / b["cpu_s_per_token"] for a, b in zip(results[ours], results[theirs])]
        summary[key] = {"throughput_ratio_median": statistics.median(ratios), "throughput_ratio_range": [min(ratios), max(ratios)],
                        "cpu_per_token_ratio_median": statistics.median(cpu), "cpu_per_token_ratio_range": [min(cpu), max(cpu)],
                        **{f"{n} tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in results[n])
                           for n in (ours, theirs)},
                        **{f"{n} cpu_us_per_token_median": 1e6 * statistics.median(r["cpu_s_per_token"] for r in results[n])
                           for n in (ours, theirs)}}
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})
    print("\n| layout | disttrain / hand-written throughput (median, range) | CPU per token (median, range) |\n|---|---|---|")
    for key, s in summary.items():
        lo, hi = s["throughput_ratio_range"]
        clo, chi = s["cpu_per_token_ratio_range"]
        print(f"| {key} | {s['throughput_ratio_median']:.3f} ({lo:.3f}-{hi:.3f}) | "
              f"{s['cpu_per_token_ratio_median']:.3f} ({clo:.3f}-{chi:.3f}) |")


if __name__ == "__main__":
    main()
