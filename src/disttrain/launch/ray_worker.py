"""What each Ray Train worker runs: disttrain's own worker path (launch/worker.py `train_here`) in the process
group Ray created, plus what Ray needs from it: the committed checkpoints reported, and the scheduler's SIGTERM
turned into disttrain's emergency checkpoint.

The process group: `TorchTrainer` has already called `init_process_group` on every worker actor (gloo on CPU,
NCCL on GPU, rank 0's address and a fresh port for each start of the worker group) before this function runs.
disttrain takes that group as it is (distributed/runtime.py starts one only when none exists) instead of
destroying it and rendezvousing again from Ray's environment: a second rendezvous would need a second port
and could fail on its own, while Ray's group is already the one Ray restarts, resizes and tears down with its
workers. Ray is told disttrain's backend and collective timeout (`torch_config`), so the group is the one
disttrain would have made.

Ray runs the training function in a thread of the worker actor, and Python lets only the main thread install
signal handlers. The backend hook below installs the preemption handler on the actor's main thread (where Ray's
own handler would end the actor at once), and the training thread reads it at the next step boundary
(train/resilience.py), so a SIGTERM saves the emergency checkpoint as it does under torchrun.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from ray.train.torch import TorchConfig

from disttrain.train.jobs import Job

log = logging.getLogger("disttrain.launch")

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_training = threading.Event()  # set while this actor trains: a signal then means "save and stop"
_previous: dict[int, object] = {}


def _on_signal(signum, frame) -> None:
    """The actor's main thread: while training, note the signal for the step boundary; else Ray's own handling."""
    from disttrain.train.resilience import note_preemption_signal

    if _training.is_set():
        note_preemption_signal(signum)
        return
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_preemption_handlers() -> None:
    """Run on the worker actor's main thread (by the backend hook)."""
    for sig in PREEMPT_SIGNALS:
        _previous[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal)


class DisttrainTorchConfig(TorchConfig):
    """Ray's TorchConfig (backend, collective timeout) whose backend also installs the preemption handler on
    every worker before training starts. Written here because Ray has no setting for it: its workers end on
    SIGTERM without telling the training thread."""

    @property
    def backend_cls(self):
        return _backend_class(super().backend_cls)


def _backend_class(base):
    class DisttrainBackend(base):
        def on_training_start(self, worker_group, backend_config) -> None:
            super().on_training_start(worker_group, backend_config)
            worker_group.execute(install_preemption_handlers)

    DisttrainBackend.__qualname__ = DisttrainBackend.__name__ = f"Disttrain{base.__name__}"
    return DisttrainBackend


class RayReport(Job):
    """Reports each newly committed checkpoint to Ray (`ray.train.report`, every rank at the same step: Ray's
    report is a barrier), so that the run's result and Ray's own restarts name the newest committed one. The
    checkpoint is the step directory itself, already in Ray's storage (`ray_train.storage`): nothing is copied.
    Runs after the step boundary, so the checkpoint of step k is reported at step k. At start, on rank 0, it
    records this start of the worker group in metrics.jsonl: a `restart` event (its number since the launch,
    the world size from this step on) when it is not the first."""

    label = "ray report"
    collective = True

    def __init__(self, run, launched: float):
        self.training_run, self.launched = run, launched
        self.reported: str | None = None

    def start(self, trainer) -> None:
        runtime = self.training_run.runtime
        self.reported = self.training_run.checkpoints.newest  # resumed from it: Ray knows it already
        log.info("ray worker: pid %d, world rank %d of %d", os.getpid(), runtime.rank, runtime.world_size)
        if runtime.rank != 0:
            return
        from disttrain.observe.run_report import load_records

        _, events = load_records(self.training_run.cfg.run_dir)
        starts = [e for e in events if e.get("event") == "started" and e.get("time", 0) >= self.launched]
        if len(starts) > 1:
            trainer.metrics.event("restart", step=trainer.step, restart=len(starts) - 1, launcher="ray",
                                  world_size=self.training_run.runtime.world_size, resumed_from=self.reported)

    def due(self, step: int) -> bool:
        return self.training_run.checkpoints.newest != self.reported

    def run(self, trainer) -> None:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        from disttrain.checkpoint.manager import CheckpointManager

        path = self.reported = self.training_run.checkpoints.newest
        # Ray reads a local checkpoint path as a URI: a relative one (run.dir=runs, the default) has no scheme
        where = str(path) if "://" in str(path) else str(Path(path).resolve())
        checkpoint = Checkpoint(where) if self.training_run.runtime.rank == 0 else None
        metrics = {"step": CheckpointManager.step_of(path), "world_size": self.training_run.runtime.world_size}
        if trainer.final_loss is not None:
            metrics["loss"] = trainer.final_loss
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


class Preempted(RuntimeError):
    """Raised out of the training function so that Ray restarts the worker group (and disttrain resumes from the
    emergency checkpoint just saved), where torchrun would restart on the exit status."""


def train_loop_per_worker(config: dict) -> int:
    """The function TorchTrainer runs on every worker. `config`: `ray_train.loop_config`'s dict. Returns the
    worker's exit status (0 done, 2 a user mistake, 3 a health check, 74 the last save failed: Ray does not retry
    them); raises Preempted after an emergency checkpoint, so that Ray restarts the group."""
    import ray.train

    from disttrain.checkpoint import lease
    from disttrain.config.load import load_config
    from disttrain.core.errors import EXIT_PREEMPTED, EXIT_USAGE, UserError
    from disttrain.distributed.env import DistEnv
    from disttrain.launch.worker import train_here

    if os.path.isdir(config["cwd"]):  # relative paths in the config mean what they meant to the driver
        os.chdir(config["cwd"])
    if config.get("run_key"):
        os.environ[lease.KEY_ENV] = config["run_key"]  # the driver holds the run directory for every attempt
    ctx = ray.train.get_context()
    env = DistEnv(rank=ctx.get_world_rank(), world_size=ctx.get_world_size(), local_rank=ctx.get_local_rank(),
                  local_world_size=ctx.get_local_world_size(), launcher="ray",
                  master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                  master_port=int(os.environ.get("MASTER_PORT", "29500")))
    launched = config.get("launched", time.time())
    logging.getLogger("disttrain").propagate = False  # its own handlers (launch/worker.py), not Ray's root handler
    _training.set()
    try:
        cfg = load_config(config["config"], config["overrides"])
        code = train_here(cfg, env=env, jobs_after_checkpoints=lambda run: [RayReport(run, launched)])
    except UserError as exc:
        if env.rank == 0:
            print(f"disttrain: error: {str(exc).splitlines()[0]}", flush=True)
        return EXIT_USAGE
    finally:
        _training.clear()
    if code == EXIT_PREEMPTED:
        raise Preempted(f"rank {env.rank}: preempted; the emergency checkpoint is committed")
    return code
