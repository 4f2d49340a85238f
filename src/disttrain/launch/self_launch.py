"""Self-launch: `disttrain train ... --nproc-per-node N` becomes torch.distributed.run's elastic agent
(in this process) whose workers run `python -m disttrain train ...`, so restarts and rendezvous behave
exactly as with torchrun. The run is resolved for the launch's world size and its directory claimed before
any worker starts; the exit status says how the run ended.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


FLAGS = ("nnodes", "node_rank", "max_restarts", "rdzv_endpoint", "rdzv_id", "shutdown_timeout", "rdzv_conf",
         "exit_barrier_timeout")  # the launch flags that need --nproc-per-node


@dataclass
class LaunchOptions:
    nproc_per_node: str
    nnodes: str = "1"
    node_rank: int | None = None
    max_restarts: int = 0
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str | None = None
    shutdown_timeout: int = 120  # seconds the agent waits for workers to save after SIGTERM/SIGUSR1
    rdzv_conf: str = ""  # key=value,... for the rendezvous, over RDZV_DEFAULTS
    exit_barrier_timeout: int = 30  # seconds a finished agent waits for the other nodes' agents


def options(args) -> LaunchOptions:
    """The launch flags of `disttrain train` as LaunchOptions, checked (UserError, one line)."""
    from disttrain.core.errors import UserError

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
    return opts


def launch(cfg, opts: LaunchOptions, module_args: list[str]) -> int:
    """Resolve the run for the launch's world size (a bad run is refused before any worker starts), hold its
    directory for the workers, run them; the exit status (the workers' own, or how they said the run ended)."""
    from disttrain.checkpoint.run_directory import AlreadyFinished, RunDirectory
    from disttrain.config.resolve import resolve_run
    from disttrain.distributed.env import device_type

    resolved = resolve_run(cfg, max_world_size(opts), device_type())
    try:
        with RunDirectory.for_launch(cfg, resolved, opts.rdzv_id, opts.rdzv_endpoint) as run_dir:
            code, report = launch_workers(opts, module_args)
    except AlreadyFinished as exc:  # no worker started
        print(exc, flush=True)
        return 0
    status = run_dir.exit_code(code)
    if status == code and report:  # else the workers said what happened in one line; torchrun's report is noise
        print(report, file=sys.stderr, end="", flush=True)
    return status


def resolve_nproc(value: str) -> int:
    """`auto`: every GPU of the node, or 2 processes on a CPU-only machine."""
    if value == "auto":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 2
    return int(value)


def max_world_size(opts: LaunchOptions) -> int:
    nnodes = int(str(opts.nnodes).split(":")[-1])
    return resolve_nproc(opts.nproc_per_node) * nnodes


# Multi-node rendezvous settings (torch's defaults: 30 s last call, 5 s x 3 heartbeats). A lost node is
# declared dead after keep_alive_interval x keep_alive_max_attempt seconds, and a rendezvous that has its
# minimum of nodes waits last_call_timeout for more: with torch's values a node loss took 46 s to recover
# here, with these 13 s (docs/benchmarks/fault-tolerance.md). A node that arrives after the last call is
# admitted by a restart at the next rendezvous, so a short last call costs nothing but that restart.
RDZV_DEFAULTS = {"last_call_timeout": "5", "keep_alive_interval": "2", "keep_alive_max_attempt": "3"}


def rdzv_conf(user: str) -> str:
    """RDZV_DEFAULTS overridden by the user's `key=value,...`; ValueError on a malformed item."""
    conf = dict(RDZV_DEFAULTS)
    for item in filter(None, (x.strip() for x in user.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{item!r} is not key=value")
        conf[key] = value
    return ",".join(f"{k}={v}" for k, v in conf.items())


# The agent's default list lacks SIGUSR1 (SLURM's warning signal): it would die of it and orphan the
# workers. Handled, the agent passes the signal on to the workers and waits `--shutdown-timeout`.
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def torchrun_args(opts: LaunchOptions, module_args: list[str]) -> list[str]:
    args = [f"--nproc-per-node={resolve_nproc(opts.nproc_per_node)}", f"--nnodes={opts.nnodes}",
            f"--max-restarts={opts.max_restarts}", f"--signals-to-handle={AGENT_SIGNALS}",
            f"--shutdown-timeout={opts.shutdown_timeout}"]
    if opts.rdzv_endpoint:
        args += [f"--rdzv-backend={opts.rdzv_backend}", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                 f"--rdzv-conf={rdzv_conf(opts.rdzv_conf)}"]
        if opts.rdzv_id:
            args.append(f"--rdzv-id={opts.rdzv_id}")
        if opts.node_rank is not None:
            args.append(f"--node-rank={opts.node_rank}")
    elif str(opts.nnodes) == "1":
        args.append("--standalone")
    else:
        raise ValueError("--nnodes other than 1 needs --rdzv-endpoint HOST:PORT")
    return args + ["-m", "disttrain", *module_args]


def relaunch(opts: LaunchOptions, module_args: list[str]) -> int:
    """`launch_workers`, torchrun's failure report on stderr; the exit status."""
    code, report = launch_workers(opts, module_args)
    if report:
        print(report, file=sys.stderr, end="", flush=True)
    return code


def launch_workers(opts: LaunchOptions, module_args: list[str]) -> tuple[int, str]:
    """Run torchrun's agent in this process (one interpreter and one torch import fewer per launch than
    a child agent); it handles the signals a scheduler sends to us (SIGTERM before a kill, SIGUSR1 as
    SLURM's warning) by passing them to the workers so they can save. Returns torchrun's exit status and
    its failure report (empty when the workers said why themselves: agent.QUIET_EXITS)."""
    from disttrain.launch.agent import launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it too, with a warning per launch
    os.environ["DISTTRAIN_EXIT_BARRIER_S"] = str(opts.exit_barrier_timeout)
    if opts.rdzv_endpoint:
        # torch 2.13: with the agents' shared TCPStore, an agent that was rank 0 before a membership change
        # does not publish the new round's MASTER_ADDR, and a node that joins (a replacement, or one scaling
        # the run back up) waits for it until it times out. Without sharing, each round publishes its own.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return launch(torchrun_args(opts, module_args))
