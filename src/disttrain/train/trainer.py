"""The training loop: micro-batches, precision, clipping, optimizer + schedule, eval, checkpoints.

Loss semantics (what makes layouts comparable): each micro-batch contributes the *sum* of its
token losses divided by this rank's token count for the step; DDP averages over data-parallel
ranks, which all hold the same token count, so the gradient is that of the mean token loss
over the whole global batch. The logged loss is that same mean, all-reduced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from disttrain.checkpoint.manager import CheckpointManager
from disttrain.checkpoint.compat import config_changes
from disttrain.checkpoint.export import init_from
from disttrain.config import ConfigError, RunConfig
from disttrain.data.loader import DistributedBatchLoader, GlobalBatchSampler, TokenWindows
from disttrain.data.source import load_splits
from disttrain.distributed.dims import ParallelDims
from disttrain.distributed.runtime import Runtime
from disttrain.models.generate import generate
from disttrain.models.init import build_model, count_params
from disttrain.models.registry import resolve_shape
from disttrain.observe.health import NonFiniteError, check_replicas_in_sync, straggler_stats
from disttrain.observe.metrics import MetricsLogger, peak_memory_bytes
from disttrain.observe.memory import memory_stats
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.apply import apply_parallelism, gradient_sync_disabled
from disttrain.observe.breakdown import CommProfiler, StepBreakdown
from disttrain.observe.flops import peak_flops_per_device
from disttrain.parallel.pipeline import build_pipeline
from disttrain.parallel.tensor import local_value, loss_context
from disttrain.parallel.zero1 import build_zero1_optimizer
from disttrain.plan.flops import model_flops_per_token
from disttrain.train import deepspeed_engine
from disttrain.train.faults import FaultInjector
from disttrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm_global
from disttrain.train.precision import Precision
from disttrain.train.resilience import EXIT_PREEMPTED, NullWatchdog, StepControl, Watchdog

log = logging.getLogger(__name__)


class Preempted(Exception):
    """Raised after the emergency checkpoint; the CLI exits with EXIT_PREEMPTED."""


@dataclass
class TrainResult:
    final_step: int
    final_loss: float | None
    run_dir: str
    sample: str | None = None


def model_fingerprint(cfg: RunConfig) -> str:
    """Identifies the parameter shapes; a checkpoint only resumes into the same fingerprint."""
    shape = resolve_shape(cfg.model)
    return hashlib.sha256(json.dumps(shape.__dict__, sort_keys=True).encode()).hexdigest()[:16]


class Trainer:
    def __init__(self, cfg: RunConfig, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.device = rt.device
        self.run_dir = cfg.run_dir
        if rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        dist.barrier()

        self.dims = ParallelDims.from_config(cfg.parallel, rt.world_size)
        self.meshes = self.dims.build_mesh(self.device.type)
        self.dp_rank, self.dp_size = self.meshes.dp.get_local_rank(), self.meshes.dp.size()

        self.tokenizer, splits = load_splits(cfg.data.source, cfg.data.tokenizer)
        t = cfg.train
        self.train_windows = TokenWindows(splits["train"], cfg.data.seq_len)
        self.val_windows = TokenWindows(splits["val"], cfg.data.seq_len)
        sampler = GlobalBatchSampler(len(self.train_windows), t.global_batch_size, t.seed)
        self.loader = DistributedBatchLoader(self.train_windows, sampler, self.dp_rank, self.dp_size,
                                             t.micro_batch_size)
        self.tokens_per_step = t.global_batch_size * cfg.data.seq_len

        self.shape = resolve_shape(cfg.model)
        self.base_model = build_model(self.shape, self.device, t.seed)
        if cfg.model.init_from:
            try:
                init_from(self.base_model, cfg.model.init_from)
            except ValueError as exc:
                raise ConfigError(f"model.init_from={cfg.model.init_from}: {exc}") from None
        self.num_params = count_params(self.base_model)
        self.flops_per_token = model_flops_per_token(self.shape, cfg.data.seq_len)
        self.peak_flops, self.peak_flops_source = peak_flops_per_device(cfg, self.device)
        self.pipeline = None
        if cfg.engine == "deepspeed":
            apply_activation_checkpointing(self.base_model, cfg.parallel.activation_checkpointing)
            self.optimizer = build_optimizer(self.base_model, cfg.optim)
            self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
            self.model = deepspeed_engine.initialize(self.base_model, self.optimizer, self.scheduler, cfg,
                                                     rt.world_size, self.device.type == "cuda")
            self.precision = Precision("fp32", self.device)  # DeepSpeed casts and scales itself
        else:
            if self.dims.pp > 1:
                per_rank = t.global_batch_size // self.dp_size
                self.pipeline = build_pipeline(
                    self.base_model, cfg, self.dims, self.meshes, self.device,
                    local_tokens=per_rank * cfg.data.seq_len,
                    n_microbatches=cfg.parallel.pp_microbatches or per_rank // (t.micro_batch_size or per_rank))
                self.model = self.pipeline.model
            else:
                self.model = apply_parallelism(self.base_model, cfg, self.dims, self.meshes, self.device)
            if cfg.parallel.zero_stage == 1:
                self.optimizer = build_zero1_optimizer(self.model, cfg.optim, self.meshes.dp.get_group())
            else:
                self.optimizer = build_optimizer(self.model, cfg.optim)
            self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
            self.precision = Precision(cfg.precision.compute_dtype, self.device)
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, rt.rank, cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from: str | None = None
        self.config_changes: dict = {}
        self.skipped_checkpoints: list[str] = []
        self.faults = FaultInjector(rt.rank)
        self.forward_seconds = 0.0
        self.skipped_steps: list[int] = []
        self.fp16_overflows = 0.0
        self.breakdown = StepBreakdown(self.device)
        self.breakdown.watch_embedding(self.base_model.tok_embeddings)
        self.comm_profiler = CommProfiler(cfg.metrics.comm_profile_every, self.device)
        # Replicas hold identical parameters over the whole dp group (DDP, ZeRO-1), or over
        # dp_replicate only (HSDP: copies of the same shard); plain ZeRO-2/3 has none to compare.
        if cfg.engine == "deepspeed" or (cfg.parallel.zero_stage >= 2 and self.dims.dp_replicate == 1):
            self.replica_group = None
        elif cfg.parallel.zero_stage >= 2:
            self.replica_group = self.meshes.world["dp_replicate"].get_group()
        else:
            self.replica_group = self.meshes.dp.get_group()

    # ---------------------------------------------------------------- state
    def train_state(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.scaler.state_dict(), "loader": self.loader.state_dict(),
                "model_fingerprint": model_fingerprint(self.cfg),
                "config": self.cfg.model_dump(mode="json", by_alias=True)}

    def maybe_resume(self) -> None:
        mode = self.cfg.checkpoint.resume
        if mode == "none":
            return
        self.ckpt.remove_uncommitted()
        dist.barrier()
        if mode == "auto":
            path, self.skipped_checkpoints = self.ckpt.choose_resume()
            if path is None:
                if self.skipped_checkpoints:
                    log.warning("no committed checkpoint in %s could be loaded: starting fresh", self.ckpt.dir)
                return
        else:
            path = Path(mode)
            problem = self.ckpt.verify(path)
            if problem:
                raise ConfigError(f"checkpoint.resume={mode}: {problem}")
        self._check_compatible(path)
        state = self.ckpt.load(path, self.model, self.optimizer)
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.precision.scaler.load_state_dict(state["scaler"])
        self.loader.load_state_dict(state["loader"])
        self.resumed_from = str(path)
        log.info("resumed from %s at %.3f", path, time.time())

    def _check_compatible(self, path: Path) -> None:
        """Refuse another model shape before touching any tensor; report every other change."""
        saved = self.ckpt.read_train_state(path)
        if saved["model_fingerprint"] != model_fingerprint(self.cfg):
            old = saved.get("config", {}).get("model", {})
            diff = ", ".join(f"model.{k}={old.get(k)!r}" for k in sorted(old)
                             if old.get(k) != getattr(self.cfg.model, k, None)) or "model shape"
            raise ConfigError(f"checkpoint.resume: {path} holds a model of another shape ({diff} when saved); "
                              "resume with that model config, or start fresh with checkpoint.resume=none")
        safe, trajectory = config_changes(saved.get("config", {}), self.cfg.model_dump(mode="json", by_alias=True))
        self.config_changes = {"safe": safe, "trajectory": trajectory}
        for line in trajectory:
            log.warning("resuming with a changed setting, the run will differ from the interrupted one: %s", line)

    # ---------------------------------------------------------------- one step
    @staticmethod
    def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

    def _forward_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism the logits are vocabulary-sharded and the loss a replicated
        DTensor; callers run this (and backward) inside `self.loss_context()`."""
        with self.precision.autocast():
            logits = self.model(inputs)
        return self._loss_sum(logits, targets)

    def loss_context(self):
        return loss_context(self.dims.tp > 1)

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (sum of this rank's token losses, global grad norm) as device tensors. The only host
        sync is the finiteness test of the norm (one scalar), which decides whether to step."""
        if deepspeed_engine.is_engine(self.model):
            return deepspeed_engine.train_step(self.model, micro_batches, self._loss_sum, self.device)
        local_tokens = sum(y.numel() for _, y in micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        scaler = self.precision.scaler
        last = len(micro_batches) - 1
        self.forward_seconds = 0.0
        bd = self.breakdown
        if self.pipeline is not None:  # the schedule splits the rank's batch into its micro-batches
            x = torch.cat([x for x, _ in micro_batches]).to(self.device)
            y = torch.cat([y for _, y in micro_batches]).to(self.device)
            pipe = self.pipeline
            busy_f, busy_b, t0 = pipe.forward_s, pipe.backward_s, time.perf_counter()
            self.faults.before_forward()
            with self.precision.autocast(), self.loss_context():
                loss_sum = self.faults.corrupt_loss(self.step + 1, pipe.train_step(x, y))
            self.forward_seconds = elapsed = time.perf_counter() - t0
            forward, backward = pipe.forward_s - busy_f, pipe.backward_s - busy_b
            # Host clocks: the schedule blocks on its transfers, so idle time here is bubble + transfers.
            bd.add_seconds("forward", forward)
            bd.add_seconds("backward", backward)
            bd.add_seconds("comm_exposed", max(0.0, elapsed - forward - backward))
            micro_batches = []
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with contextlib.nullcontext() if i == last else gradient_sync_disabled(self.model), self.loss_context():
                t0, h0 = bd.now(), time.perf_counter()
                self.faults.before_forward()
                loss = self.faults.corrupt_loss(self.step + 1, self._forward_loss_sum(x, y))
                t1 = bd.now()
                self.forward_seconds += time.perf_counter() - h0
                scaler.scale(loss / local_tokens).backward()
                t2 = bd.now()
            compute_end = bd.take_compute_end()
            bd.add("forward", t0, t1)
            if i == last and compute_end is not None:  # what follows the last gradient is reduction wait
                bd.add("backward", t1, compute_end)
                bd.add("comm_exposed", compute_end, t2)
            else:
                bd.add("backward", t1, t2)
            loss_sum += local_value(loss.detach())
        t_opt = bd.now()
        try:
            return self._optimizer_step(loss_sum)
        finally:
            bd.add("optimizer", t_opt, bd.now())

    def _optimizer_step(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaler = self.precision.scaler
        scaler.unscale_(self.optimizer)
        if scaler.is_enabled():  # overflow count stays on the device until a logging step reads it
            found = sum(v.float() for v in scaler._found_inf_per_device(self.optimizer).values())
            self.fp16_overflows = self.fp16_overflows + found
        clip = self.cfg.optim.grad_clip or float("inf")
        grad_norm = clip_grad_norm_global(self.model.parameters(), clip,
                                          self.pipeline.group if self.pipeline is not None else None)
        # One scalar to the host per step; fp16 leaves non-finite steps to the GradScaler.
        if not scaler.is_enabled() and not bool(torch.isfinite(grad_norm)):
            if self.cfg.metrics.nonfinite == "stop":
                raise NonFiniteError(f"non-finite gradient norm at step {self.step + 1} (local loss sum "
                                     f"{float(loss_sum):.4g}); metrics.nonfinite=skip_step would drop such steps")
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.skipped_steps.append(self.step + 1)
            return loss_sum, grad_norm
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum, grad_norm

    def _global_mean(self, local_sum: torch.Tensor, total_tokens: int) -> float:
        """Collective (only on logging and evaluation steps): under a pipeline the loss exists on
        the last stage, so it is summed along the pipeline too."""
        t = local_sum.detach().clone()
        dist.all_reduce(t, group=self.meshes.dp.get_group())
        if self.pipeline is not None:
            dist.all_reduce(t, group=self.pipeline.group)
        return float(t) / total_tokens

    # ---------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> float | None:
        t = self.cfg.train
        if len(self.val_windows) == 0:
            return None
        sampler = GlobalBatchSampler(len(self.val_windows), t.global_batch_size, t.seed, shuffle=False)
        loader = DistributedBatchLoader(self.val_windows, sampler, self.dp_rank, self.dp_size, t.micro_batch_size)
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for k in range(1, t.eval_batches + 1):
            batches = list(loader.micro_batches(k))
            if self.pipeline is not None:
                x = torch.cat([x for x, _ in batches]).to(self.device)
                y = torch.cat([y for _, y in batches]).to(self.device)
                with self.precision.autocast(), self.loss_context():
                    total += self.pipeline.eval_loss_sum(x, y)
                continue
            for x, y in batches:
                with self.loss_context():
                    total += local_value(self._forward_loss_sum(x.to(self.device), y.to(self.device)))
        self.model.train()
        return self._global_mean(total, t.eval_batches * self.tokens_per_step)

    # ---------------------------------------------------------------- checkpoint triggers
    def save_checkpoint(self, metrics: MetricsLogger, reason: str = "interval") -> None:
        """Synchronous: saved and committed. Async: `blocking_s` is what training waited for."""
        t0 = time.perf_counter()
        path = self.ckpt.save(self.step, self.model, self.optimizer, self.train_state())
        seconds = time.perf_counter() - t0
        if self.ckpt.pending_step is None:
            metrics.event("checkpoint_saved", step=self.step, path=str(path), seconds=seconds, reason=reason)
        else:
            metrics.event("checkpoint_started", step=self.step, path=str(path), blocking_s=seconds, reason=reason)
        self.faults.after_save(self.step)

    def _commit_pending(self, metrics: MetricsLogger) -> None:
        done = self.ckpt.commit_pending()
        if done:
            metrics.event("checkpoint_saved", step=done[0], path=str(self.ckpt.step_dir(done[0])), seconds=done[1],
                          reason="async")

    # ---------------------------------------------------------------- loop
    def _announce(self, metrics: MetricsLogger) -> None:
        cfg = self.cfg
        metrics.message(f"model {cfg.model.name}: {self.num_params / 1e6:.2f}M parameters | world {self.rt.world_size} "
                        f"(dp {self.dims.dp}) on {self.device.type}/{self.rt.backend} | "
                        f"{self.tokens_per_step:,} tokens per step")
        for problem in self.skipped_checkpoints:
            metrics.event("checkpoint_skipped", reason=problem)
            metrics.message(f"warning: skipped checkpoint: {problem}")
        if self.skipped_checkpoints and not self.resumed_from:
            metrics.message(f"warning: no checkpoint in {self.ckpt.dir} could be loaded: starting fresh")
        if self.resumed_from:
            metrics.event("resumed", step=self.step, path=self.resumed_from, world_size=self.rt.world_size,
                          config_changes=self.config_changes)
            metrics.message(f"resumed from {self.resumed_from} at step {self.step}")
            for line in self.config_changes.get("safe", []):
                metrics.message(f"  changed since the checkpoint (safe): {line}")
            for line in self.config_changes.get("trajectory", []):
                metrics.message(f"  changed since the checkpoint (the run will differ): {line}")

    def _step_record(self, loss_sum, grad_norm, lr: float, window_steps: int, elapsed: float, data_time: float) -> dict:
        """Collective (loss, peak memory and per-rank compute time over ranks); only on logging steps."""
        mem = torch.tensor([peak_memory_bytes(self.device)], device=self.device, dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        tokens_per_sec = self.tokens_per_step * window_steps / elapsed
        record = {"step": self.step, "time": time.time(), "loss": self._global_mean(loss_sum, self.tokens_per_step), "lr": lr,
                  "grad_norm": float(grad_norm), "tokens_per_sec": tokens_per_sec,
                  "step_time_s": elapsed / window_steps, "data_time_s": data_time,
                  "tokens_seen": self.tokens_seen, "mem_peak_bytes": int(mem.item())}
        if self.peak_flops:
            record["mfu"] = self.flops_per_token * tokens_per_sec / (self.peak_flops * self.rt.world_size)
        if self.precision.scaler.is_enabled():
            record["loss_scale"] = float(self.precision.scaler.get_scale())
            record["fp16_overflows_total"] = int(float(self.fp16_overflows))
        breakdown = self.breakdown.collect(window_steps)
        if self.pipeline is not None or not deepspeed_engine.is_engine(self.model):
            record.update(breakdown)
        else:
            record["time_data_s"] = breakdown["time_data_s"]
        comm = self.comm_profiler.take()
        if comm:
            record.update(comm)
            record["comm_time_s"] = sum(comm.values())
        record.update(memory_stats(self.device))
        record.update(straggler_stats(data_time + self.forward_seconds, self.device))
        if self.pipeline is not None:  # measured pipeline bubble, mean over ranks
            bubble = torch.tensor([self.pipeline.take_bubble() or 0.0], dtype=torch.float64, device=self.device)
            dist.all_reduce(bubble)
            record["pp_bubble"] = float(bubble) / self.rt.world_size
        if self.skipped_steps:
            record["skipped_steps_total"] = len(self.skipped_steps)
        return record

    def fit(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        self.maybe_resume()
        metrics = MetricsLogger(self.run_dir, cfg.metrics, self.rt.rank, self.rt.env.local_rank, t.steps, self.step,
                                run_config=cfg.model_dump(mode="json", by_alias=True))
        self._announce(metrics)
        control = StepControl(cfg.checkpoint.every_minutes, self.rt.rank)
        d = cfg.distributed
        watchdog = (Watchdog(self.rt.rank, self.rt.world_size, d.watchdog_factor, d.watchdog_min_s,
                             str(self.run_dir / "logs" / f"rank_{self.rt.rank:05d}.log"))
                    if d.watchdog_factor else NullWatchdog())
        final_loss = sample = None
        window_t0, window_steps = time.perf_counter(), 0
        every, log_every = cfg.checkpoint.every_steps, cfg.metrics.log_every
        try:
            while self.step < t.steps:
                t_data = time.perf_counter()
                watchdog.enter(f"step {self.step + 1}: loading data")
                micro_batches = next(self.loader)
                data_time = time.perf_counter() - t_data
                self.breakdown.add_seconds("data", data_time)
                self.comm_profiler.start(self.step + 1)
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                # forward/backward hold the gradient collectives
                watchdog.enter(f"step {self.step + 1}: forward/backward/optimizer", collective=True)
                try:
                    loss_sum, grad_norm = self.train_step(micro_batches)
                finally:
                    self.comm_profiler.stop()
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                window_steps += 1
                watchdog.step_done(self.step)
                metrics.observe_step(time.perf_counter() - t_data)
                self.faults.after_step(self.step, self.base_model)
                if self.skipped_steps and self.skipped_steps[-1] == self.step:
                    metrics.event("nonfinite_step_skipped", step=self.step)
                    metrics.message(f"warning: step {self.step} had a non-finite gradient norm: update skipped")
                sync_every = cfg.metrics.sync_check_every
                if sync_every and self.step % sync_every == 0:
                    watchdog.enter(f"step {self.step}: replica sync check", collective=True)
                    check_replicas_in_sync(self.base_model, self.replica_group, self.step)
                if log_every and (self.step % log_every == 0 or self.step == t.steps):
                    watchdog.enter(f"step {self.step}: metrics all-reduce", collective=True)
                    elapsed = time.perf_counter() - window_t0 - self.comm_profiler.take_overhead()
                    record = self._step_record(loss_sum, grad_norm, lr, window_steps, elapsed, data_time)
                    final_loss = record["loss"]
                    metrics.log_step(record)
                    window_t0, window_steps = time.perf_counter(), 0
                    self.comm_profiler.take_overhead()
                if t.eval_every and self.step % t.eval_every == 0:
                    watchdog.enter(f"step {self.step}: evaluation", collective=True)
                    val = self.evaluate()
                    if val is not None:
                        metrics.event("eval", step=self.step, val_loss=val)
                        metrics.message(f"step {self.step}: validation loss {val:.4f}")
                watchdog.enter(f"step {self.step}: step-boundary agreement", collective=True)
                pending = self.ckpt.pending_step is not None
                time_due, preempted, still_writing = control.decide(not self.ckpt.local_write_done())
                if pending and not still_writing:
                    self._commit_pending(metrics)
                if preempted:
                    self.save_checkpoint(metrics, reason="preemption")
                    self._commit_pending(metrics)
                    metrics.event("preempted", step=self.step, exit_code=EXIT_PREEMPTED)
                    metrics.message(f"preempted: saved step {self.step}; exiting with {EXIT_PREEMPTED} so the "
                                    "launcher restarts or requeues the run")
                    raise Preempted(self.step)
                if (every and self.step % every == 0) or time_due or (self.step == t.steps and cfg.checkpoint.save_final):
                    self.save_checkpoint(metrics)
                    control.saved()
                watchdog.touch()  # evaluation and saving are not step time
            self._commit_pending(metrics)
            sample = self.sample() if t.sample_tokens else None
            if sample is not None:
                metrics.message(f"sample: {t.sample_prompt}{sample}")
            metrics.event("finished", step=self.step, run_dir=str(self.run_dir))
        finally:
            watchdog.close()
            control.close()
            metrics.close()
        return TrainResult(self.step, final_loss, str(self.run_dir), sample)

    def sample(self) -> str | None:
        """Every rank runs the same seeded generation (sharded layouts need all ranks in each
        forward); rank 0 reports it."""
        t = self.cfg.train
        if self.pipeline is not None:
            log.info("no sample: generation needs the whole model in one process and pp > 1 splits it")
            return None
        prompt = self.tokenizer.encode_batch([t.sample_prompt])[0]
        pad = self.dims.tp if self.cfg.parallel.sequence_parallel else 1
        ids = generate(self.base_model, prompt, t.sample_tokens, seed=t.seed, stop_id=self.tokenizer.eos_id,
                       pad_multiple=pad)
        return self.tokenizer.decode(ids) if self.rt.is_main else None
