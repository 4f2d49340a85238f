"""Recovery time after a worker is SIGKILLed, on the demo config with 2 CPU processes under
`--max-restarts 1`: kill -> first completed step after resume, split into restart (kill -> new
process started), start-up and rendezvous (-> process group ready), load (-> checkpoint restored)
and first step (-> first step record).

    python benchmarks/recovery.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] INFO (\S+): (.*)$")


def _log_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_run(workdir: Path, kill_step: int) -> dict:
    fault_log = workdir / "fault.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTTRAIN_FAULT=f"kill:rank=1:step={kill_step}",
               DISTTRAIN_FAULT_LOG=str(fault_log))
    subprocess.run([sys.executable, "-m", "disttrain", "train", "configs/demo.yaml", f"run.dir={workdir}",
                    "train.steps=60", "checkpoint.every_steps=20", "metrics.log_every=1", "train.eval_every=0",
                    "train.sample_tokens=0", "--nproc-per-node", "2", "--max-restarts", "1"],
                   cwd=REPO, env=env, check=True, capture_output=True)
    kill = json.loads(fault_log.read_text().splitlines()[0])["time"]
    started = ready = loaded = None
    for line in (workdir / "demo" / "logs" / "rank_00000.log").read_text().splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        t = _log_time(m.group(1))
        if m.group(3).startswith("process started at") and "restart 1" in m.group(3):
            started = float(m.group(3).split()[3])
        elif started and ready is None and m.group(2).endswith("runtime") and t >= started:
            ready = t
        elif started and m.group(3).startswith("resumed from"):
            loaded = float(m.group(3).rsplit(" ", 1)[1])
    records = [json.loads(x) for x in (workdir / "demo" / "metrics.jsonl").read_text().splitlines()]
    resumed_at = next(i for i, r in enumerate(records) if r.get("event") == "resumed")
    first_step = next(r["time"] for r in records[resumed_at:] if "loss" in r)
    return {"restart_s": started - kill, "startup_rendezvous_s": ready - started, "load_s": loaded - ready,
            "first_step_s": first_step - loaded, "total_s": first_step - kill}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recovery.json"))
    args = parser.parse_args()
    rows = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(one_run(Path(tmp), kill_step=30))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1].items()), flush=True)
    keys = list(rows[0])
    summary = {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                   "max": max(r[k] for r in rows)} for k in keys}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": rows, "summary": summary}, indent=2))
    print("\n| phase | median s | min-max s |\n|---|---|---|")
    for k, s in summary.items():
        print(f"| {k} | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} |")


if __name__ == "__main__":
    main()
