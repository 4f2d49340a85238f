"""`disttrain train`: the arguments, then one call: a self-launch under torch.distributed.run
(launch/self_launch.py), a run under Ray Train (launch/ray_train.py), or this rank's share of the run
(launch/worker.py)."""

from __future__ import annotations

import argparse
import sys

from disttrain.config.load import load_config
from disttrain.core.errors import UserError


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train from a YAML config (key=value overrides after it)")
    train.add_argument("config", help="YAML config file, e.g. configs/demo.yaml")
    launch = train.add_argument_group("self-launch (ignored under torchrun; torchrun's spellings such as "
                                      "--nproc_per_node are accepted too)")
    launch.add_argument("--nproc-per-node", "--nproc_per_node", default=None,
                        help="processes per node; 'auto' = all GPUs, or 2 on a CPU-only machine")
    launch.add_argument("--nnodes", default=None, help="node count or elastic range MIN:MAX (default 1)")
    launch.add_argument("--node-rank", "--node_rank", type=int, default=None)
    launch.add_argument("--max-restarts", "--max_restarts", type=int, default=None,
                        help="restart the worker group this often on failure")
    launch.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                        help="HOST:PORT of the rendezvous (multi-node)")
    launch.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d")
    launch.add_argument("--rdzv-id", "--rdzv_id", default=None)
    launch.add_argument("--shutdown-timeout", type=int, default=None,
                        help="seconds workers get to save an emergency checkpoint after SIGTERM/SIGUSR1 before the "
                             "agent kills them (default 120; keep it under the scheduler's grace period)")
    launch.add_argument("--rdzv-conf", default=None,
                        help="rendezvous settings key=value,... over disttrain's defaults (last_call_timeout=5, "
                             "keep_alive_interval=2, keep_alive_max_attempt=3)")
    launch.add_argument("--exit-barrier-timeout", type=int, default=None,
                        help="seconds a node whose workers finished waits for the other nodes (default 30; "
                             "torchrun's own is 300)")
    ray = train.add_argument_group("Ray Train (pip install 'disttrain[ray]'; --max-restarts applies too: default 0, "
                                   "or 3 with MIN:MAX)")
    ray.add_argument("--ray", action="store_true", help="train on Ray Train's workers (TorchTrainer)")
    ray.add_argument("--workers", default=None,
                     help="worker count N, or MIN:MAX: Ray restarts the group at the size available and disttrain "
                          "resumes at that world size (default: every GPU of the cluster, or 2 on CPU)")
    ray.add_argument("--ray-address", default=None,
                     help="HOST:PORT of a running Ray cluster (default: a local Ray instance of this machine)")
    ray.add_argument("--ray-resize-interval", type=float, default=None,
                     help="seconds between Ray's checks for capacity to grow a MIN:MAX group (default 60)")


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> None:
    from disttrain.distributed.env import under_torchrun
    from disttrain.launch import self_launch, worker

    cfg = load_config(args.config, overrides)
    ray_flags = [f for f in ("--workers", "--ray-address", "--ray-resize-interval")
                 if getattr(args, f[2:].replace("-", "_")) is not None]
    if args.ray or ray_flags:
        from disttrain.launch import ray_train

        torchrun_flags = [f"--{f.replace('_', '-')}" for f in ("nproc_per_node", *self_launch.FLAGS)
                          if f != "max_restarts" and getattr(args, f) is not None]
        if not args.ray:
            raise UserError(f"{ray_flags[0]} needs --ray (Ray Train's workers)")
        if under_torchrun() or torchrun_flags:
            where = torchrun_flags[0] if torchrun_flags else "torchrun"
            raise UserError(f"--ray with {where}: Ray Train starts the workers itself; use one launcher")
        sys.exit(ray_train.launch(cfg, ray_train.options(args), args.config, overrides))
    if not under_torchrun():
        given = [f"--{f.replace('_', '-')}" for f in self_launch.FLAGS if getattr(args, f) is not None]
        if given and args.nproc_per_node is None:
            raise UserError(f"{given[0]} needs --nproc-per-node N (disttrain launches itself through "
                            "torch.distributed.run only then); or run it under torchrun with these flags")
        if args.nproc_per_node is not None:
            sys.exit(self_launch.launch(cfg, self_launch.options(args), ["train", args.config, *overrides]))
    code = worker.train_here(cfg)
    if code:
        sys.exit(code)
