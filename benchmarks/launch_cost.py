"""What a launch costs before training: `disttrain train configs/debug.yaml --nproc-per-node N` for 2 steps,
with workers forked from the launcher (`DISTTRAIN_WORKER_START=fork`, the test suite's setting) against
fresh interpreters (`DISTTRAIN_WORKER_START=exec`, the default, and what plain torchrun does). Wall time and CPU-seconds of the whole process
tree (launcher and workers), in interleaved repetitions; the ratio is taken within a repetition.

    python benchmarks/launch_cost.py --reps 4 [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from overhead import REPO, measure_command

MODES = ("exec", "fork")


def measure(mode: str, nproc: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "debug.yaml"), "train.steps=2",
           f"run.dir={run_dir}", f"run.name={mode}-{time.monotonic_ns()}", "checkpoint.save_final=false",
           "--nproc-per-node", str(nproc)]
    os.environ["DISTTRAIN_WORKER_START"] = mode  # measure_command passes this process's environment on
    wall, cpu = measure_command(cmd)
    return {"wall_s": wall, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "launch_cost.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else reversed(MODES):
                runs[mode].append(measure(mode, args.nproc, Path(tmp)))
                print(f"rep {rep + 1} {mode}: {runs[mode][-1]}", file=sys.stderr)
    ratios = {k: [f[k] / e[k] for f, e in zip(runs["fork"], runs["exec"])] for k in ("wall_s", "cpu_s")}
    summary = {f"{m} {k} median": statistics.median(r[k] for r in runs[m]) for m in MODES for k in ("wall_s", "cpu_s")}
    summary.update({f"fork/exec {k} median": statistics.median(v) for k, v in ratios.items()})
    summary.update({f"fork/exec {k} range": [min(v), max(v)] for k, v in ratios.items()})
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
