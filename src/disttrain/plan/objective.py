"""What a training objective adds to a language-model step, for the planner (`train.objective`; docs/guide.md,
"Preference optimisation and distillation"):

- preference pairs (dpo, simpo, orpo): a sample is two sequences, so every micro-batch holds twice the rows;
- a frozen model beside the trained one (dpo's reference, unless its values are computed once ahead; distill's
  teacher): its parameters, sharded as the trained model's are (tensor and pipeline splits, FSDP shards), in the
  trained model's storage dtype, with no gradients or optimizer states;
- its forward in every step (plan/frozen_time.py), or under LoRA the forward of dpo's reference, the policy itself
  with its adapters off (no parameters of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.layout.layout import Layout
from disttrain.models.shape import ModelShape

PREFERENCE = ("dpo", "simpo", "orpo")


@dataclass(frozen=True)
class ObjectiveTerms:
    name: str = "lm"
    rows: int = 1  # sequences per sample
    frozen: ModelShape | None = None  # the reference's or the teacher's shape
    forward: ModelShape | None = None  # a forward-only pass of the policy's own parameters (dpo's LoRA reference)
    teacher: str = ""  # distill.teacher, as given

    @property
    def forward_shape(self) -> ModelShape | None:
        """The shape of the forward-only pass a step runs besides the trained model's (None: none)."""
        return self.frozen if self.frozen is not None else self.forward

    def describe(self) -> str:
        """What the estimate counted beyond a language-model step, or ""."""
        if self.name == "lm":
            return ""
        parts = [f"train.objective={self.name}"] + (["pairs: twice the rows"] if self.rows > 1 else [])
        if self.frozen is not None:
            parts.append(f"a frozen {'teacher' if self.name == 'distill' else 'reference'} of "
                         f"{self.frozen.num_params() / 1e6:,.1f}M parameters")
        elif self.forward is not None:
            parts.append("the reference's forward (the policy with its adapters off)")
        return ", ".join(parts)


def objective_terms(cfg, shape: ModelShape) -> ObjectiveTerms:
    """The terms of a run config's objective; `shape`: the trained model's (dpo's reference has it)."""
    name = cfg.train.objective
    teacher = cfg.distill.teacher if name == "distill" else ""
    return terms(name, shape, teacher, cfg.dpo.precompute_reference, cfg.model.lora is not None)


def terms(name: str, shape: ModelShape, teacher: str = "", precompute_reference: bool = False,
          lora: bool = False) -> ObjectiveTerms:
    """`name`'s terms for a trained model of `shape`: dpo runs a reference (a frozen copy; under LoRA the policy with
    its adapters off; none with precomputed values), distill `teacher` (as distill.teacher names it, or a registry
    shape's name)."""
    if name in PREFERENCE:
        reference = name == "dpo" and not precompute_reference
        return ObjectiveTerms(name, 2, shape if reference and not lora else None, shape if reference and lora else None)
    if name == "distill":
        from disttrain.models.registry import MODEL_SHAPES

        return ObjectiveTerms(name, 1, MODEL_SHAPES.get(teacher) or teacher_shape(teacher), teacher=teacher)
    return ObjectiveTerms()


def teacher_shape(teacher: str) -> ModelShape:
    """`distill.teacher`'s shape: a Hugging Face model directory's, or the model a disttrain run directory names."""
    from disttrain.config.saved import run_directory
    from disttrain.config.sections import ModelConfig
    from disttrain.models import registry

    run = run_directory(teacher)
    return registry.model_shape(ModelConfig(hf=teacher) if run is None else run.model)


def distill_head_bytes(objective: ObjectiveTerms, shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """(kept, transient) that distillation's chunked output head adds to the language-model loss's
    (plan/activations.py chunked_loss_bytes) on the last stage. Kept through the micro-batch: the teacher's last
    hidden states (the residual's dtype; under pipelines, every micro-batch's, which the teacher's own pass left
    before the student's), and its head weight made whole (fp32) where it is sharded (ZeRO-2/3,
    tensor parallel). While a chunk is at hand (models/output_head_distill.py): the teacher's chunk of logits
    beside the student's, each cast to fp32, and the two log-softmaxes with one exponential taken from them, where
    the language-model loss holds one fp32 copy and two more (torch's tracker on the loop alone: 6.1-6.4 fp32
    chunks at bf16, 512-1,024 tokens, 384-4,096 words)."""
    if objective.name != "distill" or not layout.loss_chunk_tokens or objective.frozen is None:
        return 0.0, 0.0
    from disttrain.plan.activations import FP32, dtype_bytes

    ec, er = dtype_bytes(layout)
    stat = 8 if layout.compute_dtype == "fp64" else FP32
    copy = stat if stat != ec else 0
    tokens = layout.micro_batch * (layout.seq_len // layout.cp)
    chunk = min(tokens, layout.loss_chunk_tokens)
    teacher = objective.frozen
    whole_weight = FP32 * teacher.vocab_size * teacher.dim if layout.zero_stage >= 2 or layout.tp > 1 else 0.0
    kept = er * tokens * teacher.dim * (layout.microbatches if layout.pp > 1 else 1) + whole_weight
    return kept, (ec + copy + stat) * chunk * shape.vocab_size / layout.tp


def frozen_pipeline_bytes(objective: ObjectiveTerms, layout: Layout, pp_rank: int) -> float:
    """A frozen model's own pipeline (train/pipeline_engine.py): the receive buffers its stages allocate once for
    every micro-batch's input and keep (each stage but the first; a forward-only stage has no gradient buffers).
    What its stages keep for a backward goes as soon as its pass ends; none under LoRA, whose reference runs
    through the policy's own stages."""
    if objective.frozen is None or layout.pp <= 1:
        return 0.0
    from disttrain.plan.activations import stage_output_bytes

    receiving = sum(local * layout.pp + pp_rank > 0 for local in range(layout.stages_per_rank))
    return layout.microbatches * receiving * stage_output_bytes(objective.frozen, layout)
