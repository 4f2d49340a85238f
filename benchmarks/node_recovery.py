"""Recovery time after losing a whole node, on loopback: two `disttrain train` launchers (`--nnodes 1:2`, one
worker each) on the demo config; after step 30 node B's launcher, agent and worker are SIGKILLed together.
Kill -> node A's next completed step, split into detection (A's agent sees its worker fail: gloo's
connection to the dead peer breaks), rendezvous (-> A's new worker process started: the dead node's
heartbeats expire, then the last call), start-up (-> process group ready), load (-> checkpoint restored)
and first step. Repetitions alternate disttrain's rendezvous defaults and torch's.

    python benchmarks/node_recovery.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from disttrain.bench.processes import kill_tree  # noqa: E402
from disttrain.bench.results import write_results  # noqa: E402

SETTINGS = {"disttrain": "", "torch": "last_call_timeout=30,keep_alive_interval=5,keep_alive_max_attempt=3"}
AGENT_FAILED = re.compile(r"^E(\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) .*\] failed \(exitcode")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] INFO (\S+): (.*)$")


def _node(root: Path, port: int, conf: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "disttrain", "train", "configs/demo.yaml", f"run.dir={root}", "run.name=run",
           "train.steps=100000", "checkpoint.every_steps=20", "train.eval_every=0", "train.sample_tokens=0",
           "metrics.log_every=1", "--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--max-restarts", "3", *(["--rdzv-conf", conf] if conf else [])]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _kill(node: subprocess.Popen) -> None:
    kill_tree(node.pid)
    node.wait()


def _records(root: Path) -> list[dict]:
    path = root / "run" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _wait(predicate, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.05)


def one_run(root: Path, conf: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = _node(root, port, conf, root / "a.log")
    time.sleep(1)
    b = _node(root, port, conf, root / "b.log")
    try:
        _wait(lambda: any(r.get("step", 0) >= 30 and "loss" in r for r in _records(root)))
        kill = time.time()
        _kill(b)
        _wait(lambda: any("loss" in r and r["time"] > kill and r.get("step", 0) > 0 for r in _records(root)
                          if any(e.get("event") == "resumed" and e["time"] > kill for e in _records(root))))
    finally:
        _kill(a)
        if b.poll() is None:
            _kill(b)
    year = datetime.fromtimestamp(kill).year
    failed = min(datetime.strptime(f"{year}{m.group(1)}{m.group(2)} {m.group(3)}", "%Y%m%d %H:%M:%S.%f").timestamp()
                 for m in map(AGENT_FAILED.match, (root / "a.log").read_text().splitlines()) if m)
    started = ready = None
    for line in (root / "run" / "logs" / "rank_00000.log").read_text().splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if started is None and m.group(3).startswith("process started at") and float(m.group(3).split()[3]) > kill:
            started = float(m.group(3).split()[3])
        elif started and ready is None and m.group(2).endswith("runtime"):
            ready = t
    records = _records(root)
    resumed = next(r for r in records if r.get("event") == "resumed" and r["time"] > kill)
    first = next(r["time"] for r in records if "loss" in r and r["time"] > resumed["time"])
    return {"detection_s": failed - kill, "rendezvous_s": started - failed, "startup_s": ready - started,
            "load_s": resumed["time"] - ready, "first_step_s": first - resumed["time"], "total_s": first - kill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "node_recovery.json"))
    args = parser.parse_args()
    rows = []
    for rep in range(args.reps):
        for name in (SETTINGS if rep % 2 == 0 else reversed(list(SETTINGS))):
            with tempfile.TemporaryDirectory() as tmp:
                rows.append({"settings": name, "rep": rep, **one_run(Path(tmp), SETTINGS[name])})
            print(json.dumps(rows[-1]), flush=True)
    keys = [k for k in rows[0] if k.endswith("_s")]
    summary = {name: {k: {"median": statistics.median(r[k] for r in rows if r["settings"] == name),
                          "min": min(r[k] for r in rows if r["settings"] == name),
                          "max": max(r[k] for r in rows if r["settings"] == name)} for k in keys}
               for name in SETTINGS}
    write_results(args.out, runs=rows, summary=summary)
    for name, phases in summary.items():
        print(f"\n{name}: " + ", ".join(f"{k} {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
                                         for k, v in phases.items()))


if __name__ == "__main__":
    main()
