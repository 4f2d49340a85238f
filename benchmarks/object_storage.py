"""Checkpoint save/load per rank to a loopback S3 server (moto's ThreadedMotoServer) against local disk.

    OMP_NUM_THREADS=1 python benchmarks/object_storage.py --models tiny 125m --launches 2 --reps 2
    make bench-env && OMP_NUM_THREADS=1 .bench-venv/bin/python benchmarks/object_storage.py --models tiny \
        --stores s3 s3torchconnector --launches 4 --out benchmarks/results/object_storage_writers.jsonl

Launches `disttrain.bench.checkpoint_io` on 2 ranks (ZeRO-3), alternating the stores per launch (interleaved, so
a change in machine load hits each): `local` disk, `s3` through DCP's fsspec storage (s3fs, what disttrain
uses), `s3torchconnector` through AWS's DCP writer and reader (a benchmark-only dependency, in
benchmarks/requirements-compare.txt). Each launch times `--reps` saves and loads. Writes every `IO` row to
`--out` and prints medians and ranges per model, store and operation. The S3 server runs in this process on
127.0.0.1: its throughput is moto's (Python, objects in memory), a lower bound for a real store's
per-connection rate, not a measure of one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = ("dcp_save_s", "async_blocking_s", "async_total_s", "dcp_load_s", "torch_save_s", "torch_load_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["tiny", "125m"])
    parser.add_argument("--launches", type=int, default=2, help="launches per model and store, interleaved")
    parser.add_argument("--reps", type=int, default=2, help="saves and loads per launch")
    parser.add_argument("--stores", nargs="+", default=["local", "s3"], choices=("local", "s3", "s3torchconnector"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "object_storage.jsonl"))
    args = parser.parse_args()
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "PYTHONPATH": str(REPO / "src")}
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1", aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(Bucket="bench")
    rows = []
    try:
        for model in args.models:
            for launch in range(args.launches):
                for store in args.stores:
                    with tempfile.TemporaryDirectory() as tmp:
                        target = f"s3://bench/{model}-{launch}-{store}" if store != "local" else tmp
                        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "disttrain.bench.checkpoint_io", target, "--model", model, "--reps",
                               str(args.reps), "--writer", "s3torchconnector" if store == "s3torchconnector"
                               else "fsspec"]
                        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
                        if done.returncode != 0:
                            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
                        found = [json.loads(line[3:]) for line in done.stdout.splitlines() if line.startswith("IO ")]
                        for row in found:
                            row["launch"], row["store"] = launch, store
                        rows += found
                        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))  # so far
                        print(f"{model} {store} launch {launch}: {len(found)} rows", flush=True)
    finally:
        server.stop()
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for model in args.models:
        for store in args.stores:
            mine = [r for r in rows if r["model"] == model and r["store"] == store]
            if not mine:
                continue
            mib = mine[0]["bytes"] / 2**20
            parts = []
            for key in KEYS:
                values = sorted(r[key] for r in mine)
                parts.append(f"{key} {statistics.median(values):.3f} ({values[0]:.3f}-{values[-1]:.3f})")
            print(f"{model} {store} ({mib:.1f} MiB per rank, n={len(mine)}): " + "; ".join(parts))


if __name__ == "__main__":
    main()
