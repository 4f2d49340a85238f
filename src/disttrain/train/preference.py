"""Preference objectives (`train.objective` dpo, simpo, orpo) on pairs of sequences, with TRL's meanings.

Each micro-batch holds whole pairs, each pair's chosen row followed by its rejected row
(data/preference_samples.py). The model's logits give every row's log-probability of its completion (the sum
over its valid targets); the pair losses follow:
- dpo: the log-ratios to a reference model, `sigmoid` -log σ(β Δ) (with label smoothing ε: conservative DPO,
  -(1-ε) log σ(β Δ) - ε log σ(-β Δ)), `hinge` relu(1 - β Δ), `ipo` (Δ/len - 1/(2β))², the log-ratios averaged
  over each completion's tokens as TRL does;
- simpo: no reference, -log σ(β (mean log-prob chosen - mean log-prob rejected) - γ);
- orpo: no reference, the chosen completion's cross-entropy (its mean over the completion's tokens, the ORPO
  paper's per-example form) plus λ -log σ(log-odds ratio of the mean log-probabilities).
The objective is their mean over the pairs of the global batch, whatever the layout: a micro-batch returns its
share times dp (`GlobalMeanLoss`'s convention), so data-parallel gradient averaging gives the global gradient.
Under context parallelism each rank holds a shard of every row: the rows' log-probabilities are summed over the
context ranks by an all-reduce whose backward sums the gradients back (`torch.distributed.nn.functional`), and
each context rank carries 1/cp of the pair losses (it counts as a data-parallel rank in the averaging).

The reference of dpo is the model before training: with LoRA the same model with its adapters switched off (no
second copy), otherwise a frozen copy parallelised like the policy (train/preference_reference.py). Its forward
runs just before the policy's, on the same inputs, without gradients.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from disttrain.core.dtypes import at_least_fp32
from disttrain.models.output_head import ChunkedLossHead, chunk_the_head_of, targets_for
from disttrain.models.packed_targets import count_sequences, sequences_of, split, with_sequences
from disttrain.models.spec import IGNORE_INDEX
from disttrain.train.loss import replicated_value
from disttrain.train.preference_reference import PipelinePass, run_frozen

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each sequence's summed log-probability of its valid targets, their count), in at least fp32: a row's, or
    with packed targets each tagged sequence's (models/packed_targets.py). Under tensor parallelism the logits
    are vocabulary-sharded DTensors and the loss context's cross-entropy reduces them."""
    sequences = sequences_of(targets)
    labels, sequence = split(targets) if sequences is not None else (targets, None)
    per_token = F.cross_entropy(at_least_fp32(logits).flatten(0, -2), labels.flatten(), reduction="none",
                                ignore_index=IGNORE_INDEX)
    per_token = replicated_value(per_token).view(targets.shape)
    valid = (labels != IGNORE_INDEX).to(per_token.dtype)
    if sequence is None:
        return -per_token.sum(-1), valid.sum(-1)
    sums = per_token.new_zeros(sequences).index_add_(0, sequence.flatten(), per_token.flatten())
    return -sums, valid.new_zeros(sequences).index_add_(0, sequence.flatten(), valid.flatten())


def pair_losses(objective: str, cfg, chosen, rejected, chosen_len, rejected_len, ref_chosen=None,
                ref_rejected=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each pair's loss, chosen reward, rejected reward): the formulas of the module docstring. `cfg`: the
    config's dpo section."""
    beta = cfg.beta
    if objective == "dpo":
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        if cfg.loss_type == "sigmoid":
            eps = cfg.label_smoothing
            loss = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        elif cfg.loss_type == "hinge":
            loss = torch.relu(1 - beta * delta)
        else:  # ipo
            mean_delta = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(min=1)
            loss = (mean_delta - 1 / (2 * beta)) ** 2
        return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    chosen_mean, rejected_mean = chosen / chosen_len.clamp(min=1), rejected / rejected_len.clamp(min=1)
    if objective == "simpo":
        loss = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - cfg.gamma)
        return loss, beta * chosen_mean.detach(), beta * rejected_mean.detach()
    log_odds = (chosen_mean - rejected_mean) - (torch.log1p(-torch.exp(chosen_mean))
                                                 - torch.log1p(-torch.exp(rejected_mean)))
    loss = -chosen_mean - cfg.lambda_ * F.logsigmoid(log_odds)
    return loss, cfg.lambda_ * chosen_mean.detach(), cfg.lambda_ * rejected_mean.detach()


def _target_counts(targets: torch.Tensor) -> torch.Tensor:
    """Each sequence's number of valid targets: a row's, or packed, each tagged sequence's."""
    sequences = sequences_of(targets)
    if sequences is None:
        return (targets != IGNORE_INDEX).sum(-1)
    labels, sequence = split(targets)
    valid = (labels != IGNORE_INDEX).flatten().long()
    return valid.new_zeros(sequences).index_add_(0, sequence.flatten(), valid)


class PreferenceLoss:
    """The engines' loss (GlobalMeanLoss's protocol) for a preference objective. `start_step` resets the step's
    sums; each call takes one micro-batch of whole pairs."""

    def __init__(self, objective: str, cfg, logits, dp_group, dp: int, pairs_per_step: int, shard_targets=None,
                 cp_group=None, cp: int = 1, packed: bool = False):
        self.objective, self.cfg, self.logits = objective, cfg, logits
        self.packed = packed  # several sequences a row, their targets tagged (models/packed_targets.py)
        self.dp_group, self.dp = dp_group, dp
        self.shard_targets = shard_targets or (lambda targets: targets)
        self.cp_group, self.cp = cp_group, cp
        self.targets: torch.Tensor | int = pairs_per_step  # the divisor of the logged loss: pairs
        self.divisor: torch.Tensor | float = pairs_per_step / dp
        self.reference = None  # inputs -> model outputs of the reference (dpo), set by the builder
        self.precomputed = None  # or its log-probabilities computed once (train/reference_logps.py)
        self.recording = False  # the pass that computes them: each micro-batch's are kept, no loss
        self._part: torch.Tensor | None = None  # the precomputed table's rows of the current micro-batch
        self._frozen_heads: list | None = None  # a frozen reference's chunked heads
        self.description, self.chunked = "whole logits", False
        self.heads: list[ChunkedLossHead] = []  # this rank's chunked output heads, returning rows' log-probs
        self._ref: torch.Tensor | None = None
        self._shape_only = False  # a pipeline's shape inference calls the loss on placeholder values
        self.pipeline_pass = PipelinePass()  # the reference's pass through a pipeline, before the policy's
        self._sums: torch.Tensor | None = None
        self._eval_sums: torch.Tensor | None = None  # the validation pass's, beside the training step's

    def chunk_the_head(self, model, spec, chunk_tokens: int) -> None:
        """The output head returns each row's log-probability of its completion, computed in chunks of tokens
        (models/output_head.py), where the family allows (on a pipeline, the last stage's)."""
        head, self.description = chunk_the_head_of(model, spec, chunk_tokens)
        if head is not None:
            head.per_row, self.chunked = True, True

    def find_heads(self, model) -> None:
        self.heads = [m for m in model.modules() if isinstance(m, ChunkedLossHead)]

    def forward_with_targets(self, targets: torch.Tensor, inputs: torch.Tensor | None = None,
                             microbatch: int | None = None):
        """Before the policy's forward of a micro-batch: the reference's log-probabilities of it (dpo); on a
        pipeline's last stage, those its reference pass collected for micro-batch `microbatch`."""
        kept = self.pipeline_pass.get(microbatch)
        if self.precomputed is not None:
            self._part = self.precomputed.part(self._sequences(targets), microbatch)
            self._ref = None if self.recording else self.precomputed.values(self._part)
        elif kept is not None:
            self._ref = kept
        elif self.reference is not None and inputs is not None:
            with torch.no_grad(), targets_for(self._reference_heads(), self._shard(targets)):
                self._ref = self._logps(run_frozen(self.reference, inputs), targets)[0].detach()
        return targets_for(self.heads, self._shard(targets)) if self.heads else contextlib.nullcontext()

    def _sequences(self, targets: torch.Tensor) -> int:
        """The sequences a micro-batch's (whole, unsharded) targets hold: its rows, or packed, its tagged
        sequences (counted on the host by the engine, else here)."""
        if not self._tagged(targets):
            return targets.shape[0]
        count = sequences_of(targets)
        return count if count is not None else count_sequences(targets)

    def _shard(self, targets: torch.Tensor) -> torch.Tensor:
        """This rank's part of the targets (its context shard), knowing how many sequences the whole holds."""
        return with_sequences(self.shard_targets(targets), self._sequences(targets) if self._tagged(targets) else None)

    def _tagged(self, targets: torch.Tensor) -> bool:
        """Packed pairs' targets; not the dry run's fake batch, unpacked rows at full width (the worst case)."""
        from torch._subclasses.fake_tensor import is_fake

        return self.packed and not is_fake(targets) and targets.device.type != "meta"

    def _reference_heads(self) -> list:
        """The reference's chunked heads: a frozen copy's own (found once), or the policy's (LoRA: its adapters
        off)."""
        if not isinstance(self.reference, torch.nn.Module):
            return self.heads
        if self._frozen_heads is None:
            self._frozen_heads = [m for m in self.reference.modules() if isinstance(m, ChunkedLossHead)]
        return self._frozen_heads

    def collecting_reference(self):
        """Around a pipeline's forward-only pass of the reference: each call of the loss keeps its micro-batch's
        log-probabilities instead of computing a loss."""
        return self.pipeline_pass.collecting()

    @contextlib.contextmanager
    def uncounted(self):
        """Around a forward whose loss is not one of the step's (a pipeline's shape inference): its rewards stay
        out of the step's metrics."""
        sums, self._sums, self._shape_only = self._sums, None, True
        try:
            yield
        finally:
            self._sums, self._shape_only = sums, False

    def _logps(self, outputs, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each whole row's completion log-probability and length (summed over the context ranks' shards)."""
        logits, targets = self.logits(outputs), self._shard(targets)
        if logits.dim() == 1:  # a chunked head's rows' log-probabilities (replicated over tensor parallel)
            logps = replicated_value(logits)
            lengths = _target_counts(targets).to(logps.dtype)
        else:
            logps, lengths = sequence_logps(logits, targets)
        if self.cp_group is not None:
            from torch.distributed.nn.functional import all_reduce

            logps = all_reduce(logps, group=self.cp_group)
            dist.all_reduce(lengths, group=self.cp_group)
        return logps, lengths

    def start_step(self, targets: list[torch.Tensor]) -> None:
        """The step's metric sums start at zero (no collective: the pairs of a step are known)."""
        self._sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=targets[0].device)

    def _pairs(self, outputs, targets: torch.Tensor):
        logps, lengths = self._logps(outputs, targets)
        ref = self._ref if not self._shape_only else logps.detach()
        self._ref = None
        return pair_losses(self.objective, self.cfg, logps[0::2], logps[1::2], lengths[0::2], lengths[1::2],
                           *((ref[0::2], ref[1::2]) if ref is not None else ())), logps, lengths

    def loss_sum(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's pair losses summed; a training step also adds its rewards to the step's sums."""
        if self.pipeline_pass.active or self.recording:  # a reference pass: keep, compute nothing
            logps = self._logps(outputs, targets)[0].detach()
            if self.recording and not self._shape_only:
                self.precomputed.record(self._part, logps)
            elif not self.recording:
                self.pipeline_pass.keep(logps)
            return torch.zeros((), dtype=logps.dtype, device=logps.device)
        (loss, chosen_reward, rejected_reward), logps, lengths = self._pairs(outputs, targets)
        total = loss.sum() / self.cp  # each context rank holds the whole rows' losses
        sums = self._sums if torch.is_grad_enabled() else self._eval_sums  # evaluation runs without gradients
        if sums is not None:
            c, r = logps[0::2].detach(), logps[1::2].detach()
            if self.objective != "dpo":  # the per-token means these objectives compare
                c, r = c / lengths[0::2].clamp(min=1), r / lengths[1::2].clamp(min=1)
            values = (chosen_reward, rejected_reward, (chosen_reward > rejected_reward).to(c.dtype),
                      chosen_reward - rejected_reward, c, r, torch.ones_like(c))
            sums += torch.stack([v.double().sum() for v in values])
        return total

    def __call__(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(outputs, targets) / self.divisor

    def valid_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Pairs (evaluation divides the loss sum by them; each context rank counts 1/cp of them)."""
        return torch.tensor(self._sequences(targets) / 2 / self.cp, dtype=torch.float64, device=targets.device)

    def as_sum(self, loss: torch.Tensor) -> torch.Tensor:
        return replicated_value(loss.detach()).double() * self.divisor

    def metrics(self) -> dict:
        """Collective over every rank: the step's rewards and log-probabilities, averaged over its pairs (TRL's
        names, so that dashboards carry over). Tensor and context ranks add the same pairs as often as they count
        them, and a pipeline's earlier stages add nothing: the averages are the global batch's."""
        return self._averages(self._sums)

    def start_evaluation(self) -> None:
        self._eval_sums = torch.zeros_like(self._sums) if self._sums is not None else None

    def evaluation_metrics(self) -> dict:
        """Collective: `metrics` over the validation pass's pairs."""
        averages, self._eval_sums = self._averages(self._eval_sums), None
        return averages

    @staticmethod
    def _averages(sums: torch.Tensor | None) -> dict:
        if sums is None:
            return {}
        sums = sums.clone()
        dist.all_reduce(sums)
        pairs = max(float(sums[-1]), 1.0)
        return {name: float(value) / pairs for name, value in zip(METRICS, sums[:-1].tolist())}
