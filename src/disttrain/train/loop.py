"""The training loop: steps through the engine, with hooks around it for timing, faults, the
watchdog, health checks, metrics, evaluation and checkpoints. It never asks which engine runs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from disttrain.checkpoint.manager import SaveFailed
from disttrain.data.loader import DistributedBatchLoader, MixtureSamples
from disttrain.data.sampling import GlobalBatchSampler
from disttrain.data.source import truncation_warnings, validation_gaps
from disttrain.core.errors import EXIT_PREEMPTED
from disttrain.models.generate import generate
from disttrain.observe.console import start_line
from disttrain.observe.health import check_replicas_in_sync, rank_stats
from disttrain.observe.metrics import MetricsLogger, peak_memory_bytes
from disttrain.observe.model_bytes import memory_stats
from disttrain.train.builder import Run
from disttrain.train.engine import StepResult
from disttrain.train.resilience import NullWatchdog, StepControl, Watchdog, WatchdogPhases
from disttrain.train.resume import Progress, maybe_resume, train_state



class Preempted(Exception):
    """Raised after the emergency checkpoint; the CLI exits with EXIT_PREEMPTED."""


class CheckpointFailed(Exception):
    """The final or the emergency checkpoint could not be saved; the CLI exits with EXIT_STORAGE."""


@dataclass
class TrainResult:
    final_step: int
    final_loss: float | None
    run_dir: str
    sample: str | None = None


class Trainer:
    def __init__(self, run: Run):
        self.run = run
        self.cfg, self.engine = run.cfg, run.engine
        self.progress = Progress()
        self.watchdog = NullWatchdog()

    @property
    def step(self) -> int:
        return self.progress.step

    # ---------------------------------------------------------------- global numbers (collectives)
    def _global_sums(self, *local: torch.Tensor) -> list[float]:
        """Collective (only on logging and evaluation steps): float64 sums added over every group the engine
        names (data parallel; the pipeline too, where only the last stage has the loss)."""
        t = torch.stack([x.detach().double() for x in local]).to(self.run.rt.device)
        for group in self.engine.loss_groups:
            dist.all_reduce(t, group=group)
        return t.tolist()

    def evaluate(self) -> tuple[float | None, dict[str, float]]:
        """Validation loss, and for a mixture each source's (the overall figure weighs them like training)."""
        val = self.run.val_samples
        if not isinstance(val, MixtureSamples):
            return (self._eval_split(val) if len(val) else None), {}
        weights = list(self.cfg.data.source.values())
        by_source = {name: (self._eval_split(part), w) for name, part, w in zip(val.names, val.parts, weights)
                     if len(part)}
        by_source = {name: vw for name, vw in by_source.items() if vw[0] is not None}
        if not by_source:
            return None, {}
        total = sum(w for _, w in by_source.values())
        return sum(v * w for v, w in by_source.values()) / total, {n: v for n, (v, _) in by_source.items()}

    def _eval_split(self, samples) -> float | None:
        run, t = self.run, self.cfg.train
        sampler = GlobalBatchSampler(len(samples), t.global_batch_size, t.seed, shuffle=False)
        loader = DistributedBatchLoader(samples, sampler, run.dp_rank, run.layout.dp, t.micro_batch_size,
                                        run.loader.shares if run.layout.balanced else None)
        self.engine.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=run.rt.device)  # loss sum, valid targets
        for k in range(1, t.eval_batches + 1):
            total += torch.stack(self.engine.eval_loss_sum(loader.micro_batches(k)))
        self.engine.model.train()
        loss_sum, targets = self._global_sums(*total)
        return loss_sum / targets if targets else None  # every validation target masked: nothing to report

    def _step_record(self, result: StepResult, lr: float, window_steps: int, elapsed: float,
                     data_time: float) -> dict:
        """Collective (loss, peak memory and per-rank compute time over ranks); only on logging steps."""
        run, device = self.run, self.run.rt.device
        tokens_per_sec = run.tokens_per_step * window_steps / elapsed
        loss = self._global_sums(result.loss_sum)[0] / float(result.targets)
        record = {"step": self.step, "time": time.time(), "loss": loss,
                  "lr": lr, "grad_norm": float(result.grad_norm), "tokens_per_sec": tokens_per_sec,
                  "step_time_s": elapsed / window_steps, "data_time_s": data_time,
                  "tokens_seen": self.progress.tokens_seen}
        if run.peak_flops and run.flops_per_token:
            record["mfu"] = run.flops_per_token * tokens_per_sec / (run.peak_flops * run.rt.world_size)
        record.update(run.breakdown.collect(window_steps))
        comm = run.comm_profiler.take()
        if comm:
            record.update(comm)
            record["comm_time_s"] = sum(comm.values())
        record.update(memory_stats(device))
        record.update(rank_stats(data_time + run.compute_clock.seconds, peak_memory_bytes(device), device))
        record.update(self.engine.extra_metrics())
        if run.routing is not None:
            record.update(run.routing.record())
        if run.layout.balanced:
            record["balance_shares"] = list(run.balancer.shares)
        if self.engine.skipped_steps:
            record["skipped_steps_total"] = len(self.engine.skipped_steps)
        return record

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, metrics: MetricsLogger, reason: str = "interval", last: bool = False) -> None:
        """Synchronous: saved and committed. Async: `blocking_s` is what training waited for.
        `last`: no later save would retry a failure (the final or the emergency save)."""
        ckpt, t0 = self.run.ckpt, time.perf_counter()
        self.watchdog.enter(f"step {self.step}: checkpoint save", collective=True)
        try:
            path = ckpt.save(self.step, self.engine, train_state(self.run, self.progress))
        except SaveFailed as exc:
            self._save_failed(metrics, exc, last)
            return
        seconds = time.perf_counter() - t0
        if ckpt.pending_step is None:
            metrics.event("checkpoint_saved", step=self.step, path=str(path), seconds=seconds, reason=reason)
        else:
            metrics.event("checkpoint_started", step=self.step, path=str(path), blocking_s=seconds, reason=reason)
        self.run.faults.after_save(self.step)

    def _commit_pending(self, metrics: MetricsLogger, last: bool = False) -> None:
        try:
            done = self.run.ckpt.commit_pending()
        except SaveFailed as exc:
            self._save_failed(metrics, exc, last)
            return
        if done:
            metrics.event("checkpoint_saved", step=done[0], path=str(self.run.ckpt.step_dir(done[0])),
                          seconds=done[1], reason="async")

    @staticmethod
    def _save_failed(metrics: MetricsLogger, exc: SaveFailed, last: bool) -> None:
        """The storage policy: a failed save is reported in one line and retried at the next interval while
        training goes on; when no later save would retry it (final, emergency), the run fails."""
        metrics.event("checkpoint_failed", step=exc.step, message=str(exc), last=last)
        if last:
            raise CheckpointFailed(str(exc))
        metrics.message(f"warning: {exc}; training continues, the next checkpoint retries")

    # ---------------------------------------------------------------- loop
    def _announce(self, metrics: MetricsLogger) -> None:
        run, p = self.run, self.progress
        name = run.spec.label
        metrics.event("started", step=p.step, world_size=run.rt.world_size, layout=run.layout.describe())
        metrics.message(start_line(name, run.num_params, run.layout, f"{run.rt.device.type}/{run.rt.backend}",
                                   run.tokenizer.name if run.tokenizer is not None else None,
                                   f"{run.tokens_per_step:,} {'tokens' if run.tokenizer is not None else 'samples'}"))
        data = self.cfg.data
        gaps = validation_gaps(data.source, run.val_samples, data.seq_len) if self.cfg.train.eval_every else []
        for line in [*self.cfg.warnings, *gaps, *truncation_warnings(data.source, run.loader.windows, data.seq_len)]:
            metrics.event("warning", message=line)
            metrics.message(f"warning: {line}")
        if run.layout.balanced:
            metrics.event("balance", step=p.step, shares=list(run.loader.shares), mode=run.layout.balance,
                          weights=list(run.layout.balance_weights))
            metrics.message(f"uneven shares: micro-batches per data-parallel rank {run.loader.shares}"
                            + (f", re-split every {self.cfg.parallel.balance_every} steps by measured speed"
                               if run.balancer.auto else ""))
        for problem in p.skipped_checkpoints:
            metrics.event("checkpoint_skipped", reason=problem)
            metrics.message(f"warning: skipped checkpoint: {problem}")
        if p.skipped_checkpoints and not p.resumed_from:
            metrics.message(f"warning: no checkpoint in {run.ckpt.dir} could be loaded: starting fresh")
        if p.resumed_from:
            metrics.event("resumed", step=p.step, path=p.resumed_from, world_size=run.rt.world_size,
                          config_changes=p.config_changes)
            metrics.message(f"resumed from {p.resumed_from} at step {p.step}")
            for line in p.config_changes.get("safe", []):
                metrics.message(f"  changed since the checkpoint (safe): {line}")
            for line in p.config_changes.get("trajectory", []):
                metrics.message(f"  changed since the checkpoint (the run will differ): {line}")

    def fit(self) -> TrainResult:
        run, cfg, t, p = self.run, self.cfg, self.cfg.train, self.progress
        maybe_resume(run, p)
        metrics = MetricsLogger(cfg.run_dir, cfg.metrics, run.rt.rank, run.rt.env.local_rank, t.steps, p.step,
                                run_config=cfg.model_dump(mode="json", by_alias=True))
        self._announce(metrics)
        control = StepControl(cfg.checkpoint.every_minutes, run.rt.rank)
        d = cfg.distributed
        watchdog = (Watchdog(run.rt.rank, run.rt.world_size, d.watchdog_factor, d.watchdog_min_s,
                             str(cfg.run_dir / "logs" / f"rank_{run.rt.rank:05d}.log"))
                    if d.watchdog_factor else NullWatchdog())
        self.watchdog = watchdog
        if d.watchdog_factor:
            self.engine.phases.subscribe(WatchdogPhases(watchdog), outermost=True)
        final_loss = sample = None
        window_t0, window_steps = time.perf_counter(), 0
        every, log_every = cfg.checkpoint.every_steps, cfg.metrics.log_every
        try:
            while p.step < t.steps:
                t_data = time.perf_counter()
                watchdog.enter(f"step {p.step + 1}: loading data")
                micro_batches = next(run.loader)
                data_time = time.perf_counter() - t_data
                run.breakdown.add_seconds("data", data_time)
                run.comm_profiler.start(p.step + 1)
                lr = self.engine.lr()  # the rate this step uses
                try:
                    result = self.engine.train_step(micro_batches, p.step + 1)
                finally:
                    run.comm_profiler.stop()
                p.step += 1
                p.tokens_seen += run.tokens_per_step
                window_steps += 1
                watchdog.step_done(p.step)
                metrics.observe_step(time.perf_counter() - t_data)
                run.faults.after_step(p.step, run.base_model)
                if self.engine.skipped_steps and self.engine.skipped_steps[-1] == p.step:
                    metrics.event("nonfinite_step_skipped", step=p.step)
                    metrics.message(f"warning: step {p.step} had a non-finite gradient norm: update skipped")
                sync_every = cfg.metrics.sync_check_every
                if sync_every and p.step % sync_every == 0:
                    watchdog.enter(f"step {p.step}: replica sync check", collective=True)
                    check_replicas_in_sync(run.base_model, run.replica_group, p.step)
                if log_every and (p.step % log_every == 0 or p.step == t.steps):
                    watchdog.enter(f"step {p.step}: metrics all-reduce", collective=True)
                    elapsed = time.perf_counter() - window_t0 - run.comm_profiler.take_overhead()
                    record = self._step_record(result, lr, window_steps, elapsed, data_time)
                    final_loss = record["loss"]
                    metrics.log_step(record)
                    window_t0, window_steps = time.perf_counter(), 0
                    run.comm_profiler.take_overhead()
                if t.eval_every and p.step % t.eval_every == 0:
                    watchdog.enter(f"step {p.step}: evaluation", collective=True)
                    val, by_source = self.evaluate()
                    if val is not None:
                        extra = {"val_loss_by_source": by_source} if by_source else {}
                        metrics.event("eval", step=p.step, val_loss=val, **extra)
                        metrics.message(f"step {p.step}: validation loss {val:.4f}" + "".join(
                            f", {n} {v:.4f}" for n, v in by_source.items()))
                if run.balancer.due(p.step):
                    watchdog.enter(f"step {p.step}: balance measurement all-gather", collective=True)
                    self._rebalance(metrics)
                watchdog.enter(f"step {p.step}: step-boundary agreement", collective=True)
                self._step_boundary(control, metrics)
                watchdog.touch()  # evaluation and saving are not step time
            self._commit_pending(metrics, last=True)
            sample = self.sample() if t.sample_tokens else None
            why_not = self._no_sample_because() if t.sample_tokens else None
            if why_not:
                metrics.event("sample_skipped", reason=why_not)
                metrics.message(f"no sample: {why_not}")
            if sample is not None:
                metrics.message(f"sample: {t.sample_prompt}{sample}")
                metrics.event("sample", step=p.step, prompt=t.sample_prompt, text=sample)
            metrics.event("finished", step=p.step, run_dir=str(cfg.run_dir))
        finally:
            watchdog.close()
            control.close()
            metrics.close()
            run.loader.close()
        return TrainResult(p.step, final_loss, str(cfg.run_dir), sample)

    def _rebalance(self, metrics: MetricsLogger) -> None:
        """Collective: a new split of the global batch from measured speed, used from the next step."""
        event = self.run.balancer.rebalance(self.progress.step)
        if event is not None:
            self.run.loader.set_shares(self.run.balancer.shares)
            metrics.event("rebalance", **event)
            metrics.message(f"step {event['step']}: rebalanced micro-batches per data-parallel rank "
                            f"{event['previous_shares']} -> {event['shares']} (seconds per micro-batch "
                            f"{event['seconds_per_micro_batch']})")

    def _step_boundary(self, control: StepControl, metrics: MetricsLogger) -> None:
        """Collective: every rank agrees on saving (by time) and on stopping (preemption)."""
        ckpt, step, every = self.run.ckpt, self.progress.step, self.cfg.checkpoint.every_steps
        pending = ckpt.pending_step is not None
        decision = control.decide(not ckpt.local_write_done())
        if pending and not decision.write_pending:
            self._commit_pending(metrics)
        if decision.preempted:
            self.save_checkpoint(metrics, reason="preemption", last=True)
            self._commit_pending(metrics, last=True)
            metrics.event("preempted", step=step, exit_code=EXIT_PREEMPTED)
            metrics.message(f"preempted: saved step {step}; exiting with {EXIT_PREEMPTED} so the launcher "
                            "restarts or requeues the run")
            raise Preempted(step)
        final = step == self.cfg.train.steps and self.cfg.checkpoint.save_final
        if (every and step % every == 0) or decision.save_due or final:
            self.save_checkpoint(metrics, last=step == self.cfg.train.steps)  # no later save would retry it
            control.saved()

    def _no_sample_because(self) -> str | None:
        if self.run.tokenizer is None:
            return f"generation needs a tokenizer (data.source={self.cfg.data.source} gives token ids)"
        if self.run.layout.pp > 1:
            return f"generation needs the whole model in one process (parallel.pp={self.run.layout.pp} splits it)"
        if self.run.layout.cp > 1:  # the attention kernel expects this rank's shard of a full-length sequence
            return f"generation needs whole sequences in each process (parallel.cp={self.run.layout.cp} shards them)"
        return None

    def sample(self) -> str | None:
        """Every rank runs the same seeded generation (sharded layouts need all ranks in each
        forward); rank 0 reports it."""
        run, t = self.run, self.cfg.train
        if self._no_sample_because():
            return None
        chat_prompt = getattr(run.tokenizer, "chat_prompt", None)  # chat data: a user turn through its template
        prompt = chat_prompt(t.sample_prompt) if chat_prompt else run.tokenizer.encode_batch([t.sample_prompt])[0]
        pad = run.layout.tp if run.layout.sequence_parallel else 1
        ids = generate(run.base_model, prompt, t.sample_tokens, run.spec.max_seq_len, seed=t.seed,
                       stop_id=getattr(run.tokenizer, "stop_id", run.tokenizer.eos_id), pad_multiple=pad,
                       logits_of=run.spec.logits)
        return run.tokenizer.decode(ids) if run.rt.is_main else None
