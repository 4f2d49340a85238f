"""Two jobs that read the model rather than train it: the validation loss every `train.eval_every` steps, and a
sample generated from the final model (`train.sample_tokens`)."""

from __future__ import annotations

import torch

from disttrain.data.loader import DistributedBatchLoader, MixtureSamples
from disttrain.data.sampling import GlobalBatchSampler
from disttrain.models.generate import generate
from disttrain.train.jobs import Job, every


class Evaluation(Job):
    """Collective: the validation loss over `train.eval_batches` global batches, and for a mixture each source's
    (the overall figure weighs them like training)."""

    label, collective = "evaluation", True

    def __init__(self, run):
        self.training_run, self.interval = run, run.cfg.train.eval_every

    def due(self, step: int) -> bool:
        return every(self.interval, step)

    def run(self, trainer) -> None:
        objective = self.training_run.engine.mean_loss
        objective.start_evaluation()
        val, by_source = self.evaluate(trainer)
        own = objective.evaluation_metrics()  # a preference objective's rewards on the validation pairs
        if val is not None:
            extra = {"val_loss_by_source": by_source} if by_source else {}
            trainer.metrics.event("eval", step=trainer.step, val_loss=val, **extra, **own)
            trainer.metrics.message(f"step {trainer.step}: validation loss {val:.4f}" + "".join(
                f", {n} {v:.4f}" for n, v in by_source.items()) + "".join(
                f", {n} {own[n]:.4f}" for n in ("rewards/accuracies", "rewards/margins") if n in own))

    def evaluate(self, trainer) -> tuple[float | None, dict[str, float]]:
        val = self.training_run.data.val_samples
        if not isinstance(val, MixtureSamples):
            return (self._split_loss(trainer, val) if len(val) else None), {}
        weights = list(self.training_run.cfg.data.source.values())
        by_source = {name: (self._split_loss(trainer, part), w) for name, part, w in zip(val.names, val.parts, weights)
                     if len(part)}
        by_source = {name: vw for name, vw in by_source.items() if vw[0] is not None}
        if not by_source:
            return None, {}
        total = sum(w for _, w in by_source.values())
        return sum(v * w for v, w in by_source.values()) / total, {n: v for n, (v, _) in by_source.items()}

    def _split_loss(self, trainer, samples) -> float | None:
        run, t = self.training_run, self.training_run.cfg.train
        sampler = GlobalBatchSampler(len(samples), t.global_batch_size, t.seed, shuffle=False)
        loader = DistributedBatchLoader(samples, sampler, run.dp_rank, run.layout.dp, run.data.loader.micro_batch_size,
                                        run.data.loader.shares if run.layout.balanced else None)
        engine = run.engine
        reference = getattr(engine.mean_loss, "precomputed", None)  # dpo's reference values, kept per pair
        engine.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=run.runtime.device)  # loss sum, valid targets
        for k in range(1, t.eval_batches + 1):
            if reference is not None:
                reference.select("val", loader.sample_ids(k))
            total += torch.stack(engine.eval_loss_sum(loader.micro_batches(k)))
        engine.model.train()
        loss_sum, targets = trainer.global_sums(*total)
        return loss_sum / targets if targets else None  # every validation target masked: nothing to report


class Sampling(Job):
    """After the last step, `train.sample_tokens` tokens from the final model. Every rank runs the same seeded
    generation (sharded layouts need all ranks in each forward); rank 0 reports it."""

    label, collective = "sampling", True

    def __init__(self, run):
        self.training_run = run

    def why_not(self) -> str | None:
        run = self.training_run
        if run.data.tokenizer is None:
            return f"generation needs a tokenizer (data.source={run.cfg.data.source} gives token ids)"
        if run.layout.pp > 1:
            return f"generation needs the whole model in one process (parallel.pp={run.layout.pp} splits it)"
        if run.layout.cp > 1:  # the attention kernel expects this rank's shard of a full-length sequence
            return f"generation needs whole sequences in each process (parallel.cp={run.layout.cp} shards them)"
        return None

    def finish(self, trainer) -> None:
        t = self.training_run.cfg.train
        if not t.sample_tokens:
            return
        why_not = self.why_not()
        if why_not:
            trainer.metrics.event("sample_skipped", reason=why_not)
            trainer.metrics.message(f"no sample: {why_not}")
            return
        trainer.watchdog.enter(f"step {trainer.step}: {self.label}", collective=True)
        trainer.sample = self.sample()
        if trainer.sample is not None:
            trainer.metrics.message(f"sample (temperature {t.sample_temperature:g}, top-k {t.sample_top_k or 'all'}): "
                                    f"{t.sample_prompt}{trainer.sample}")
            trainer.metrics.event("sample", step=trainer.step, prompt=t.sample_prompt, text=trainer.sample)

    def sample(self) -> str | None:
        run, t = self.training_run, self.training_run.cfg.train
        tokenizer, spec = run.data.tokenizer, run.model.spec
        chat_prompt = getattr(tokenizer, "chat_prompt", None)  # chat data: a user turn through its template
        prompt = chat_prompt(t.sample_prompt) if chat_prompt else tokenizer.encode_batch([t.sample_prompt])[0]
        pad = run.layout.tp if run.layout.sequence_parallel else 1
        ids = generate(run.model.module, prompt, t.sample_tokens, spec.max_seq_len, seed=t.seed,
                       temperature=t.sample_temperature, top_k=t.sample_top_k,
                       stop_id=getattr(tokenizer, "stop_id", tokenizer.eos_id), pad_multiple=pad,
                       logits_of=spec.logits)
        return tokenizer.decode(ids) if run.runtime.is_main else None
