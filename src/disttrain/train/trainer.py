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
from torch.distributed.tensor import DTensor

from disttrain.checkpoint.manager import CheckpointManager
from disttrain.config import RunConfig
from disttrain.data.loader import DistributedBatchLoader, GlobalBatchSampler, TokenWindows
from disttrain.data.source import load_splits
from disttrain.distributed.dims import ParallelDims
from disttrain.distributed.runtime import Runtime
from disttrain.models.generate import generate
from disttrain.models.init import build_model, count_params
from disttrain.models.registry import resolve_shape
from disttrain.observe.metrics import MetricsLogger, peak_memory_bytes
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.apply import apply_parallelism, gradient_sync_disabled
from disttrain.parallel.zero1 import build_zero1_optimizer
from disttrain.train import deepspeed_engine
from disttrain.train.optim import build_optimizer, build_scheduler
from disttrain.train.precision import Precision

log = logging.getLogger(__name__)


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
        self.num_params = count_params(self.base_model)
        if cfg.engine == "deepspeed":
            apply_activation_checkpointing(self.base_model, cfg.parallel.activation_checkpointing)
            self.optimizer = build_optimizer(self.base_model, cfg.optim)
            self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
            self.model = deepspeed_engine.initialize(self.base_model, self.optimizer, self.scheduler, cfg,
                                                     rt.world_size, self.device.type == "cuda")
            self.precision = Precision("fp32", self.device)  # DeepSpeed casts and scales itself
        else:
            self.model = apply_parallelism(self.base_model, cfg, self.dims, self.meshes, self.device)
            if cfg.parallel.zero_stage == 1:
                self.optimizer = build_zero1_optimizer(self.model, cfg.optim, self.meshes.dp.get_group())
            else:
                self.optimizer = build_optimizer(self.model, cfg.optim)
            self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
            self.precision = Precision(cfg.precision.compute_dtype, self.device)
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, rt.rank, cfg.checkpoint.keep_last)
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from: str | None = None

    # ---------------------------------------------------------------- state
    def train_state(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.scaler.state_dict(), "loader": self.loader.state_dict(),
                "model_fingerprint": model_fingerprint(self.cfg)}

    def maybe_resume(self) -> None:
        mode = self.cfg.checkpoint.resume
        if mode == "none":
            return
        self.ckpt.remove_uncommitted()
        dist.barrier()
        path = self.ckpt.latest() if mode == "auto" else Path(mode)
        if path is None:
            return
        state = self.ckpt.load(path, self.model, self.optimizer)
        if state["model_fingerprint"] != model_fingerprint(self.cfg):
            raise RuntimeError(f"checkpoint {path} holds a model of another shape than model.* describes")
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.precision.scaler.load_state_dict(state["scaler"])
        self.loader.load_state_dict(state["loader"])
        self.resumed_from = str(path)

    # ---------------------------------------------------------------- one step
    @staticmethod
    def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

    def _forward_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            logits = self.model(inputs)
        return self._loss_sum(logits, targets)

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (sum of this rank's token losses, global grad norm) as device tensors: no host sync."""
        if deepspeed_engine.is_engine(self.model):
            return deepspeed_engine.train_step(self.model, micro_batches, self._loss_sum, self.device)
        local_tokens = sum(y.numel() for _, y in micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        scaler = self.precision.scaler
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with contextlib.nullcontext() if i == last else gradient_sync_disabled(self.model):
                loss = self._forward_loss_sum(x, y)
                scaler.scale(loss / local_tokens).backward()
            loss_sum += loss.detach()
        scaler.unscale_(self.optimizer)
        clip = self.cfg.optim.grad_clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=True)
        if isinstance(grad_norm, DTensor):  # sharded gradients: the norm is already reduced over shards
            grad_norm = grad_norm.full_tensor()
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum, grad_norm

    def _global_mean(self, local_sum: torch.Tensor, total_tokens: int) -> float:
        t = local_sum.detach().clone()
        dist.all_reduce(t, group=self.meshes.dp.get_group())
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
            for x, y in loader.micro_batches(k):
                total += self._forward_loss_sum(x.to(self.device), y.to(self.device))
        self.model.train()
        return self._global_mean(total, t.eval_batches * self.tokens_per_step)

    # ---------------------------------------------------------------- checkpoint triggers
    def _due_by_time(self, last_save: float) -> bool:
        """Rank 0's clock decides and broadcasts, so every rank takes the same branch."""
        minutes = self.cfg.checkpoint.every_minutes
        if not minutes:
            return False
        flag = torch.tensor([float(time.monotonic() - last_save >= 60 * minutes)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def save_checkpoint(self, metrics: MetricsLogger) -> None:
        t0 = time.perf_counter()
        path = self.ckpt.save(self.step, self.model, self.optimizer, self.train_state())
        metrics.event("checkpoint_saved", step=self.step, path=str(path), seconds=time.perf_counter() - t0)

    # ---------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        self.maybe_resume()
        metrics = MetricsLogger(self.run_dir, self.rt.is_main, cfg.metrics.jsonl, t.steps, self.step)
        metrics.message(f"model {cfg.model.name}: {self.num_params / 1e6:.2f}M parameters | world {self.rt.world_size} "
                        f"(dp {self.dims.dp}) on {self.device.type}/{self.rt.backend} | "
                        f"{self.tokens_per_step:,} tokens per step")
        if self.resumed_from:
            metrics.event("resumed", step=self.step, path=self.resumed_from, world_size=self.rt.world_size)
            metrics.message(f"resumed from {self.resumed_from} at step {self.step}")
        final_loss = None
        window_t0, window_steps = time.perf_counter(), 0
        last_save = time.monotonic()
        every = cfg.checkpoint.every_steps
        try:
            while self.step < t.steps:
                t_data = time.perf_counter()
                micro_batches = next(self.loader)
                data_time = time.perf_counter() - t_data
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                loss_sum, grad_norm = self.train_step(micro_batches)
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                window_steps += 1
                log_every = cfg.metrics.log_every
                if log_every and (self.step % log_every == 0 or self.step == t.steps):
                    final_loss = self._global_mean(loss_sum, self.tokens_per_step)
                    elapsed = time.perf_counter() - window_t0
                    mem = torch.tensor([peak_memory_bytes(self.device)], device=self.device, dtype=torch.float64)
                    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
                    record = {"step": self.step, "loss": final_loss, "lr": lr,
                              "grad_norm": float(grad_norm), "tokens_per_sec": self.tokens_per_step * window_steps / elapsed,
                              "step_time_s": elapsed / window_steps, "data_time_s": data_time,
                              "tokens_seen": self.tokens_seen, "mem_peak_bytes": int(mem.item())}
                    if cfg.metrics.peak_tflops:
                        flops = 6 * self.num_params * record["tokens_per_sec"]
                        record["mfu"] = flops / (cfg.metrics.peak_tflops * 1e12 * self.rt.world_size)
                    if self.precision.scaler.is_enabled():
                        record["loss_scale"] = float(self.precision.scaler.get_scale())
                    metrics.log_step(record)
                    window_t0, window_steps = time.perf_counter(), 0
                if t.eval_every and self.step % t.eval_every == 0:
                    val = self.evaluate()
                    if val is not None:
                        metrics.event("eval", step=self.step, val_loss=val)
                        metrics.message(f"step {self.step}: validation loss {val:.4f}")
                if (every and self.step % every == 0) or self._due_by_time(last_save):
                    self.save_checkpoint(metrics)
                    last_save = time.monotonic()
                elif self.step == t.steps and cfg.checkpoint.save_final:
                    self.save_checkpoint(metrics)
            sample = self.sample() if t.sample_tokens else None
            if sample is not None:
                metrics.message(f"sample: {t.sample_prompt}{sample}")
            metrics.event("finished", step=self.step, run_dir=str(self.run_dir))
        finally:
            metrics.close()
        return TrainResult(self.step, final_loss, str(self.run_dir), sample)

    def sample(self) -> str | None:
        """Every rank runs the same seeded generation (sharded layouts need all ranks in each
        forward); rank 0 reports it."""
        t = self.cfg.train
        prompt = self.tokenizer.encode_batch([t.sample_prompt])[0]
        ids = generate(self.base_model, prompt, t.sample_tokens, seed=t.seed, stop_id=self.tokenizer.eos_id)
        return self.tokenizer.decode(ids) if self.rt.is_main else None
