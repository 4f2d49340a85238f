"""Knowledge distillation (`train.objective=distill`): the student learns a teacher's next-token distribution.

Per valid target, with temperature T and both distributions softened by it (p = softmax(logits / T)):
  alpha · T² · KL + (1 - alpha) · the usual cross-entropy on the target,
KL forward, KL(teacher ‖ student) = Σ p_t (log p_t - log p_s), or reverse, KL(student ‖ teacher). T² keeps the
divergence's gradients the size they have at T = 1 (Hinton et al.). The objective is the mean over the global
batch's valid targets, exactly as the language-model loss is (`GlobalMeanLoss`, which this extends), so every
layout and micro-batching gives the same numbers.

The teacher is a Hugging Face model run forward only, on the same inputs just before the student, parallelised
like the student (tensor, context, expert and FSDP sharding; train/preference_reference.py's frozen copy).
With `train.loss_chunk_tokens` the student's output head computes the objective in chunks of tokens
(models/output_head_distill.py) from the teacher's last hidden states and its head weight (under pipelines: those
the teacher's pipeline kept for the micro-batch), so neither model's whole logits exist. With
`train.loss_chunk_tokens=0` the objective is `distill_sum` on both whole logits (gathered whole over the
vocabulary under tensor parallelism).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from disttrain.core.dtypes import at_least_fp32
from disttrain.models.output_head import chunk_output_head, chunkable_head
from disttrain.models.output_head_distill import chunked_distillation
from disttrain.models.spec import IGNORE_INDEX
from disttrain.train.loss import GlobalMeanLoss, replicated_value
from disttrain.train.preference_reference import PipelinePass, run_frozen


def distill_sum(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, cfg) -> torch.Tensor:
    """The sum over the valid targets of alpha·T²·KL + (1 - alpha)·cross-entropy (`cfg`: the distill section).
    Vocabulary-split logits (tensor parallelism) are gathered whole first: the softmaxes and the sum over the
    split vocabulary taken on DTensors gave a wrong gradient (step 1's gradient norm 28% off one process's, the
    loss exact), while a gather's backward is an exact slice of the whole gradient."""
    student, teacher = replicated_value(student), replicated_value(teacher)
    t = cfg.temperature
    log_s = F.log_softmax(at_least_fp32(student) / t, dim=-1)
    log_t = F.log_softmax(at_least_fp32(teacher) / t, dim=-1)
    if cfg.kl == "forward":
        per_token = (log_t.exp() * (log_t - log_s)).sum(-1)
    else:
        per_token = (log_s.exp() * (log_s - log_t)).sum(-1)
    valid = targets != IGNORE_INDEX
    divergence = (per_token * valid).sum() * (t * t)
    if cfg.alpha == 1:
        return cfg.alpha * divergence
    cross_entropy = F.cross_entropy(at_least_fp32(student).flatten(0, -2), targets.flatten(), reduction="sum",
                                    ignore_index=IGNORE_INDEX)
    return cfg.alpha * divergence + (1 - cfg.alpha) * cross_entropy


class DistillLoss(GlobalMeanLoss):
    """GlobalMeanLoss whose per-micro-batch sum is `distill_sum`; `teacher` (inputs -> outputs) is set by the
    builder once the teacher is parallelised."""

    def __init__(self, cfg, logits, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cfg, self.logits = cfg, logits
        self.teacher_logits = logits  # the teacher's outputs -> its logits: its own spec's (set with the teacher)
        self.teacher = None
        self._teacher_head = None  # the teacher's head, when it hands its hidden states over (chunks)
        self._teacher_logits: torch.Tensor | None = None
        self.pipeline_pass = PipelinePass()  # the teacher's pass through a pipeline, before the student's
        self._shape_only = False

    def chunk_the_teacher(self, model, spec, chunk_tokens: int) -> None:
        """With the student's head in chunks, the teacher's hands its hidden states over instead of logits, where
        its family allows (else the student's head reads slices of the teacher's whole logits)."""
        if not self.chunked:
            return
        head, why = chunkable_head(model, spec)
        if why:
            self.description += f"; the teacher's whole logits ({why})"
            return
        chunk_output_head(head, chunk_tokens).hands_over = True
        self._teacher_head = head

    def forward_with_targets(self, targets: torch.Tensor, inputs: torch.Tensor | None = None,
                             microbatch: int | None = None):
        """Before the student's forward of a micro-batch: the teacher's logits of it; on a pipeline's last stage,
        those its teacher pass kept for micro-batch `microbatch`."""
        kept = self.pipeline_pass.get(microbatch)
        if kept is not None:
            self._teacher_logits = kept
        elif self.teacher is not None and inputs is not None:
            with torch.no_grad():
                self._teacher_logits = self.teacher_logits(run_frozen(self.teacher, inputs)).detach()
        if not self.heads:
            return contextlib.nullcontext()
        if self._teacher_logits is None:  # a pipeline's shape inference: the head's loss, of the same shape
            return super().forward_with_targets(targets)
        teacher, self._teacher_logits = self._teacher_logits, None
        if self._teacher_head is not None:  # its hidden states, and its head weight whole over the vocabulary
            weight = self._teacher_head.weight.detach()
            teacher = (teacher, weight.full_tensor() if isinstance(weight, DTensor) else weight)
        else:
            teacher = (replicated_value(teacher),)
        settings = (self.cfg.temperature, self.cfg.alpha, self.cfg.kl == "reverse")
        for head in self.heads:
            head.objective = partial(chunked_distillation, teacher=teacher, settings=settings)
        return super().forward_with_targets(targets)

    def collecting_reference(self):
        """Around a pipeline's forward-only pass of the teacher: each call of the loss keeps its micro-batch's
        logits (all of a step's are held until the student's pass uses them)."""
        return self.pipeline_pass.collecting()

    @contextlib.contextmanager
    def uncounted(self):
        """A pipeline's shape inference calls the loss on placeholder values, with no teacher logits of them."""
        self._shape_only = True
        try:
            yield
        finally:
            self._shape_only = False

    def loss_sum(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        if self.pipeline_pass.active:  # a pipeline's teacher pass: keep the logits, compute nothing
            self.pipeline_pass.keep(self.teacher_logits(outputs).detach())
            return torch.zeros((), device=targets.device)
        if self.head_sum is not None:  # the student's head computed the objective in chunks
            return self.head_sum(outputs)
        teacher, self._teacher_logits = self._teacher_logits, None
        student = self.logits(outputs)
        if self._shape_only:
            teacher = student.detach()
        return distill_sum(student, teacher, self.shard_targets(targets), self.cfg)


def teacher_spec(cfg):
    """(the teacher's model section, its ModelSpec) from `distill.teacher`: a Hugging Face model as `model.hf`
    would take it, or the model a disttrain run directory's config names."""
    from disttrain.config.saved import run_directory
    from disttrain.config.sections import ModelConfig
    from disttrain.models import registry

    run = run_directory(cfg.distill.teacher)
    section = ModelConfig(hf=cfg.distill.teacher) if run is None else \
        run.model.model_copy(update={"lora": None, "init_from": ""})
    return section, registry.model_spec(section)


def load_teacher_weights(model, cfg) -> None:
    """A run directory's teacher: the weights of its newest committed checkpoint (LoRA adapters folded into the
    base); a Hugging Face teacher was built with its own."""
    from disttrain.config.saved import run_directory

    if run_directory(cfg.distill.teacher) is None:
        return
    from disttrain.checkpoint.export import trained_weights
    from disttrain.models.spec import copy_weights

    weights = trained_weights(cfg.distill.teacher, "distill.teacher")
    with torch.no_grad():
        copy_weights(model, weights)
        for name, buffer in model.named_buffers():  # saved buffers too (DeepSeek's routing-correction bias)
            if name in weights:
                buffer.copy_(weights[name])
