"""Per-rank model-state bytes for ZeRO stages and TP/PP layouts, measured in the engine's own step.
Run under torchrun:

    torchrun --nproc-per-node 2 -m disttrain.bench.model_states RUN_DIR [--model tiny] [--stages 0 1 2 3]
        [--override parallel.dp_replicate=2 ...]

Prints one `MEM {json}` line per rank and stage (with `micro_batches`, this rank's count). `launch` runs
it on this machine and returns those rows (tests and benchmarks use it). Nothing of the engine is
replaced: a phase subscriber watches two real `train_step`s and reads the model's and optimizer's
tensors at named points of the second one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from disttrain.config.load import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import Runtime, init_distributed
from disttrain.observe.model_bytes import model_state_bytes, unsharded_grad_bytes
from disttrain.train.builder import build_run
from disttrain.train.phases import PhaseEvent, Subscriber
from disttrain.launch.this_process import exit_now

MEASURED_STEP = 2  # Adam's states exist only after step 1; every step releases its gradients as it ends


class ModelStateProbe(Subscriber):
    """Reads one step from outside. At "optimizer" enter of MEASURED_STEP the rank holds all three model
    states at once (parameters, reduced gradients, Adam states from step 1): the peak the planner sums.
    At exit of the first step-level forward, parameters as gathered between forward and backward (whole
    for stages 0-2, FSDP's root plus shards for stage 3). At exit of the first non-last backward, the
    unsharded gradients FSDP2 accumulates while gradient sync is off (none outside FSDP). A pipeline's
    forwards are its chunks (depth 1), so its rows have neither of the last two."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.row: dict = {}

    def enter(self, event: PhaseEvent) -> None:
        if event.step == MEASURED_STEP and event.name == "optimizer":
            self.row.update(model_state_bytes(self.model, self.optimizer))

    def exit(self, event: PhaseEvent) -> None:
        if event.step != MEASURED_STEP or event.depth != 0:
            return
        if event.name == "forward":
            self.row.setdefault("params_after_forward", model_state_bytes(self.model)["params"])
        elif event.name == "backward" and not event.last:
            self.row.setdefault("unsharded_grads", unsharded_grad_bytes(self.model))


def measure(runtime: Runtime, stage: int, model: str, run_dir: str, overrides: tuple[str, ...] = ()) -> dict:
    # Two micro-batches per rank at least (whatever the data-parallel degree), so accumulation is observed.
    cfg = load_config(None, [f"model.name={model}", f"train.global_batch_size={max(4, 2 * runtime.world_size)}",
                             "data.seq_len=32", "train.micro_batch_size=1", f"parallel.zero_stage={stage}",
                             f"run.dir={run_dir}", f"run.name=stage{stage}", "checkpoint.resume=none", *overrides])
    run = build_run(cfg, runtime)
    probe = ModelStateProbe(run.engine.model, run.engine.optimizer)
    run.engine.phases.subscribe(probe)
    for step in range(1, MEASURED_STEP + 1):
        batch = next(run.data.loader)
        run.engine.train_step(batch, step)
    row = {"stage": stage, "rank": runtime.rank, "world": runtime.world_size, "model": model,
           "micro_batches": len(batch), **probe.row}
    del run, probe
    gc.collect()
    return row


def launch(nproc: int, run_dir: str | Path, stages=(0, 1, 2, 3), overrides=(), model: str = "tiny",
           timeout: float = 600) -> list[dict]:
    """Run this module under torchrun with `nproc` local processes; every rank's rows, by rank and stage."""
    cmd = [sys.executable, "-m", "disttrain.launch.agent", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "disttrain.bench.model_states", str(run_dir), "--model", model, "--stages", *map(str, stages)]
    for o in overrides:
        cmd += ["--override", o]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"model_states on {nproc} processes exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(m) for m in re.findall(r"MEM (\{[^{}]*\})", proc.stdout)]
    return sorted(rows, key=lambda r: (r["rank"], r["stage"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--override", action="append", default=[], help="extra config key=value (repeatable)")
    args = parser.parse_args()
    runtime = init_distributed(detect_env(), "gloo", 60)
    for stage in args.stages:
        # One write per line: print() writes text and newline separately, and ranks share the pipe.
        sys.stdout.write("MEM " + json.dumps(measure(runtime, stage, args.model, args.run_dir, tuple(args.override))) + "\n")
        sys.stdout.flush()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # skip the interpreter teardown (see disttrain.launch.this_process)
