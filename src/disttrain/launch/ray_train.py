"""Training under Ray Train: `disttrain train CONFIG --ray [--workers N | MIN:MAX] [--ray-address ADDRESS]`, and
`RayJob` for people who build their own `TorchTrainer`.

Ray's own `TorchTrainer` starts the worker actors, their process group, their restarts and (with a MIN:MAX
worker count) the resizes; each worker runs disttrain's worker path (launch/ray_worker.py). This module is the
driver's side of it, as self_launch.py is torchrun's: resolve the run for every world size Ray may choose
(a bad one is refused before any worker starts), hold the run directory for every attempt, and turn Ray's
result into disttrain's exit status.

Ray's storage for the run is disttrain's checkpoint directory itself (`RunConfig(storage_path=its parent,
name=its name)`): the committed step directories are reported to Ray where they lie, nothing is copied, and
Ray's restarts name the newest committed one. Every worker must reach the run directory and the checkpoint
directory: on a cluster of several nodes, a shared filesystem or an object-store `checkpoint.dir`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from disttrain.core.errors import EXIT_PREEMPTED, UserError

MISSING = "--ray needs Ray Train, which is not installed: pip install 'disttrain[ray]'"
# Filesystems that live on one machine: a run directory there is not shared with the other nodes of a cluster.
LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "vfat", "ramfs"}


@dataclass(frozen=True)
class RayOptions:
    workers: tuple[int, int] | None  # (MIN, MAX); equal for a fixed count; None: every GPU, or 2 on CPU
    address: str | None  # None: a local Ray instance of this machine alone
    max_restarts: int | None  # None: 0 for a fixed count, 3 for MIN:MAX
    resize_interval_s: float = 60.0  # how often Ray looks for capacity to grow an elastic group (Ray's default)


def parse_workers(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` as (MIN, MAX); UserError, one line, for anything else."""
    allowed = "allowed: a worker count N >= 1, or MIN:MAX with 1 <= MIN <= MAX, e.g. --workers 2 or --workers 1:4"
    parts = value.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise UserError(f"--workers={value}: not a count ({allowed})")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise UserError(f"--workers={value}: {low} workers cannot train ({allowed})")
    if low > high:
        raise UserError(f"--workers={value}: MIN {low} is above MAX {high} ({allowed})")
    return low, high


def options(args) -> RayOptions:
    """The Ray flags of `disttrain train`, checked (UserError, one line)."""
    workers = parse_workers(args.workers) if args.workers is not None else None
    if args.max_restarts is not None and args.max_restarts < -1:
        raise UserError(f"--max-restarts={args.max_restarts}: must be a count >= 0 (or -1: no limit)")
    if args.ray_resize_interval is not None and args.ray_resize_interval <= 0:
        raise UserError(f"--ray-resize-interval={args.ray_resize_interval}: must be above 0 seconds")
    return RayOptions(workers, args.ray_address, args.max_restarts,
                      60.0 if args.ray_resize_interval is None else args.ray_resize_interval)


def require_ray(load: bool = True):
    """The ray module (UserError, one line, where Ray Train is not installed); `load=False`: only whether it is,
    without the seconds an import of Ray Train takes."""
    import importlib.util

    try:
        if not load:
            if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
                raise ImportError
            return None
        import ray
        import ray.train.torch  # noqa: F401
    except (ImportError, ValueError):  # ValueError: find_spec of a module set to None (hidden)
        raise UserError(MISSING) from None
    return ray


def check_address(address: str) -> None:
    """A HOST:PORT that nothing answers at is refused in one line (Ray itself would retry for minutes)."""
    if address == "auto" or "://" in address:
        return  # the local cluster `ray start` wrote down; a Ray Client address: Ray says what is wrong
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"--ray-address={address}: not HOST:PORT (the address `ray start --head` prints, "
                        "e.g. 10.0.0.1:6379; or auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except OSError as exc:
        raise UserError(f"--ray-address={address}: no Ray cluster answers there ({exc.strerror or exc}); start "
                        "one with `ray start --head`, or leave out --ray-address for a local instance") from None


def local_filesystem(path) -> str | None:
    """The filesystem type of `path` (its nearest existing parent) when it is one machine's own disk, else None
    (a network or cluster filesystem, an object-store URL, or nothing known)."""
    if "://" in str(path):
        return None
    here = Path(path).resolve()
    while not here.exists():
        here = here.parent
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    best = max((m for m in mounts if here == Path(m[0]) or Path(m[0]) in here.parents),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best and best[1] in LOCAL_FILESYSTEMS else None


def storage(cfg) -> tuple[str, str]:
    """Ray's (storage_path, name): its run folder is the checkpoint directory, so that the committed checkpoints
    are in Ray's storage where they lie."""
    where = cfg.checkpoint_dir
    if isinstance(where, str):  # a URL
        parent, _, name = where.rpartition("/")
        if "://" not in parent or parent.endswith(":/"):
            raise UserError(f"checkpoint.dir={where}: under --ray, name a folder inside the bucket (e.g. "
                            f"{where}/runs): Ray keeps its record of the run beside the checkpoints")
        return parent, name
    where = Path(where).resolve()
    return str(where.parent), where.name


class RayJob:
    """One disttrain run as the parts of a Ray `TorchTrainer`:

        job = RayJob("configs/demo.yaml", ["train.steps=200"], workers=(2, 4))
        trainer = TorchTrainer(job.train_loop, train_loop_config=job.loop_config, torch_config=job.torch_config,
                               scaling_config=job.scaling_config(), run_config=job.run_config())
        result = job.fit(trainer)  # holds the run directory while Ray trains; trainer.fit() would not

    The config is loaded and resolved for every worker count in `workers` here: a bad value is refused (UserError)
    before Ray starts anything. `use_gpu`: one GPU per worker (None: when the connected cluster has GPUs)."""

    def __init__(self, config: str, overrides: list[str] | tuple = (), workers: tuple[int, int] = (2, 2),
                 use_gpu: bool | None = None, resize_interval_s: float = 60.0):
        from disttrain.config.load import load_config
        from disttrain.config.resolve import resolve_run

        self.cfg = load_config(config, list(overrides))
        self.workers, self.resize_interval_s = workers, resize_interval_s
        self.use_gpu = use_gpu if use_gpu is not None else _cluster_has_gpus()
        device = "cuda" if self.use_gpu else "cpu"
        low, high = workers
        self.resolved = resolve_run(self.cfg, high, device)
        for size in range(low, high):  # every world size Ray may restart the group at
            try:
                resolve_run(self.cfg, size, device)
            except UserError as exc:
                raise UserError(f"--workers {low}:{high}: at {size} workers: {exc}") from None
        storage(self.cfg)  # a checkpoint directory Ray cannot keep its record beside: refused here
        self.key = f"ray-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the run directory's claim
        self.loop_config = {"config": str(Path(config).resolve()), "overrides": list(overrides),
                            "cwd": os.getcwd(), "run_key": self.key, "launched": time.time()}

    @property
    def train_loop(self):
        from disttrain.launch.ray_worker import train_loop_per_worker

        return train_loop_per_worker

    @property
    def torch_config(self):
        from disttrain.launch.ray_worker import DisttrainTorchConfig

        backend = self.cfg.distributed.backend
        return DisttrainTorchConfig(backend=None if backend == "auto" else backend,
                                    timeout_s=int(self.cfg.distributed.timeout_s))

    def scaling_config(self, **kwargs):
        from ray.train import ScalingConfig

        low, high = self.workers
        kwargs.setdefault("elastic_resize_monitor_interval_s", self.resize_interval_s)
        return ScalingConfig(num_workers=high if low == high else (low, high), use_gpu=self.use_gpu, **kwargs)

    def run_config(self, **kwargs):
        from ray.train import RunConfig

        storage_path, name = storage(self.cfg)
        return RunConfig(storage_path=storage_path, name=name, **kwargs)

    def fit(self, trainer):
        """`trainer.fit()` while this process holds the run directory for every attempt; Ray's Result."""
        from disttrain.checkpoint.run_directory import RunDirectory

        self.run_directory = RunDirectory(self.cfg, self.resolved, self.key, claims=True)
        with self.run_directory:
            return trainer.fit()


def _cluster_has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    from disttrain.distributed.env import device_type

    return device_type() == "cuda"


# Settings of torchrun's workers or of this launch only (the run key travels in the loop config).
NOT_FOR_WORKERS = ("DISTTRAIN_WORKER_START", "DISTTRAIN_EXIT_BARRIER_S", "DISTTRAIN_RUN_KEY")


def worker_env() -> dict[str, str]:
    """What the workers get of the driver's environment: disttrain's own settings (DISTTRAIN_*). Ray sets their
    thread count to their CPUs. Only when there is something to pass: a runtime environment makes Ray start new
    worker processes rather than use the ones it keeps ready."""
    return {k: v for k, v in os.environ.items() if k.startswith("DISTTRAIN_") and k not in NOT_FOR_WORKERS}


def connect(opts: RayOptions, high: int):
    """Join the cluster at --ray-address, or start a local instance of this machine alone (asked for 127.0.0.1,
    which Ray advertises as the machine's own address; at least one CPU per worker, as torchrun would start that
    many processes); returns the ray module."""
    ray = require_ray()
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # else each console line of rank 0 shows twice
    env = worker_env()
    common = dict(logging_level=logging.WARNING, log_to_driver=True,
                  **({"runtime_env": {"env_vars": env}} if env else {}))
    if opts.address:
        ray.init(address=opts.address, **common)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=max(os.cpu_count() or 1, high), **common)
    return ray


def check_cluster(ray, cfg) -> None:
    """Nodes on other machines and a run directory on this machine's own disk: refused in one line. (Nodes that
    all run on this machine share its disk.)"""
    here = socket.gethostname()
    others = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerHostname", here) != here]
    if not others:
        return
    local = local_filesystem(cfg.run_dir)
    if local and local_filesystem(cfg.checkpoint_dir):
        raise UserError(f"run.dir={cfg.run.dir}: on this machine's own disk ({local}), which the other "
                        f"node(s) of the Ray cluster ({others[0].get('NodeManagerHostname')}, ...) cannot reach: put "
                        "run.dir on a shared filesystem, or checkpoint.dir on an object store (s3://...)")


def launch(cfg, opts: RayOptions, config_path: str, overrides: list[str]) -> int:
    """`disttrain train CONFIG --ray`: the run under Ray Train; the exit status. Without --ray-address the run is
    resolved before the local Ray instance starts; with one, once the cluster says whether it has GPUs."""
    from disttrain.distributed.env import device_type

    require_ray(load=False)
    job = None
    if opts.address:
        check_address(opts.address)
    else:
        gpus = _local_gpus() if device_type() == "cuda" else 0
        job = RayJob(config_path, overrides, opts.workers or ((gpus, gpus) if gpus else (2, 2)), use_gpu=gpus > 0,
                     resize_interval_s=opts.resize_interval_s)
    ray = connect(opts, job.workers[1] if job else 1)
    try:
        check_cluster(ray, cfg)
        if job is None:
            gpus = int(ray.cluster_resources().get("GPU", 0))
            job = RayJob(config_path, overrides, opts.workers or ((gpus, gpus) if gpus else (2, 2)),
                         use_gpu=gpus > 0, resize_interval_s=opts.resize_interval_s)
        return _fit(job, opts)
    finally:
        ray.shutdown()


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _fit(job: RayJob, opts: RayOptions) -> int:
    """TorchTrainer.fit under the run directory's claim; Ray's result as an exit status."""
    from ray.train import FailureConfig
    from ray.train.torch import TorchTrainer

    from disttrain.checkpoint.run_directory import PREEMPTED, AlreadyFinished

    low, high = job.workers
    restarts = opts.max_restarts if opts.max_restarts is not None else (0 if low == high else 3)
    trainer = TorchTrainer(job.train_loop, train_loop_config=job.loop_config, torch_config=job.torch_config,
                           scaling_config=job.scaling_config(),
                           run_config=job.run_config(failure_config=FailureConfig(max_failures=restarts)))
    try:
        result, error = job.fit(trainer), None
    except AlreadyFinished as exc:
        print(exc, flush=True)
        return 0
    except Exception as exc:  # Ray's TrainingFailedError: the restarts are used up
        result, error = None, exc
    error = error if error is not None else result.error
    if error is None:
        return int(result.return_value or 0)
    if job.run_directory.ending() == PREEMPTED:  # what the workers recorded since the launch
        return EXIT_PREEMPTED  # the workers said so in one line: the emergency checkpoint is committed
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    print(f"disttrain: error: the Ray workers failed (restarts allowed: {restarts}): {first}", flush=True)
    return 1
