"""Per-rank model-state bytes for ZeRO stages, measured on the real runtime. Run under torchrun:

    torchrun --nproc-per-node 2 -m disttrain.bench.model_states RUN_DIR [--model tiny] [--stages 0 1 2 3]
        [--override parallel.dp_replicate=2 ...]

Prints one `MEM {json}` line per rank and stage: parameter, gradient and optimizer-state bytes this
rank holds after one step (gradients measured before they are released), the parameter bytes
visible between forward and backward (whole for stages 0-2, shards for stage 3), and for stages 2-3
the unsharded gradients FSDP2 holds after a micro-batch run without gradient sync (accumulating). `launch` runs it
on this machine and returns those rows (tests and benchmarks use it).
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

import torch
import torch.distributed as dist

from disttrain.config import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import Runtime, init_distributed
from disttrain.observe.model_bytes import model_state_bytes, unsharded_grad_bytes
from disttrain.parallel.parallelize import gradient_sync_disabled
from disttrain.train.builder import build_run
from disttrain.process import exit_now


def measure(rt: Runtime, stage: int, model: str, run_dir: str, overrides: tuple[str, ...] = ()) -> dict:
    cfg = load_config(None, [f"model.name={model}", "train.global_batch_size=4", "data.seq_len=32",
                             "train.micro_batch_size=1", f"parallel.zero_stage={stage}", f"run.dir={run_dir}",
                             f"run.name=stage{stage}", "checkpoint.resume=none", *overrides])
    run = build_run(cfg, rt)
    engine = run.engine
    if run.layout.tp > 1 or run.layout.pp > 1:
        # Model-parallel layouts run the engine's own step (schedule, loss_parallel); its gradients
        # are kept for measuring by skipping the step's zero_grad.
        engine.optimizer.zero_grad = lambda set_to_none=True: None
        engine.train_step(next(run.loader), 1)
        held = model_state_bytes(engine.model, engine.optimizer)
        del run, engine
        gc.collect()
        return {"stage": stage, "rank": rt.rank, "world": rt.world_size, "model": model, **held}
    x, y = next(run.loader)[0]
    accumulating = {}
    if stage >= 2:  # one micro-batch without gradient sync, as while accumulating: unsharded gradients stay
        with gradient_sync_disabled(engine.model):
            torch.nn.functional.cross_entropy(engine.model(x).flatten(0, 1), y.flatten()).backward()
        accumulating = {"unsharded_grads": unsharded_grad_bytes(engine.model)}
    logits = engine.model(x)
    after_forward = model_state_bytes(engine.model)["params"]
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    engine.optimizer.step()
    held = model_state_bytes(engine.model, engine.optimizer)
    del run, engine, logits
    gc.collect()
    return {"stage": stage, "rank": rt.rank, "world": rt.world_size, "model": model,
            "params_after_forward": after_forward, **held, **accumulating}


def launch(nproc: int, run_dir: str | Path, stages=(0, 1, 2, 3), overrides=(), model: str = "tiny",
           timeout: float = 600) -> list[dict]:
    """Run this module under torchrun with `nproc` local processes; every rank's rows, by rank and stage."""
    cmd = [sys.executable, "-m", "disttrain.distributed.agent", "--standalone", f"--nproc-per-node={nproc}",
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
    rt = init_distributed(detect_env(), "gloo", 60)
    for stage in args.stages:
        # One write per line: print() writes text and newline separately, and ranks share the pipe.
        sys.stdout.write("MEM " + json.dumps(measure(rt, stage, args.model, args.run_dir, tuple(args.override))) + "\n")
        sys.stdout.flush()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # skip the interpreter teardown (see disttrain.process)
