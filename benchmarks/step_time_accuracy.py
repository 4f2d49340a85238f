"""The planner's step time against measured runs on this machine: `disttrain estimate --time --hardware`
with a profile from `disttrain bench hardware`, for DDP, ZeRO-2, ZeRO-3, TP=2, PP=2 (1F1B and GPipe) at
`tiny` and `125m` on 2 processes, fp32.

Each repetition measures a hardware profile per model at that model's micro-batch shape (this machine's
rates drift over minutes; matmul rates depend on the tokens per product), then trains `--steps` steps of
configs/bench.yaml per layout of that model; a run's figure is the median `step_time_s`
of the steps after the first 3. Each repetition's prediction uses that repetition's profile; the error
is predicted / measured - 1 per repetition, reported as median and range.

    python benchmarks/step_time_accuracy.py [--hardware hardware.json] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"DDP": ["parallel.zero_stage=0"], "ZeRO-2": ["parallel.zero_stage=2"], "ZeRO-3": ["parallel.zero_stage=3"],
           "TP=2": ["parallel.tp=2"], "PP=2 1F1B": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
           "PP=2 GPipe": ["parallel.pp=2", "parallel.pp_schedule=gpipe"]}
MODELS = {"tiny": ["model.name=tiny", "data.seq_len=256", "train.global_batch_size=16", "train.micro_batch_size=4"],
          "125m": ["model.name=125m", "data.seq_len=128", "train.global_batch_size=4", "train.micro_batch_size=1"]}
WARMUP = 3


def overrides(model: str, layout: str) -> list[str]:
    return [*MODELS[model], *LAYOUTS[layout], "precision.compute_dtype=fp32", "metrics.log_every=1",
            "metrics.comm_profile_every=0", "checkpoint.resume=none", "checkpoint.save_final=false",
            "train.eval_every=0", "train.sample_tokens=0"]


def measure(model: str, layout: str, steps: int, run_dir: Path) -> float:
    name = f"{model}_{layout}".replace(" ", "_").replace("=", "")
    cmd = [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "bench.yaml"),
           *overrides(model, layout), f"train.steps={steps}", f"run.dir={run_dir}", f"run.name={name}",
           "--nproc-per-node", "2"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    recs = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > WARMUP)


def predict(model: str, layout: str, profile: dict):
    from disttrain.config.load import load_config
    from disttrain.plan.estimate import estimate
    from disttrain.plan.profile import profile_cluster
    from disttrain.config.resolve import resolve_run

    cfg = load_config(REPO / "configs" / "bench.yaml", overrides(model, layout))
    resolved = resolve_run(cfg, 2, "cpu")
    lay, shape = resolved.layout, resolved.shape
    return estimate(shape, lay, profile_cluster(profile, 2, model, shape), model=model).time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=None, help="profile to use (default: measure one first)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: tiny 12, 125m 8)")
    parser.add_argument("--models", default="tiny,125m")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="a subset of " + ", ".join(LAYOUTS))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "step_time_accuracy.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-step-time"
    run_dir.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    steps = {"tiny": 12, "125m": 8}
    # name -> [(measured s, predicted StepTime)] per repetition; each repetition measures its own profile
    # first (this machine's memory and network rates drift by 2x over minutes), unless one is given.
    results: dict[tuple[str, str], list] = {}
    profiles = []
    for rep in range(args.reps):
        for model in models:
            # the profile at this model's micro-batch shape: matmul rates depend on the tokens per product
            hw = Path(args.hardware) if args.hardware else run_dir / f"hardware_{rep}_{model}.json"
            if not args.hardware:
                setting = dict(o.split("=", 1) for o in MODELS[model])
                subprocess.run([sys.executable, "-m", "disttrain", "bench", "hardware", "--models", model,
                                "--micro-batch", setting["train.micro_batch_size"], "--seq-len",
                                setting["data.seq_len"], "--out", str(hw)], check=True, cwd=REPO)
            profile = json.loads(hw.read_text())
            profiles.append(profile)
            for layout in args.layouts.split(","):
                t = measure(model, layout, args.steps or steps[model], run_dir)
                p = predict(model, layout, profile)
                results.setdefault((model, layout), []).append((t, p))
                print(f"rep {rep + 1}: {model} {layout}: measured {t * 1e3:.1f} ms, predicted {p.step_s * 1e3:.1f} ms",
                      flush=True)
    rows = []
    print("\n| model | layout | predicted ms (compute + optimizer + bubble + comm), median | measured ms, median "
          "(range) | error per repetition, median (range) |")
    print("|---|---|---|---|---|")
    for (model, layout), pairs in results.items():
        times = [t for t, _ in pairs]
        errors = [p.step_s / t - 1 for t, p in pairs]
        mid = sorted(pairs, key=lambda tp: tp[1].step_s)[len(pairs) // 2][1]
        parts = f"{mid.compute_s * 1e3:.0f} + {mid.optimizer_s * 1e3:.0f} + {mid.bubble_s * 1e3:.0f} + " \
                f"{(mid.tp_comm_s + mid.pp_comm_s + mid.dp_exposed_s) * 1e3:.0f}"
        print(f"| {model} | {layout} | {mid.step_s * 1e3:.0f} ({parts}) | {statistics.median(times) * 1e3:.0f} "
              f"({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}) | {statistics.median(errors):+.1%} "
              f"({min(errors):+.1%} to {max(errors):+.1%}) |")
        rows.append({"model": model, "layout": layout, "measured_s": times, "errors": errors,
                     "predicted": [p.as_dict() for _, p in pairs]})
    from disttrain.bench.results import write_results

    write_results(args.out, profiles=profiles, rows=rows)


if __name__ == "__main__":
    main()
