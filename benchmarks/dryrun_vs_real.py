"""The dry run against a real run of the same configs: 2 real gloo ranks measured by the same memory
tracker on real tensors (tests/workers/measure_step.py), then `disttrain.dryrun.simulate` per rank.

    python benchmarks/dryrun_vs_real.py --model 125m --out benchmarks/results/dryrun_vs_real_125m.json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="125m")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from disttrain.config import load_config
    from disttrain.dryrun.simulate import simulate
    from disttrain.resolve import resolve_run

    jobs = layouts(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(jobs))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "disttrain.distributed.agent", "--standalone", "--nproc-per-node=2",
                        str(REPO / "tests" / "workers" / "measure_step.py"), str(job_file), str(out_file)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
        real_s = time.perf_counter() - t0
        real = json.loads(out_file.read_text())
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
