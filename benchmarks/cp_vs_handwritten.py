"""disttrain's context parallelism (`parallel.cp=2`, ring) against a hand-written loop around the same ring on
torch.distributed alone (workloads/plain_cp_ring.py): the `tiny` model at one sequence of `--seq-len` tokens
per step, 2 processes, fp32. Start-up cancels out (a short and a long run, as in overhead.py); repetitions
interleave; ratios are disttrain over the hand-written loop within a repetition.

    python benchmarks/cp_vs_handwritten.py --reps 4 --seq-len 4096 --short 1 --long 4
"""

from __future__ import annotations

import argparse
import sys

from overhead import REPO, WORKLOADS, disttrain_command, interleaved, summarize, write_results


def command(name: str, steps: int, seq_len: int, run_dir) -> list[str]:
    if name == "hand-written":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                str(WORKLOADS / "plain_cp_ring.py"), "--steps", str(steps), "--seq-len", str(seq_len)]
    return disttrain_command([f"model.max_seq_len={seq_len}", f"data.seq_len={seq_len}", "train.global_batch_size=1",
                              "train.micro_batch_size=1", "parallel.cp=2", "parallel.cp_method=ring",
                              "metrics.log_every=1000", "metrics.sync_check_every=0",
                              "metrics.comm_profile_every=0"], steps, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--short", type=int, default=1)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cp_vs_handwritten.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-cp"
    names = ["disttrain cp=2", "hand-written"]
    results = interleaved(names, lambda name, steps: command(name, steps, args.seq_len, run_dir), args.reps,
                          args.short, args.long, tokens_per_step=args.seq_len)
    summary = summarize(results, baseline="hand-written")[names[0]]
    print(summary)
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})


if __name__ == "__main__":
    main()
