"""Context parallelism on CPU: the `tiny` model at seq 4,096 and 8,192, `cp=2` on 2 processes with each
`parallel.cp_method`, against one process training the same batch (cp=1). Interleaved repetitions; per run
the median step time of the steps after the first, CPU-seconds of the whole process tree per trained token,
and the peak memory per rank (`mem_peak_bytes`, the max over ranks). Ratios are taken within a repetition.

    python benchmarks/context_parallel.py --reps 4 [--seq-lens 4096 8192] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from overhead import REPO, measure_command

VARIANTS = {"one process": ("1", ()), "ring": ("2", ("parallel.cp=2", "parallel.cp_method=ring")),
            "allgather": ("2", ("parallel.cp=2", "parallel.cp_method=allgather")),
            "ulysses": ("2", ("parallel.cp=2", "parallel.cp_method=ulysses"))}


def measure(name: str, seq: int, steps: int, run_dir: Path) -> dict:
    nproc, extra = VARIANTS[name]
    run = f"{name.replace(' ', '_')}-{seq}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "debug.yaml"), "model.name=tiny",
           f"model.max_seq_len={seq}", f"data.seq_len={seq}", "train.global_batch_size=1", f"train.steps={steps}",
           "metrics.sync_check_every=0", "metrics.comm_profile_every=0", "checkpoint.save_final=false",
           f"run.dir={run_dir}", f"run.name={run}", *extra, "--nproc-per-node", nproc]
    wall, cpu = measure_command(cmd)
    recs = [json.loads(line) for line in (run_dir / run / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in recs if "step_time_s" in r and "event" not in r]
    return {"step_s": statistics.median(r["step_time_s"] for r in steps_[1:]),
            "cpu_s_per_token": cpu / (steps * seq), "mem_peak_bytes": max(r.get("mem_peak_bytes", 0) for r in steps_),
            "loss": steps_[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    args = ap.parse_args()
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for seq in args.seq_lens:
                for name in VARIANTS:
                    r = measure(name, seq, args.steps, Path(tmp))
                    rows.setdefault((seq, name), []).append(r)
                    print(f"rep {rep} seq {seq} {name}: {r}", flush=True)
    for seq in args.seq_lens:
        base = rows[(seq, "one process")]
        for name in VARIANTS:
            runs = rows[(seq, name)]
            ratio = [b["step_s"] / r["step_s"] for r, b in zip(runs, base)]
            cpu = [r["cpu_s_per_token"] * 1e3 for r in runs]
            mem = statistics.median(r["mem_peak_bytes"] for r in runs) / 2**20
            print(f"seq {seq:5d} {name:12s} step {statistics.median(r['step_s'] for r in runs):6.2f} s  "
                  f"throughput vs one process {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})  "
                  f"CPU ms/token {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})  peak/rank {mem:.0f} MiB")


if __name__ == "__main__":
    main()
