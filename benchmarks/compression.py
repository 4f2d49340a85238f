"""Gradient compression under DDP (`parallel.ddp_comm_hook`): bytes all-reduced per step (counted with the
profiler, not estimated), step time, and the loss after a fixed number of steps of the demo config, for
none / fp16 / bf16 / PowerSGD rank 1 and 4, on 2 processes.

Bytes per step are counted by differencing runs of S and S+K steps (over K), as benchmarks/step_counts.py
does: with the profiler, and with a wrapper around `torch.distributed.all_reduce` that also sees what the
hooks launch from future callbacks (PowerSGD's P and Q, which the profiler does not record); the table
takes the wrapper's count for hooks and the profiler's without one (DDP's buckets are issued from C++).
PowerSGD's first `powersgd_start_iter` steps are uncompressed, so S is past them.
Step times are the median `step_time_s` of steps after the first 5, in `--reps` interleaved repetitions
(every hook once per repetition); the loss is the final training loss and validation loss of one run of
`--steps` steps (deterministic: the same in every repetition).

    python benchmarks/compression.py [--steps 200] [--reps 4]      # re-launches itself under torchrun
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOOKS = {"none": [], "fp16": ["parallel.ddp_comm_hook=fp16"], "bf16": ["parallel.ddp_comm_hook=bf16"],
         "powersgd r1": ["parallel.ddp_comm_hook=powersgd", "parallel.powersgd_rank=1"],
         "powersgd r4": ["parallel.ddp_comm_hook=powersgd", "parallel.powersgd_rank=4"]}
WARMUP = 5
SHORT, EXTRA = 3, 4  # as benchmarks/step_counts.py: steps of the short run; the long run has EXTRA more


def _cfg(overrides: list[str], steps: int, name: str, eval_every: int):
    from disttrain.config.load import load_config

    return load_config(REPO / "configs" / "demo.yaml", [
        *overrides, f"train.steps={steps}", f"train.eval_every={eval_every}", "train.sample_tokens=0",
        "checkpoint.every_steps=0", "checkpoint.save_final=false", "checkpoint.resume=none",
        "metrics.comm_profile_every=0", "metrics.log_every=1", f"run.dir={REPO / 'runs' / 'bench-compression'}",
        f"run.name={name}"])


def _train(runtime, overrides: list[str], steps: int, name: str, eval_every: int = 0) -> list[dict]:
    import json

    from disttrain.train.builder import build_run
    from disttrain.train.loop import Trainer

    cfg = _cfg(overrides, steps, name, eval_every)
    Trainer(build_run(cfg, runtime)).fit()
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def python_all_reduce_bytes(run_steps) -> tuple[float, float]:
    """(bytes, calls) per step of every `torch.distributed.all_reduce` called from Python, on any thread.
    The profiler misses PowerSGD's P and Q all-reduces (launched from future callbacks on gloo's thread);
    a wrapper around the function sees them. DDP's own bucket all-reduce (no hook) is issued from C++ and
    is not seen here: that row is the profiler's."""
    import threading

    import torch.distributed as dist

    original, lock = dist.all_reduce, threading.Lock()
    totals = []
    for n in (SHORT, SHORT + EXTRA):
        seen = {"bytes": 0, "calls": 0}

        def counting(tensor, *args, _seen=seen, **kwargs):
            with lock:
                _seen["bytes"] += tensor.numel() * tensor.element_size()
                _seen["calls"] += 1
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        try:
            run_steps(n)
        finally:
            dist.all_reduce = original
        totals.append(seen)
    return ((totals[1]["bytes"] - totals[0]["bytes"]) / EXTRA, (totals[1]["calls"] - totals[0]["calls"]) / EXTRA)


def worker(steps: int, reps: int, out: Path) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_counts import per_step

    from disttrain.distributed.env import detect_env
    from disttrain.distributed.runtime import init_distributed, shutdown

    runtime = init_distributed(detect_env(), "gloo", 300)
    rows = {hook: {"step_s": []} for hook in HOOKS}
    try:
        for hook, overrides in HOOKS.items():
            run_steps = lambda n, o=overrides: _train(runtime, [*o, "optim.warmup_steps=0"], n, "counts")  # noqa: E731
            counts = per_step(run_steps)
            rows[hook]["profiler_all_reduce_bytes"] = counts.get("all_reduce bytes", 0.0)
            rows[hook]["profiler_all_reduce_count"] = counts.get("all_reduce count", 0.0)
            wrapped, calls = python_all_reduce_bytes(run_steps)
            rows[hook]["python_all_reduce_bytes"], rows[hook]["python_all_reduce_count"] = wrapped, calls
            # A hook's communication is all Python-issued; without one DDP's buckets go from C++.
            rows[hook]["all_reduce_bytes"] = wrapped if overrides else counts.get("all_reduce bytes", 0.0)
            rows[hook]["all_reduce_count"] = calls if overrides else counts.get("all_reduce count", 0.0)
            recs = _train(runtime, overrides, steps, hook.replace(" ", "_"), eval_every=steps)
            losses = [r for r in recs if "loss" in r and "event" not in r]
            rows[hook]["loss"] = losses[-1]["loss"]
            rows[hook]["val_loss"] = [r["val_loss"] for r in recs if r.get("event") == "eval"][-1]
            dist.barrier()
        for rep in range(reps):
            for hook, overrides in HOOKS.items():
                recs = _train(runtime, overrides, 40, "timing")
                times = [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > WARMUP]
                rows[hook]["step_s"].append(statistics.median(times))
            if runtime.rank == 0:
                print(f"rep {rep + 1}/{reps}: " + ", ".join(f"{h} {rows[h]['step_s'][-1] * 1e3:.1f} ms" for h in HOOKS),
                      flush=True)
        if runtime.rank == 0:
            from disttrain.bench.results import write_results

            base = rows["none"]
            print("\n| hook | all-reduce bytes / step | vs none | all-reduces / step | step time ms, median "
                  "(range) | ratio to none, median (range) | loss @ {0} | val loss @ {0} |".format(steps))
            print("|---|---|---|---|---|---|---|---|")
            for hook, r in rows.items():
                ratios = [t / b for t, b in zip(r["step_s"], base["step_s"])]
                print(f"| {hook} | {r['all_reduce_bytes']:,.0f} (profiler {r['profiler_all_reduce_bytes']:,.0f}, "
                      f"wrapper {r['python_all_reduce_bytes']:,.0f}) | {base['all_reduce_bytes'] / r['all_reduce_bytes']:.1f}x "
                      f"smaller | {r['all_reduce_count']:.0f} | {statistics.median(r['step_s']) * 1e3:.1f} "
                      f"({min(r['step_s']) * 1e3:.1f}-{max(r['step_s']) * 1e3:.1f}) | {statistics.median(ratios):.3f} "
                      f"({min(ratios):.3f}-{max(ratios):.3f}) | {r['loss']:.4f} | {r['val_loss']:.4f} |")
            write_results(out, steps=steps, reps=reps, rows=rows)
    finally:
        shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "compression.json"))
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args.steps, args.reps, Path(args.out))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--steps", str(args.steps), "--reps", str(args.reps), "--out", args.out]
    sys.exit(subprocess.run(cmd, env=env, cwd=REPO).returncode)


if __name__ == "__main__":
    main()
