"""Share of step time spent waiting for data (`time_data_s / step_time_s`), with and without prefetch.

2 processes, DDP, fp32, the built-in corpus; `tiny` (global batch 16 x 128 tokens, micro-batch 8, as
`make demo`) and `125m` (global batch 4 x 256 tokens, micro-batch 2). Each run's figure is the median
over its logged steps after the second; repetitions interleave prefetch on and off.

    python benchmarks/data_time.py --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from disttrain.bench.results import write_results  # noqa: E402

SHAPES = {"tiny": ["model.name=tiny", "data.seq_len=128", "train.global_batch_size=16", "train.micro_batch_size=8",
                   "train.steps=40"],
          "125m": ["model.name=125m", "data.seq_len=256", "train.global_batch_size=4", "train.micro_batch_size=2",
                   "train.steps=8"]}


def run(shape: str, prefetch: bool, root: Path) -> dict:
    name = f"{shape}_{'on' if prefetch else 'off'}"
    cmd = [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "debug.yaml"), f"run.dir={root}",
           f"run.name={name}", *SHAPES[shape], f"data.prefetch={str(prefetch).lower()}", "checkpoint.save_final=false",
           "metrics.comm_profile_every=0", "--nproc-per-node", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r and "event" not in r and r["step"] > 2]
    return {"data_share": statistics.median(r["time_data_s"] / r["step_time_s"] for r in steps),
            "data_s": statistics.median(r["time_data_s"] for r in steps),
            "step_s": statistics.median(r["step_time_s"] for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "data_time.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for shape in SHAPES:
                for prefetch in ((True, False) if rep % 2 == 0 else (False, True)):
                    row = {"rep": rep, "shape": shape, "prefetch": prefetch, **run(shape, prefetch, Path(tmp) / f"r{rep}")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = {f"{shape} prefetch={'on' if p else 'off'}": {
        k: statistics.median(r[k] for r in rows if r["shape"] == shape and r["prefetch"] == p)
        for k in ("data_share", "data_s", "step_s")} for shape in SHAPES for p in (True, False)}
    write_results(args.out, rows=rows, summary=summary)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
