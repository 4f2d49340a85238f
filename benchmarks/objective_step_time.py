"""The planner's step time of the post-training objectives against measured runs on this machine: the forward a
frozen model adds (DPO's reference, a distillation teacher), from the runs' own phase times.

`tiny` at 256 tokens, 8 sequences (or pairs) a step in micro-batches of 2, fp32, one process, on the test suite's
pairs and conversations and its 6-layer, 256-wide Hugging Face teacher. Per repetition the four runs alternate
(lm, simpo, dpo, distill); each figure is the median over the steps after the first 3. The planner's frozen
forward is a third of a training step's FLOPs at the frozen model's shape, so:
  DPO's reference: predicted = (simpo's forward + backward) / 3, measured = dpo's forward - simpo's forward;
  the teacher:     predicted = FLOP ratio teacher/student x (lm's forward + backward) / 3,
                   measured = distill's forward - lm's forward.
The ratios take the machine's speed at that moment out (it swings 2-3x here).

    python benchmarks/objective_step_time.py [--reps 2] [--steps 14]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = ["model.name=tiny", "model.vocab_size=384", "data.seq_len=256", "train.global_batch_size=8",
        "train.micro_batch_size=2", "precision.compute_dtype=fp32", "metrics.log_every=1", "train.eval_every=0",
        "checkpoint.resume=none", "checkpoint.save_final=false", "checkpoint.every_steps=0", "train.sample_tokens=0"]
WARMUP = 3


def assets(root: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from test_plan_objectives import make_data

    make_data(root)
    return {"lm": [f"data.source={root}/chats"], "simpo": [f"data.source={root}/pairs", "train.objective=simpo"],
            "dpo": [f"data.source={root}/pairs", "train.objective=dpo"],
            "distill": [f"data.source={root}/chats", "train.objective=distill", f"distill.teacher={root}/teacher"]}


def phases(name: str, overrides: list[str], steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "debug.yaml"), *BASE, *overrides,
           f"train.steps={steps}", f"run.dir={run_dir}", f"run.name={name}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    shutil.rmtree(run_dir / name, ignore_errors=True)
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env=env)
    recs = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "step_time_s" in r and r["step"] > WARMUP]
    return {k: statistics.median(r[k] for r in recs) for k in ("time_forward_s", "time_backward_s", "step_time_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from dataclasses import replace

    from disttrain.models import flops as F
    from disttrain.models.registry import MODEL_SHAPES
    from disttrain.plan.objective import teacher_shape

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = assets(root)
        ratio = F.model_flops_per_token(teacher_shape(str(root / "teacher")), 256) / \
            F.model_flops_per_token(replace(MODEL_SHAPES["tiny"], vocab_size=384), 256)
        for rep in range(args.reps):
            t = {name: phases(name, overrides, args.steps, root / "runs") for name, overrides in runs.items()}
            train = {n: t[n]["time_forward_s"] + t[n]["time_backward_s"] for n in t}
            ref = (train["simpo"] / 3, t["dpo"]["time_forward_s"] - t["simpo"]["time_forward_s"])
            teacher = (ratio * train["lm"] / 3, t["distill"]["time_forward_s"] - t["lm"]["time_forward_s"])
            for what, (predicted, measured) in (("dpo reference", ref), ("distill teacher", teacher)):
                print(f"rep {rep + 1} {what}: predicted {predicted * 1e3:.0f} ms, measured {measured * 1e3:.0f} ms, "
                      f"error {predicted / measured - 1:+.1%}", flush=True)
            print(f"rep {rep + 1} step s: " + ", ".join(f"{n} {v['step_time_s']:.3f}" for n, v in t.items()))


if __name__ == "__main__":
    main()
