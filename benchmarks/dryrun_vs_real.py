"""The dry run against a real run of the same configs: 2 real gloo ranks measured by the same memory
tracker on real tensors (tests/workers/measure_step.py), then `disttrain.dryrun.simulate` per rank.

    python benchmarks/dryrun_vs_real.py --model 125m --out benchmarks/results/dryrun_vs_real_125m.json

The dry run runs the CPU's kernels on fake tensors while it stands for a GPU rank. Where a kernel keeps
other tensors for backward on a GPU than on the CPU, only a GPU can tell: `--saved-by-device` (on a
machine with CUDA) counts what autograd keeps for one decoder block on each device.

    python benchmarks/dryrun_vs_real.py --saved-by-device --out saved_by_device.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layouts(model: str) -> dict[str, list[str]]:
    common = [f"model.name={model}", "data.seq_len=128", "train.micro_batch_size=2"]
    return {"DDP, 2 micro-batches": [*common, "train.global_batch_size=8", "parallel.dp_shard=1", "parallel.dp_replicate=2"],
            "ZeRO-3, 2 micro-batches": [*common, "train.global_batch_size=8", "parallel.dp_shard=2", "parallel.zero_stage=3"],
            "TP=2": [*common, "train.global_batch_size=4", "parallel.dp_shard=1", "parallel.tp=2"],
            "PP=2 (1F1B)": [*common, "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.dp_shard=1",
                            "parallel.pp=2"]}


def checkpointing(model: str) -> dict[str, list[str]]:
    """The layouts above (but TP) with selective and full activation checkpointing (the default is none)."""
    out = {}
    for name, overrides in layouts(model).items():
        if name != "TP=2":
            for ac in ("selective", "full"):
                out[f"{name}, {ac} checkpointing"] = [*overrides, f"parallel.activation_checkpointing={ac}"]
    return out


def pipelines(model: str) -> dict[str, list[str]]:
    """Each multi-stage pipeline schedule (two stages per rank) over 4 micro-batches, with each checkpointing
    mode it allows (zero-bubble: none), in fp32 and with bf16 autocast."""
    common = [f"model.name={model}", "data.seq_len=128", "train.micro_batch_size=1", "train.global_batch_size=4",
              "parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_microbatches=4"]
    out = {}
    for schedule in ("interleaved_1f1b", "zero_bubble"):
        for ac in ("none",) if schedule == "zero_bubble" else ("none", "selective", "full"):
            for dtype in ("fp32", "bf16"):
                out[f"PP=2 {schedule}, {ac} checkpointing, {dtype}"] = [
                    *common, f"parallel.pp_schedule={schedule}", f"parallel.activation_checkpointing={ac}",
                    f"precision.compute_dtype={dtype}"]
    return out


CASES = {"layouts": layouts, "checkpointing": checkpointing, "pipelines": pipelines}


def saved_by_device(dim: int = 1024, seq: int = 2048) -> dict:
    """Bytes autograd keeps for one Llama block (unique storages, parameters excluded), by tensor shape and
    dtype, on the CPU and on CUDA, for bf16 weights, fp32 weights under bf16 autocast, and fp32; with and
    without the block's RMSNorms, so the norms' own share shows."""
    import torch

    from disttrain.models.llama.model import TransformerBlock, rotary_tables
    from disttrain.models.shape import ModelShape

    shape = ModelShape(dim=dim, n_layers=1, n_heads=dim // 64, n_kv_heads=dim // 64, vocab_size=256,
                       ffn_hidden_dim=4 * dim, max_seq_len=seq)
    out = {"torch": torch.__version__, "dim": dim, "seq": seq}
    for device in ("cpu", "cuda"):
        for regime in ("bf16", "fp32+autocast", "fp32"):
            for norms in (True, False):
                torch.manual_seed(0)
                block = TransformerBlock(shape).to(device)
                if not norms:
                    block.attention_norm, block.ffn_norm = torch.nn.Identity(), torch.nn.Identity()
                wdtype = torch.bfloat16 if regime == "bf16" else torch.float32
                block = block.to(wdtype)
                cos, sin = rotary_tables(shape.head_dim, seq, 10000.0, device=device)
                x = torch.randn(1, seq, dim, device=device, dtype=wdtype, requires_grad=True)
                params = {p.untyped_storage().data_ptr() for p in block.parameters()}
                params.add(x.untyped_storage().data_ptr())
                held: dict[int, tuple] = {}

                def pack(t):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in params:
                        held.setdefault(ptr, (t.untyped_storage().nbytes(), str(t.dtype), tuple(t.shape)))
                    return t

                cast = torch.autocast(device, dtype=torch.bfloat16, enabled=regime == "fp32+autocast")
                with cast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = block(x, cos, sin)
                y.float().sum().backward()
                out[f"{device} {regime} {'with' if norms else 'without'} norms"] = {
                    "bytes": sum(v[0] for v in held.values()), "tensors": sorted(held.values(), reverse=True)}
    return out


def measure_real(jobs: dict) -> tuple[dict, float]:
    """Run each job's real step on 2 gloo ranks (tests/workers/measure_step.py): (measured bytes per job, seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(jobs))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "disttrain.launch.agent", "--standalone", "--nproc-per-node=2",
                        str(REPO / "tests" / "workers" / "measure_step.py"), str(job_file), str(out_file)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
        return json.loads(out_file.read_text()), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="125m")
    parser.add_argument("--out", default=None)
    parser.add_argument("--saved-by-device", action="store_true")
    parser.add_argument("--cases", default="layouts", help=f"comma-separated: {', '.join(CASES)}")
    args = parser.parse_args()
    if args.saved_by_device:
        result = saved_by_device()
        for k, v in result.items():
            if isinstance(v, dict):
                print(f"{k:40s} {v['bytes']:>14,}")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return
    sys.path.insert(0, str(REPO / "tests"))
    from disttrain.config.load import load_config
    from disttrain.dryrun.simulate import simulate
    from disttrain.config.resolve import resolve_run

    jobs = {k: v for case in args.cases.split(",") for k, v in CASES[case](args.model).items()}
    real, real_s = measure_real(jobs)
    rows = []
    for name, overrides in jobs.items():
        cfg = load_config(None, overrides)
        resolved = resolve_run(cfg, 2, "cpu")
        layout = resolved.layout
        for rank in range(layout.pp if layout.pp > 1 else 1):
            fake = simulate(cfg, resolved, rank * (2 // layout.pp))
            measured = real[name][rank * (2 // layout.pp)]
            row = {"layout": name, "rank": fake.rank, "real_peak_bytes": measured["peak_bytes"],
                   "dry_run_peak_bytes": fake.peak_bytes, "real": measured["bytes"], "dry_run": fake.bytes,
                   "collectives_equal": fake.collectives == measured["collectives"], "dry_run_s": round(fake.seconds, 1)}
            rows.append(row)
            diff = max(abs(fake.bytes[k] - measured["bytes"][k]) for k in fake.bytes)
            print(f"| {name} | {fake.rank} | {measured['peak_bytes']:,} | {fake.peak_bytes:,} | {diff:,} | "
                  f"{row['collectives_equal']} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": args.model,
                                              "real_launch_s": round(real_s, 1), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
