"""Metrics overhead by accounting, not by comparing two runs: ONE run with every sink on, in which each rank
times the metrics code itself (the per-step observation, the logging step's all-reduces and records, every
sink's write, the replica sync check, the communication profiler's start and read-out, and the profiled
step's own slowdown against its neighbours) and divides by the run's step time. Both come from the same
process over the same minutes, so this machine's 2-3x speed swings cancel; a comparison of two runs
(metrics_overhead.py) cannot resolve 2% here.

    .venv/bin/python benchmarks/metrics_share.py [--steps 410] [--reps 3]

Workload: configs/bench.yaml (tiny, 2 processes), logging every step, jsonl, TensorBoard, Prometheus on every
rank, sync check every 10 steps, the profiler at its default of one step in 200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SINKS_ON = ["metrics.log_every=1", "metrics.jsonl=true", "metrics.tensorboard=true", "metrics.prometheus_port=29650",
            "metrics.sync_check_every=10", "metrics.comm_profile_every=200", "checkpoint.save_final=false",
            "checkpoint.resume=none", "train.eval_every=0", "train.sample_tokens=0"]


def worker(out: str, overrides: list[str]) -> None:
    """Runs under the launcher: the training loop with timers around the metrics code."""
    import torch.distributed as dist

    import disttrain.train.jobs as jobs
    import disttrain.train.loop as loop
    import disttrain.train.step_metrics as step_metrics
    from disttrain.config.load import load_config
    from disttrain.distributed.env import detect_env
    from disttrain.distributed.runtime import init_distributed, shutdown
    from disttrain.observe.breakdown import CommProfiler
    from disttrain.observe.metrics import MetricsLogger
    from disttrain.launch.this_process import exit_now
    from disttrain.train.builder import build_run

    spent: dict[str, float] = {}
    step_seconds: list[float] = []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    observe = MetricsLogger.observe_step

    def observe_step(self, seconds):
        step_seconds.append(seconds)
        return observe(self, seconds)

    MetricsLogger.observe_step = timed("observe_step", observe_step)
    for name in ("log_step", "event", "message"):
        setattr(MetricsLogger, name, timed(name, getattr(MetricsLogger, name)))
    jobs.check_replicas_in_sync = timed("sync_check", jobs.check_replicas_in_sync)
    step_metrics.StepMetrics.record = timed("step_record (all-reduces, breakdown, memory)", step_metrics.StepMetrics.record)
    profiled: list[int] = []
    start = CommProfiler.start

    def start_profiler(self, step):
        if self.every and step % self.every == 0:
            profiled.append(step)
        return start(self, step)

    CommProfiler.start = timed("profiler start/stop", start_profiler)
    CommProfiler.stop = timed("profiler start/stop", CommProfiler.stop)

    runtime = init_distributed(detect_env(), "auto", 120)
    cfg = load_config(REPO / "configs" / "bench.yaml", overrides)
    trainer = loop.Trainer(build_run(cfg, runtime))
    t0 = time.perf_counter()
    trainer.fit()
    total = time.perf_counter() - t0
    steady = statistics.median(step_seconds[5:])
    # the profiled steps' own slowdown (per-op recording) beyond their start/stop, which is timed above and
    # falls inside those steps' observed seconds
    excess = sum(max(0.0, step_seconds[s - 1] - steady) for s in profiled)
    spent["profiled step slowdown"] = max(0.0, excess - spent.get("profiler start/stop", 0.0))
    result = {"rank": runtime.rank, "total_s": total, "steps": len(step_seconds), "spent_s": spent,
              "step_s_median": steady}
    gathered = [None] * runtime.world_size
    dist.all_gather_object(gathered, result)
    if runtime.rank == 0:
        Path(out).write_text(json.dumps(gathered))
    shutdown()
    exit_now(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=410)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "metrics_share.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-metrics-share"
    reps = []
    for rep in range(args.reps):
        out = run_dir / f"rep{rep}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        overrides = [*SINKS_ON, f"train.steps={args.steps}", f"run.dir={run_dir}", f"run.name=rep{rep}"]
        subprocess.run([sys.executable, "-m", "disttrain.launch.agent", "--standalone", "--nproc-per-node=2",
                        __file__, "--worker", str(out), *overrides], check=True, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        ranks = json.loads(out.read_text())
        reps.append(ranks)
        for r in ranks:
            share = sum(r["spent_s"].values()) / r["total_s"]
            print(f"rep {rep + 1} rank {r['rank']}: metrics code {share:.2%} of {r['total_s']:.1f} s "
                  f"({r['steps']} steps, median step {r['step_s_median'] * 1e3:.0f} ms)", flush=True)
    parts = sorted({k for ranks in reps for r in ranks for k in r["spent_s"]})
    print("\n| part | share of run time, median over ranks and repetitions (range) |\n|---|---|")
    for part in [*parts, "total"]:
        shares = [(sum(r["spent_s"].values()) if part == "total" else r["spent_s"].get(part, 0.0)) / r["total_s"]
                  for ranks in reps for r in ranks]
        print(f"| {part} | {statistics.median(shares):.2%} ({min(shares):.2%}-{max(shares):.2%}) |")
    from disttrain.bench.results import write_results

    write_results(args.out, args=vars(args), runs=reps)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
