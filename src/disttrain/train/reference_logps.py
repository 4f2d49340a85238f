"""DPO's reference log-probabilities computed once (`dpo.precompute_reference=true`) instead of at every step.

The reference is the model training starts from, so before the first step the policy itself is the reference:
a forward-only pass of the policy over every pair of the training and validation splits, through the engine's
evaluation path (every layout: data, tensor, context, expert, pipeline parallel), gives each row's completion
log-probability. No second model is built and no reference forward runs while training. The values are kept
per pair, `{split: float64 (2 x pairs,)}` (pair i's chosen row at 2i, its rejected row at 2i + 1), in
`reference_logps.pt` beside the run's checkpoints (which may be on object storage, and which a resume reads:
the values stay those of the starting model, whatever layout resumes). Each rank computes its own data-parallel
slice; a maximum over all ranks fills the table (ranks that hold the same rows hold the same values; a row no
rank reached stays -inf and is refused).

During training the loss reads its micro-batch's values by the pairs the step's micro-batches hold
(`select` with the loader's sample ids; micro-batches in order, or a pipeline schedule's micro-batch index).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from disttrain.core import storage
from disttrain.core.errors import UserError
from disttrain.data.loader import DistributedBatchLoader
from disttrain.data.sampling import GlobalBatchSampler
from disttrain.train.jobs import Job

TABLE_FILE = "reference_logps.pt"
PROGRESS_EVERY_S = 30.0


class PrecomputedReference:
    """The reference log-probabilities by split, and which of them the current micro-batches need."""

    def __init__(self, device):
        self.device = device
        self.tables: dict[str, torch.Tensor] = {}
        self._rows: torch.Tensor | None = None  # the step's rows, as indices into its split's table
        self._split, self._next = "train", 0

    def select(self, split: str, ids) -> None:
        """The pairs `ids` (this rank's, in micro-batch order) are what the next micro-batches hold."""
        pairs = torch.as_tensor(ids, dtype=torch.int64)
        if self.device.type == "cuda":  # a pageable copy would wait for the device: pinned, it does not
            pairs = pairs.pin_memory()
        pairs = pairs.to(self.device, non_blocking=True)
        self._rows = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).reshape(-1)
        self._split, self._next = split, 0

    def part(self, rows: int, microbatch: int | None) -> torch.Tensor:
        """Table indices of a micro-batch of `rows` rows: micro-batch `microbatch` of equal ones (a pipeline
        schedule's), else the one after the last asked for."""
        index = self._next if microbatch is None else microbatch
        self._next = index + 1
        return self._rows[index * rows:(index + 1) * rows]

    def values(self, part: torch.Tensor) -> torch.Tensor:
        return self.tables[self._split][part]

    def record(self, part: torch.Tensor, logps: torch.Tensor) -> None:
        self.tables[self._split][part] = logps.to(torch.float64)


class ReferencePass(Job):
    """Collective, before the first step: the reference log-probabilities, read from beside the checkpoints or
    computed by the starting model (and written there by rank 0)."""

    label, collective = "reference log-probabilities", True

    def __init__(self, run):
        self.training_run = run

    def start(self, trainer) -> None:
        run = self.training_run
        objective = run.engine.mean_loss
        reference: PrecomputedReference = objective.precomputed
        run.data.loader.on_step = lambda ids: reference.select("train", ids)  # each step's pairs, as handed out
        splits = {"train": run.data.loader.windows, "val": run.data.val_samples}
        path = storage.join(str(run.checkpoints.dir), TABLE_FILE)
        if storage.isfile(path):
            saved = storage.torch_load(path)
            for split, samples in splits.items():
                if split not in saved or saved[split].numel() != 2 * len(samples):
                    raise UserError(f"dpo.precompute_reference=true: {path} holds reference log-probabilities of "
                                    f"{len(saved.get(split, ())) // 2} {split} pairs, the data {len(samples)}: "
                                    "was data.source changed? (remove the file only before the first step)")
                reference.tables[split] = saved[split].to(run.runtime.device)
            trainer.metrics.message(f"reference log-probabilities of {len(splits['train'])} pairs read from {path}")
            return
        if trainer.step > 0:
            raise UserError(f"dpo.precompute_reference=true: resuming at step {trainer.step}, but {path} is gone; "
                            "the reference's values were the starting model's, which the run no longer holds")
        started = time.perf_counter()
        trainer.watchdog.enter("computing the reference log-probabilities", collective=True)
        objective.recording = True
        run.engine.model.eval()
        try:
            for split, samples in splits.items():
                reference.tables[split] = self._compute(split, samples, reference, run, trainer)
        finally:
            objective.recording = False
            run.engine.model.train()
        if run.runtime.is_main:
            storage.torch_save({k: v.cpu() for k, v in reference.tables.items()}, path)
        dist.barrier()
        trainer.metrics.message(f"reference log-probabilities of {len(splits['train'])} training and "
                                f"{len(splits['val'])} validation pairs computed by the starting model in "
                                f"{time.perf_counter() - started:.1f} s, kept in {path}")

    @staticmethod
    def _compute(split: str, samples, reference: PrecomputedReference, run, trainer) -> torch.Tensor:
        """This split's table: each rank's slices of every global batch through the engine's forward-only
        path, then the maximum over all ranks. Each batch counts as progress to the watchdog (the pass is an
        epoch's forward, longer than any step), and a line says how far it is every half minute."""
        t = run.cfg.train
        reference.tables[split] = torch.full((2 * len(samples),), -math.inf, dtype=torch.float64,
                                             device=run.runtime.device)
        if len(samples):
            sampler = GlobalBatchSampler(len(samples), t.global_batch_size, t.seed, shuffle=False)
            loader = DistributedBatchLoader(samples, sampler, run.dp_rank, run.layout.dp,
                                            run.data.loader.micro_batch_size,
                                            run.data.loader.shares if run.layout.balanced else None,
                                            pad_multiple=run.data.loader.pad_multiple)
            batches, said = math.ceil(len(samples) / t.global_batch_size), time.perf_counter()
            for k in range(1, batches + 1):
                reference.select(split, loader.sample_ids(k))
                run.engine.eval_loss_sum(loader.micro_batches(k))
                trainer.watchdog.touch()
                if time.perf_counter() - said > PROGRESS_EVERY_S and k < batches:
                    trainer.metrics.message(f"reference log-probabilities: {split} batch {k} of {batches}")
                    said = time.perf_counter()
        table = reference.tables[split]
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        missing = int(torch.isinf(table).sum())
        if missing:  # a bug, not a user's mistake: every pair is in some global batch of the pass
            raise RuntimeError(f"{missing} {split} rows got no reference log-probability")
        return table
