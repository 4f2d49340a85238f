"""Collectives and host syncs per non-logging training step, counted with torch.profiler: disttrain against
hand-written loops (DDP; FSDP2 with and without resharding after forward; tensor parallel with the same
plan; a 1F1B pipeline with the same split), on 2 processes. Counts are immune to this machine's noise.

Each variant trains S and S+K steps under the profiler (recording shapes); the difference divided by K is
one steady-state step, whatever happens once (model set-up, the final log record, process-group work).
Host syncs are `aten::_local_scalar_dense` calls (`.item()`, `float(t)`, `bool(t)`) of device tensors: on a
GPU each one waits for the device. AdamW's per-parameter step counters are CPU tensors (not capturable), so
their reads, inside `Optimizer.step`, are counted apart.

    python benchmarks/step_counts.py [--micro-batch 8]      # re-launches itself under torchrun
    python benchmarks/step_counts.py --hf   # the HF workload: disttrain ZeRO-3 vs fully_shard per decoder layer
    python benchmarks/step_counts.py --moe  # debug-moe at ep=2, ZeRO-3: disttrain vs workloads/plain_moe_ep.py
    python benchmarks/step_counts.py --moe --stacks  # ... and each host sync per step by the line it comes from
    python benchmarks/step_counts.py --muon  # disttrain's AdamW against its Muon on DDP, ZeRO-3 and TP

`--stacks` adds, per step, the profiler's host syncs by the ops they ran inside, and the Python calls that
would wait for a GPU by the line of disttrain or the workload that made them (`sync_sources`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "benchmarks" / "workloads"
LAYOUTS = {"ddp": ["parallel.zero_stage=0"], "zero2": ["parallel.zero_stage=2"], "zero3": ["parallel.zero_stage=3"],
           "tp2": ["parallel.tp=2"], "pp2 1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"]}
SHORT, EXTRA = 3, 4  # steps of the short run; the long run has EXTRA more
STACKS = False  # --stacks: also count host syncs per source line


def count_events(prof) -> Counter:
    from disttrain.observe.breakdown import collective_kind

    counts: Counter = Counter()
    for e in prof.events():
        kind = collective_kind(e.name)
        if kind is not None:
            size = sum(math.prod(s) * _itemsize(t) for s, t in zip(e.input_shapes, e.input_dtypes) if t)
            counts[f"{kind} count"] += 1
            counts[f"{kind} bytes"] += size
        elif e.name == "aten::_local_scalar_dense":
            kind = "optimizer step counters" if _inside(e, "Optimizer.step") else "host syncs"
            counts[kind] += 1
            if STACKS and kind == "host syncs":
                counts[f"host sync in {_parents(e)}"] += 1
    return counts


def _parents(event, depth: int = 5) -> str:
    names, parent = [], event.cpu_parent
    while parent is not None and len(names) < depth:
        names.append(parent.name)
        parent = parent.cpu_parent
    return " <- ".join(names) or "(top level)"


def _inside(event, prefix: str) -> bool:
    """Whether a profiler event ran inside a record named `prefix...` (AdamW keeps its step counters on the
    CPU unless capturable: reading them is no device sync on a GPU)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def _itemsize(dtype_name: str) -> int:
    """Bytes per element of a profiler dtype name ('float', 'c10::BFloat16', 'long int', ...)."""
    sizes = {"double": 8, "long int": 8, "half": 2, "bfloat16": 2, "short int": 2, "bool": 1,
             "unsigned char": 1, "signed char": 1}
    return sizes.get(dtype_name.replace("c10::", "").lower(), 4)  # float, int


SYNC_CALLS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy")


def sync_sources():
    """A torch-function mode counting the Python calls that wait for the device on a GPU (`.item()`, `.tolist()`,
    `bool(t)`, `float(t)`, `nonzero()`, `.cpu()`, and `torch.tensor(list)` on a device: a blocking copy), by
    the innermost line of this repository's code (disttrain, the workloads) and the torch line under it. The
    profiler's `_local_scalar_dense` count misses `.tolist()` and copies, and counts reads inside torch's CPU
    kernels that a GPU never makes; the profiler's own `with_stack` fails to parse under torch 2.13 here."""
    import traceback

    import torch
    from torch.overrides import TorchFunctionMode

    class Sources(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.counts: Counter = Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "_grouped_mm":  # torch's CPU kernel reads each group's end offset on the host
                self.counts["grouped GEMM calls in forward"] += 1
            if name in SYNC_CALLS or (func is torch.tensor and (kwargs or {}).get("device") is not None):
                stack = traceback.extract_stack()[:-1]
                ours = [f for f in stack if "/src/disttrain/" in f.filename or "/benchmarks/" in f.filename]
                if ours and not any(f.name == "step" and "/optim/" in f.filename for f in stack):
                    inner = stack[-1]
                    where = f"{ours[-1].filename.split('/src/')[-1].split('/benchmarks/')[-1]}:{ours[-1].lineno}"
                    if inner is not ours[-1]:
                        where += f" via {inner.filename.split('site-packages/')[-1]}:{inner.lineno}"
                    self.counts[f"python sync {name} at {where}"] += 1
            return func(*args, **(kwargs or {}))

    return Sources()


def per_step(run_steps) -> dict:
    from torch.profiler import ProfilerActivity, profile

    totals = []
    for steps in (SHORT, SHORT + EXTRA):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with sync_sources() if STACKS else contextlib.nullcontext() as sources:
                run_steps(steps)
        totals.append(count_events(prof) + (sources.counts if STACKS else Counter()))
    keys = sorted(set(totals[0]) | set(totals[1]))
    return {k: (totals[1][k] - totals[0][k]) / EXTRA for k in keys if totals[1][k] != totals[0][k]}


def disttrain_steps(runtime, overrides: list[str], micro_batch: int):
    from disttrain.config.load import load_config
    from disttrain.train.builder import build_run
    from disttrain.train.loop import Trainer

    def run(steps: int) -> None:
        cfg = load_config(REPO / "configs" / "bench.yaml", [
            *overrides, f"train.steps={steps}", f"train.micro_batch_size={micro_batch}", "metrics.log_every=100000",
            "metrics.comm_profile_every=0", f"run.dir={REPO / 'runs' / 'bench-counts'}", "run.name=counts",
            "train.sample_tokens=0", "train.eval_every=0"])
        Trainer(build_run(cfg, runtime)).fit()

    return run


def handwritten_steps(layout: str, micro_batch: int):
    import handwritten  # benchmarks/workloads/handwritten.py

    return lambda steps: handwritten.train(layout, steps, micro_batch)


def hf_pair(runtime) -> dict:
    """benchmarks/hf_frameworks.py's model and batch (micro-batch 8 x 256 per rank, no accumulation)."""
    import hf_plain_fsdp
    from hf_common import HF_CONFIG, MICRO_BATCH, SEQ_LEN
    from transformers import LlamaConfig

    directory = REPO / "runs" / "bench-counts" / "hf_model"
    if runtime.rank == 0:
        LlamaConfig(**HF_CONFIG, use_cache=False).save_pretrained(directory)
    import torch.distributed as dist

    dist.barrier()
    overrides = [f"model.hf={directory}", f"data.seq_len={SEQ_LEN}", f"train.global_batch_size={2 * MICRO_BATCH}",
                 "parallel.zero_stage=3"]
    rows = {"disttrain hf zero3": per_step(disttrain_steps(runtime, overrides, MICRO_BATCH))}
    dist.barrier()
    rows["hand-written hf fsdp2"] = per_step(hf_plain_fsdp.train)
    return rows


def moe_pair(runtime, micro_batch: int) -> dict:
    """debug-moe at ep=2 under ZeRO-3 (no balancing loss or bias) against the hand-written expert-parallel loop."""
    import plain_moe_ep
    import torch.distributed as dist

    overrides = ["model.name=debug-moe", "parallel.ep=2", "parallel.zero_stage=3", "model.moe.aux_loss_coef=0",
                 "model.moe.bias_update_rate=0"]
    rows = {"disttrain moe ep2 zero3": per_step(disttrain_steps(runtime, overrides, micro_batch))}
    dist.barrier()
    rows["hand-written moe ep2 fsdp2"] = per_step(lambda steps: plain_moe_ep.train(steps, micro_batch))
    return rows


def muon_pairs(runtime, micro_batch: int) -> dict:
    """What optim.name=muon issues per step against AdamW on the same layout (train/muon.py: one broadcast of
    each orthogonalised matrix from its owner, after a gather of the update where it is sharded)."""
    import torch.distributed as dist

    rows = {}
    for layout in ("ddp", "zero3", "tp2"):
        for optimizer in ("adamw", "muon"):
            rows[f"disttrain {layout} {optimizer}"] = per_step(disttrain_steps(
                runtime, [*LAYOUTS[layout], f"optim.name={optimizer}"], micro_batch))
            dist.barrier()
    return rows


def worker(micro_batch: int, out: Path, hf: bool = False, moe: bool = False, muon: bool = False) -> None:
    import torch.distributed as dist

    from disttrain.distributed.env import detect_env
    from disttrain.distributed.runtime import init_distributed, shutdown

    runtime = init_distributed(detect_env(), "gloo", 300)
    rows = {}
    try:
        for layout, overrides in ({} if hf or moe or muon else LAYOUTS).items():
            rows[f"disttrain {layout}"] = per_step(disttrain_steps(runtime, overrides, micro_batch))
            dist.barrier()
            rows[f"hand-written {layout}"] = per_step(handwritten_steps(layout, micro_batch))
            dist.barrier()
            if runtime.rank == 0:
                print(f"{layout}: disttrain {rows[f'disttrain {layout}']}\n      hand-written "
                      f"{rows[f'hand-written {layout}']}", flush=True)
        if hf or moe or muon:
            rows = hf_pair(runtime) if hf else moe_pair(runtime, micro_batch) if moe else muon_pairs(runtime, micro_batch)
            if runtime.rank == 0:
                print("\n".join(f"{name}: {row}" for name, row in rows.items()), flush=True)
        if runtime.rank == 0:
            from disttrain.bench.results import write_results

            write_results(out, micro_batch=micro_batch, steps=[SHORT, SHORT + EXTRA], rank0_per_step=rows)
    finally:
        shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--hf", action="store_true", help="only the Hugging Face workload's sharded pair")
    parser.add_argument("--moe", action="store_true", help="only the expert-parallel pair (debug-moe, ep=2)")
    parser.add_argument("--muon", action="store_true", help="only disttrain's AdamW against its Muon")
    parser.add_argument("--stacks", action="store_true", help="count host syncs per source line as well")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    global STACKS
    STACKS = args.stacks
    name = "step_counts_hf.json" if args.hf else "step_counts_moe.json" if args.moe else \
        "step_counts_muon.json" if args.muon else \
        f"step_counts_mb{args.micro_batch}.json"
    out = Path(args.out or REPO / "benchmarks" / "results" / name)
    if "LOCAL_RANK" in os.environ:
        worker(args.micro_batch, out, args.hf, args.moe, args.muon)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(WORKLOADS), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--micro-batch", str(args.micro_batch), "--out", str(out), *(["--hf"] if args.hf else []),
           *(["--moe"] if args.moe else []), *(["--muon"] if args.muon else []),
           *(["--stacks"] if args.stacks else [])]
    sys.exit(subprocess.run(cmd, env=env, cwd=REPO).returncode)


if __name__ == "__main__":
    main()
