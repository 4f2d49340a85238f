"""The planner's step time against measured runs on this machine: `disttrain estimate --time --hardware`
with a profile from `disttrain bench hardware`, for DDP, ZeRO-2, ZeRO-3, TP=2, PP=2 (1F1B and GPipe) at
`tiny` and `125m` on 2 processes, fp32.

Each layout trains `--steps` steps of configs/bench.yaml per repetition (layouts interleaved within a
repetition); the measured figure is the median `step_time_s` of the steps after the first 3, the
median over repetitions, with the range. The error is predicted / measured - 1.

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
    from disttrain.config import load_config
    from disttrain.layout import Layout
    from disttrain.models.registry import model_shape
    from disttrain.plan.estimate import estimate
    from disttrain.plan.profile import profile_cluster

    cfg = load_config(REPO / "configs" / "bench.yaml", overrides(model, layout))
    lay = Layout.from_config(cfg, world_size=2, device_type="cpu")
    shape = model_shape(cfg.model)
    return estimate(shape, lay, profile_cluster(profile, 2, model, shape), model=model).time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=None, help="profile to use (default: measure one first)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: tiny 12, 125m 8)")
    parser.add_argument("--models", default="tiny,125m")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "step_time_accuracy.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-step-time"
    hw = Path(args.hardware or run_dir / "hardware.json")
    if not args.hardware:
        run_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "disttrain", "bench", "hardware", "--out", str(hw)], check=True, cwd=REPO)
    profile = json.loads(hw.read_text())
    models = args.models.split(",")
    steps = {"tiny": 12, "125m": 8}
    measured: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.reps):
        for model in models:
            for layout in LAYOUTS:
                t = measure(model, layout, args.steps or steps[model], run_dir)
                measured.setdefault((model, layout), []).append(t)
                print(f"rep {rep + 1}: {model} {layout}: {t * 1e3:.1f} ms", flush=True)
    rows = []
    print("\n| model | layout | predicted ms (compute + optimizer + bubble + comm) | measured ms, median (range) | error |")
    print("|---|---|---|---|---|")
    for (model, layout), times in measured.items():
        p = predict(model, layout, profile)
        med = statistics.median(times)
        parts = f"{p.compute_s * 1e3:.0f} + {p.optimizer_s * 1e3:.0f} + {p.bubble_s * 1e3:.0f} + " \
                f"{(p.tp_comm_s + p.pp_comm_s + p.dp_exposed_s) * 1e3:.0f}"
        print(f"| {model} | {layout} | {p.step_s * 1e3:.0f} ({parts}) | {med * 1e3:.0f} ({min(times) * 1e3:.0f}-"
              f"{max(times) * 1e3:.0f}) | {p.step_s / med - 1:+.1%} |")
        rows.append({"model": model, "layout": layout, "predicted": p.as_dict(), "measured_s": times,
                     "error": p.step_s / med - 1})
    from disttrain.bench.results import write_results

    write_results(args.out, hardware=profile, rows=rows)


if __name__ == "__main__":
    main()
