"""`disttrain train`: validate, self-launch under torch.distributed.run if asked, else train this rank."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from disttrain.launch import this_process
from disttrain.config.load import load_config
from disttrain.core.errors import EXIT_HEALTH, EXIT_PREEMPTED, EXIT_STORAGE, UserError

LAUNCH_FLAGS = ("nnodes", "node_rank", "max_restarts", "rdzv_endpoint", "rdzv_id", "shutdown_timeout", "rdzv_conf",
                "exit_barrier_timeout")


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


def _setup_logging(run_dir: Path, rank: int) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(logs / f"rank_{rank:05d}.log")
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    console.setFormatter(fmt)
    root = logging.getLogger("disttrain")
    root.setLevel(logging.INFO)
    root.handlers[:] = [file_handler, console]


def _self_launch(args: argparse.Namespace, cfg, overrides: list[str]) -> int:
    from disttrain.launch.self_launch import LaunchOptions, launch_workers, max_world_size, rdzv_conf

    opts = LaunchOptions(args.nproc_per_node, args.nnodes or "1", args.node_rank, args.max_restarts or 0,
                         args.rdzv_endpoint, args.rdzv_backend, args.rdzv_id,
                         120 if args.shutdown_timeout is None else args.shutdown_timeout, args.rdzv_conf or "",
                         30 if args.exit_barrier_timeout is None else args.exit_barrier_timeout)
    for flag in ("shutdown_timeout", "exit_barrier_timeout"):
        if getattr(opts, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')}={getattr(opts, flag)}: must be at least 0 seconds")
    try:
        rdzv_conf(opts.rdzv_conf)
    except ValueError as exc:
        raise UserError(f"--rdzv-conf={opts.rdzv_conf}: {exc} (allowed: key=value,... e.g. "
                        "last_call_timeout=5,join_timeout=600)") from None
    if opts.nproc_per_node != "auto" and (not opts.nproc_per_node.isdigit() or int(opts.nproc_per_node) < 1):
        raise UserError(f"--nproc-per-node={opts.nproc_per_node}: must be a positive integer or auto")
    if str(opts.nnodes) != "1" and not opts.rdzv_endpoint:
        raise UserError(f"--nnodes={opts.nnodes} needs --rdzv-endpoint HOST:PORT")
    from disttrain.checkpoint import lease, run_identity
    from disttrain.config.resolve import resolve_run

    resolved = resolve_run(cfg, max_world_size(opts), _device_type())  # refuse a bad run before any worker starts
    key = lease.launch_key(opts.rdzv_id, opts.rdzv_endpoint)
    run_identity.check_run_dir(cfg, resolved, key)
    existed = cfg.run_dir.exists()
    held = run_identity.claim(cfg, key, existed)
    os.environ[lease.KEY_ENV] = key  # the workers (and their restarts) write under this launch's claim
    started = time.time()
    try:
        code, report = launch_workers(opts, ["train", args.config, *overrides])
    finally:
        os.environ.pop(lease.KEY_ENV, None)
        held.release()
        run_identity.remove_if_unused(cfg.run_dir, existed)
    if code != 0 and _preempted_since(cfg.run_dir, started):
        return EXIT_PREEMPTED  # the workers saved and said so; torchrun's report of their exit is noise
    if code != 0 and _recorded_since(cfg.run_dir, started, "checkpoint_failed", last=True):
        return EXIT_STORAGE  # the workers said which save failed and why, in one line
    if report:
        print(report, file=sys.stderr, end="", flush=True)
    return code


def _preempted_since(run_dir: Path, since: float) -> bool:
    """Whether this launch's workers recorded an emergency checkpoint (metrics.jsonl `preempted`)."""
    return _recorded_since(run_dir, since, "preempted")


def _recorded_since(run_dir: Path, since: float, event: str, **fields) -> bool:
    """Whether this launch's workers recorded `event` (with these fields) in metrics.jsonl."""
    from disttrain.observe.run_report import load_records

    try:
        _, events = load_records(run_dir)
    except FileNotFoundError:  # stopped before the run directory had metrics
        return False
    return any(e["event"] == event and e.get("time", 0) >= since and all(e.get(k) == v for k, v in fields.items())
               for e in events)


def _device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_backend(cfg) -> None:
    if cfg.distributed.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UserError("distributed.backend=nccl needs CUDA devices and none are visible "
                            "(allowed here: auto, gloo)")


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> None:
    from disttrain.distributed.env import detect_env, under_torchrun

    env = detect_env()
    cfg = load_config(args.config, overrides)
    if not under_torchrun():
        given = [f"--{f.replace('_', '-')}" for f in LAUNCH_FLAGS if getattr(args, f) is not None]
        if given and args.nproc_per_node is None:
            raise UserError(f"{given[0]} needs --nproc-per-node N (disttrain launches itself through "
                            "torch.distributed.run only then); or run it under torchrun with these flags")
        if args.nproc_per_node is not None:
            _check_backend(cfg)
            sys.exit(_self_launch(args, cfg, overrides))
    _check_backend(cfg)
    from disttrain.checkpoint import lease, run_identity
    from disttrain.config.resolve import resolve_run

    resolved = resolve_run(cfg, env.world_size, _device_type())
    fresh = run_identity.unused(cfg.run_dir)
    held = None
    if not os.environ.get(lease.KEY_ENV):  # else disttrain's launcher checked and holds the run
        key = lease.process_key()
        run_identity.check_run_dir(cfg, resolved, key)  # every rank; reads only
        if env.rank == 0:
            held = run_identity.claim(cfg, key, cfg.run_dir.exists())

    try:
        _train_here(cfg, env, resolved, fresh, held)
    finally:
        if held is not None:
            held.release()


def _train_here(cfg, env, resolved, fresh: bool, held=None) -> None:
    """This rank's share of the run, from the process group to the final line. `held`: the claims this process
    renews, released before a fresh run directory is removed (a renewal there would log into a deleted file)."""
    from disttrain.distributed.runtime import init_distributed, shutdown
    from disttrain.observe.health import NonFiniteError, ReplicaDivergence
    from disttrain.train.builder import build_run
    from disttrain.train.loop import CheckpointFailed, Preempted, Trainer

    _setup_logging(cfg.run_dir, env.rank)
    log = logging.getLogger("disttrain.cli")
    log.info("process started at %.3f (restart %s%s)", this_process.STARTED, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
             ", forked from the launcher" if this_process.STARTED_BY_FORK else "")
    lay = resolved.layout
    log.info("resolved run: world %d (pp %d, dp_replicate %d, dp_shard %d, tp %d), model %s, tokenizer %s, dtypes "
             "param %s, compute %s, reduce %s", lay.world_size, lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp,
             resolved.spec.name, resolved.tokenizer, resolved.param_dtype, resolved.compute_dtype,
             resolved.reduce_dtype)
    try:
        rt = init_distributed(env, cfg.distributed.backend, cfg.distributed.timeout_s)
        try:
            run = build_run(cfg, rt, resolved)
        except UserError:  # found while assembling (weights that do not fit): leave nothing behind
            if fresh and env.rank == 0:
                if held is not None:
                    held.release()
                for handler in logging.getLogger("disttrain").handlers:
                    handler.close()
                shutil.rmtree(cfg.run_dir, ignore_errors=True)
            raise
        result = Trainer(run).fit()
    except Preempted:
        sys.exit(EXIT_PREEMPTED)
    except CheckpointFailed as exc:  # the storage policy: the last save failed, the run must not look done
        logging.getLogger("disttrain.checkpoint").info("stopped: %s", exc)  # the log file; the console gets one line
        if env.rank == 0:
            print(f"disttrain: stopped: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STORAGE)
    except (NonFiniteError, ReplicaDivergence) as exc:  # a health check stopped the run
        logging.getLogger("disttrain.health").error("%s", exc)
        if env.rank == 0:
            print(f"disttrain: stopped: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_HEALTH)
    finally:  # also on SystemExit and on a UserError found once running (it reaches cli.main)
        shutdown()
    run.faults.at_exit()
    if env.rank == 0:
        loss = f"final loss {result.final_loss:.4f}, " if result.final_loss is not None else ""
        print(f"done: {result.final_step} steps, {loss}run directory {Path(result.run_dir).resolve()}", flush=True)
