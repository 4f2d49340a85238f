"""Checkpoint save/load throughput on the real runtime, against torch.save/torch.load of the same
state on the same disk. Run under torchrun:

    torchrun --nproc-per-node 2 -m disttrain.bench.checkpoint_io DIR [--model 125m] [--zero-stage 3] [--reps 3]

Each rank fills its optimizer state (one step), then times: a synchronous DCP save (committed),
an async save (blocking part, and until committed), a DCP load, and torch.save/torch.load of its
own state dict. Prints one `IO {json}` line per rank and repetition. DIR may be an fsspec URL
(s3://bucket/prefix): the same through DCP's fsspec storage, and the baseline is torch.save into memory
plus one PUT of the bytes (torch.load of one GET). `--writer s3torchconnector` puts s3torchconnector's DCP
writer and reader (AWS's CRT client) in place of DCP's fsspec storage for an s3:// DIR, everything else the same
(the commit still reads every object back through s3fs for its checksums): a benchmark of the two, not a path
disttrain trains with.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain.core import storage
from disttrain.checkpoint.manager import CheckpointManager
from disttrain.config.load import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import init_distributed
from disttrain.observe.model_bytes import iter_tensors, local_bytes, local_shard
from disttrain.train.builder import build_run
from disttrain.train.resume import Progress, train_state
from disttrain.launch.this_process import exit_now


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _use_s3torchconnector() -> None:
    """storage.dcp_writer/dcp_reader for s3:// through s3torchconnector. Its DCP classes take no endpoint: the
    client under them is made with AWS_ENDPOINT_URL (path-style addressing, as S3-compatible stores need)."""
    import os

    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    region, endpoint = os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), os.environ.get("AWS_ENDPOINT_URL")
    config = S3ClientConfig(force_path_style=endpoint is not None)

    def with_endpoint(obj):
        obj.fs = S3FileSystem(region, s3_client=S3Client(region, endpoint=endpoint, s3client_config=config))
        return obj

    storage.dcp_writer = lambda path: with_endpoint(S3StorageWriter(region, str(path), s3client_config=config))
    storage.dcp_reader = lambda path: with_endpoint(S3StorageReader(region, str(path), s3client_config=config))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--model", default="125m")
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--writer", choices=("fsspec", "s3torchconnector"), default="fsspec")
    args = parser.parse_args()
    if args.writer == "s3torchconnector":
        _use_s3torchconnector()
    runtime = init_distributed(detect_env(), "gloo", 600)
    root = args.dir
    remote = storage.is_url(root)
    cfg = load_config(None, [f"model.name={args.model}", "data.seq_len=16", f"train.global_batch_size={runtime.world_size}",
                             f"parallel.zero_stage={args.zero_stage}",
                             f"run.dir={'/tmp/disttrain-io' if remote else root}", "run.name=io",
                             "checkpoint.resume=none"])
    run = build_run(cfg, runtime)
    engine = run.engine
    engine.train_step(next(run.data.loader), 1)  # materialise AdamW state
    state = train_state(run, Progress())
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    nbytes = sum(local_bytes(v) for sd in (model_sd, optim_sd) for v in iter_tensors(sd))
    sync = CheckpointManager(storage.join(root, "sync"), runtime.rank)
    asyn = CheckpointManager(storage.join(root, "async"), runtime.rank, async_save=True)
    plain = storage.join(root, f"torch_rank{runtime.rank}.pt")
    save, load = (storage.torch_save, storage.torch_load) if remote else \
        (torch.save, lambda p: torch.load(p, weights_only=False))
    for rep in range(args.reps):
        row = {"rank": runtime.rank, "world": runtime.world_size, "rep": rep, "bytes": nbytes, "model": args.model,
               "store": root.split("://", 1)[0] if remote else "local", "writer": args.writer if remote else "file"}
        row["dcp_save_s"] = _timed(lambda: sync.save(rep + 1, engine, state))
        t0 = time.perf_counter()
        asyn.save(rep + 1, engine, state)
        row["async_blocking_s"] = time.perf_counter() - t0
        asyn.commit_pending()
        dist.barrier()
        row["async_total_s"] = time.perf_counter() - t0
        row["dcp_load_s"] = _timed(lambda: sync.load(sync.step_dir(rep + 1), engine))
        local = {"model": {k: local_shard(v) for k, v in model_sd.items()}, "optim": optim_sd}
        row["torch_save_s"] = _timed(lambda: save(local, plain))
        row["torch_load_s"] = _timed(lambda: load(plain))
        for key in ("dcp_save_s", "async_blocking_s", "dcp_load_s", "torch_save_s", "torch_load_s"):
            row[key[:-2] + "_mib_per_s"] = nbytes / 2**20 / max(row[key], 1e-9)
        sys.stdout.write("IO " + json.dumps(row) + "\n")  # one write: ranks share the pipe
        sys.stdout.flush()
        if runtime.rank == 0:
            for d in (storage.join(root, "sync"), storage.join(root, "async")):
                storage.rmtree(d)
        dist.barrier()
    del run, engine
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # skip the interpreter teardown (see disttrain.launch.this_process)
