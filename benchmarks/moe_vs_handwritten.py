"""disttrain's expert parallelism (`parallel.ep=2`, ZeRO-3) against a hand-written loop on torch.distributed alone
(workloads/plain_moe_ep.py): `debug-moe` on 2 processes, global batch 16 x 128 tokens, micro-batches of 4, fp32,
no balancing loss or bias; `--size tiny` trains a `tiny`-sized MoE (dim 256, 4 layers, 16 experts, top-2) on
both sides instead. Start-up cancels out (a short and a long run, as in overhead.py); repetitions
interleave; ratios are disttrain over the hand-written loop within a repetition. The windows below (200 and
40 steps, about 17 s each) outlast the shared machine's stalls; shorter ones read a stall as a gap.

    python benchmarks/moe_vs_handwritten.py --reps 4 --short 10 --long 210
    python benchmarks/moe_vs_handwritten.py --reps 4 --short 3 --long 43 --size tiny
"""

from __future__ import annotations

import argparse
import sys

from overhead import REPO, WORKLOADS, disttrain_command, interleaved, summarize, write_results

sys.path.insert(0, str(WORKLOADS))
from plain_moe_ep import SIZES  # noqa: E402  (the model sizes both sides train)

TOKENS_PER_STEP = 16 * 128


def command(name: str, steps: int, run_dir, size: str = "debug") -> list[str]:
    if name == "hand-written":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                str(WORKLOADS / "plain_moe_ep.py"), "--steps", str(steps), "--size", size]
    return disttrain_command(["model.name=debug-moe", *(f"model.{k}={v}" for k, v in SIZES[size].items()), "parallel.ep=2", "parallel.zero_stage=3",
                              "model.moe.aux_loss_coef=0", "model.moe.bias_update_rate=0",
                              "metrics.log_every=1000", "metrics.sync_check_every=0",
                              "metrics.comm_profile_every=0"], steps, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--short", type=int, default=2)
    parser.add_argument("--long", type=int, default=12)
    parser.add_argument("--size", choices=sorted(SIZES), default="debug")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/moe_vs_handwritten[_tiny].json")
    args = parser.parse_args()
    suffix = "" if args.size == "debug" else f"_{args.size}"
    args.out = args.out or str(REPO / "benchmarks" / "results" / f"moe_vs_handwritten{suffix}.json")
    run_dir = REPO / "runs" / "bench-moe"
    names = ["disttrain ep=2", "hand-written"]
    results = interleaved(names, lambda name, steps: command(name, steps, run_dir, args.size), args.reps, args.short, args.long,
                          tokens_per_step=TOKENS_PER_STEP)
    summary = summarize(results, baseline="hand-written")[names[0]]
    print(summary)
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})


if __name__ == "__main__":
    main()
