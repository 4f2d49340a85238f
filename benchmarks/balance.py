"""Uneven shares against a rank made slower by a known factor (heterogeneous clusters, issue 16).

2 processes, the `tiny` model, global batch 12 of 256-token sequences in micro-batches of 1, DDP,
fp32. Rank 1 runs every forward and backward `factor` times as long (the test-only
`slowdown` fault: it waits (factor - 1) x each phase it just ran). Per repetition, interleaved:
  baseline  no slowdown, equal shares (6 + 6)          -> T0 = c + 6t
  equal     slowdown, equal shares                     -> Te = c + 6kt
  static    slowdown, parallel.balance_weights=[k, 1]
  auto      slowdown, parallel.balance=auto (re-split every 4 steps)
t (one micro-batch on the fast rank) and c (the step's fixed part: optimizer, all-reduce) follow
from T0 and Te; the ideal is c + 12t·k/(k+1), the harmonic combination of the two speeds. Step
time is the median `step_time_s` of steps 6-16 (auto's first re-split is at step 4).

    python benchmarks/balance.py --reps 4 --factors 2,3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS, FIRST, MICRO_BATCHES, SEQ = 16, 6, 12, 256
COMMON = ["model.name=tiny", f"data.seq_len={SEQ}", f"train.global_batch_size={MICRO_BATCHES}",
          "train.micro_batch_size=1", f"train.steps={STEPS}", "metrics.comm_profile_every=0",
          "checkpoint.save_final=false", "train.eval_every=0", "train.sample_tokens=0"]


def run(name: str, overrides: list[str], factor: float, root: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if factor != 1:
        env["DISTTRAIN_FAULT"] = f"slowdown:rank=1:step=0:factor={factor}"
    cmd = [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "debug.yaml"), f"run.dir={root}",
           f"run.name={name}", *COMMON, *overrides, "--nproc-per-node", "2"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "event" not in r and r["step"] >= FIRST]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"step_s": statistics.median(r["step_time_s"] for r in steps),
            "shares": steps[-1].get("balance_shares"), "cpu_s_per_token_run": cpu / (STEPS * MICRO_BATCHES * SEQ)}


def variants(k: float) -> dict[str, tuple[list[str], float]]:
    return {"equal": (["parallel.balance_weights=[1,1]"], k),
            "static": ([f"parallel.balance_weights=[{k},1]"], k),
            "auto": (["parallel.balance=auto", "parallel.balance_every=4"], k)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--factors", default="2,3")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "balance.json"))
    args = ap.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    reps = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            root = Path(tmp) / f"rep{rep}"
            row = {"baseline": run("baseline", ["parallel.balance_weights=[1,1]"], 1, root)}
            order = [(k, v) for k in factors for v in variants(k)]
            order = order[rep % len(order):] + order[:rep % len(order)]  # rotate: drift hits every variant
            for k, v in order:
                overrides, factor = variants(k)[v]
                row[f"{v} x{k:g}"] = run(f"{v}_{k:g}", overrides, factor, root)
            for k in factors:
                t0, te = row["baseline"]["step_s"], row[f"equal x{k:g}"]["step_s"]
                t = (te - t0) / (6 * (k - 1))
                row[f"ideal x{k:g}"] = {"step_s": t0 - 6 * t + MICRO_BATCHES * t * k / (k + 1), "t": t, "c": t0 - 6 * t}
            reps.append(row)
            print(f"rep {rep + 1}: " + ", ".join(f"{n} {r['step_s']:.3f}s" for n, r in row.items()), flush=True)
    summary = {}
    for k in factors:
        for v in ("equal", "static", "auto"):
            key = f"{v} x{k:g}"
            ratios = [r[f"ideal x{k:g}"]["step_s"] / r[key]["step_s"] for r in reps]
            summary[key] = {"step_s_median": statistics.median(r[key]["step_s"] for r in reps),
                            "ideal_over_measured_median": statistics.median(ratios),
                            "ideal_over_measured_range": [min(ratios), max(ratios)],
                            "speedup_over_equal_median": statistics.median(
                                r[f"equal x{k:g}"]["step_s"] / r[key]["step_s"] for r in reps),
                            "shares": reps[-1][key]["shares"],
                            "cpu_s_per_token_median": statistics.median(r[key]["cpu_s_per_token_run"] for r in reps)}
        summary[f"ideal x{k:g}"] = {"step_s_median": statistics.median(r[f"ideal x{k:g}"]["step_s"] for r in reps)}
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": "python benchmarks/balance.py " + " ".join(sys.argv[1:]), "reps": reps, "summary": summary}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for key, s in summary.items():
        print(f"{key:<12} {s['step_s_median']:.3f} s" + (
            f"  ideal/measured {s['ideal_over_measured_median']:.3f} ({s['ideal_over_measured_range'][0]:.3f}-"
            f"{s['ideal_over_measured_range'][1]:.3f})  x{s['speedup_over_equal_median']:.2f} vs equal  shares "
            f"{s['shares']}" if "shares" in s else ""))


if __name__ == "__main__":
    main()
