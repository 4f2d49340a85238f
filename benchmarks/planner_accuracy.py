"""Estimator error table: what `disttrain estimate` predicts per rank against what the runtime holds on
this machine, for every layout the CPU runtime supports (ZeRO 0-3 on 1, 2, 4 ranks, HSDP 2x2) and
activations of the `debug`/`tiny` models under each recomputation mode.

    python benchmarks/planner_accuracy.py [--out benchmarks/results/planner_accuracy.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from disttrain.bench.activations import saved_activation_bytes
from disttrain.bench.model_states import launch
from disttrain.models.registry import MODEL_SHAPES
from disttrain.layout.layout import Layout
from disttrain.plan.memory import model_state_bytes, stage_activation_bytes

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [(n, [], {"dp_shard": n}) for n in (1, 2, 4)] + [
    (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"], {"dp_replicate": 2, "dp_shard": 2})]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "planner_accuracy.json"))
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-planner"
    shape = MODEL_SHAPES["tiny"]
    psi = shape.num_params()
    rows = []
    print("Model states, tiny (per rank, worst rank; MiB predicted / measured, error):\n")
    print("| ranks | layout | stage | params | grads | optimizer |\n|---|---|---|---|---|---|")
    for nproc, overrides, dims in LAYOUTS:
        stages = [0, 1, 2, 3] if not overrides else [2, 3]
        for stage in stages:
            got = launch(nproc, run_dir, stages=[stage], overrides=overrides)
            pred = model_state_bytes(psi, Layout(zero_stage=stage, param_dtype="fp32", **dims), "runtime")
            cells, row = [], {"ranks": nproc, "layout": dims, "stage": stage}
            for key in ("params", "grads", "optimizer"):
                measured = max(r[key] for r in got)
                p = getattr(pred, key)
                row[key] = {"predicted": p, "measured": measured, "error": p / measured - 1}
                cells.append(f"{p / 2**20:.2f} / {measured / 2**20:.2f} ({p / measured - 1:+.1%})")
            rows.append(row)
            label = ", ".join(f"{k}={v}" for k, v in dims.items())
            print(f"| {nproc} | {label} | {stage} | " + " | ".join(cells) + " |", flush=True)

    print("\nActivations saved for backward (bytes predicted / measured, error):\n")
    print("| model | micro-batch x seq | dtype | recompute | predicted | measured | error |\n|---|---|---|---|---|---|---|")
    acts = []
    for model in ("debug", "tiny"):
        for mb, seq in ((1, 64), (4, 256)):
            for dtype in ("fp32", "bf16"):
                for recompute in ("none", "selective", "full"):
                    measured = saved_activation_bytes(MODEL_SHAPES[model], mb, seq, recompute,
                                                      {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
                    layout = Layout(micro_batch_size=mb, global_batch_size=mb, seq_len=seq,
                                    activation_checkpointing=recompute, param_dtype=dtype)
                    predicted = stage_activation_bytes(MODEL_SHAPES[model], layout, 0, fused_norm=False).saved
                    acts.append({"model": model, "micro_batch": mb, "seq_len": seq, "dtype": dtype,
                                 "recompute": recompute, "predicted": predicted, "measured": measured})
                    print(f"| {model} | {mb} x {seq} | {dtype} | {recompute} | {predicted:,.0f} | {measured:,} | "
                          f"{predicted / measured - 1:+.4%} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model_states": rows, "activations": acts}, indent=1))


if __name__ == "__main__":
    main()
