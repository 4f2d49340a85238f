"""`train.objective` -> the loss every engine backpropagates, and the frozen model it reads (DPO's reference,
distillation's teacher), attached once the policy is parallelised."""

from __future__ import annotations

import torch

from disttrain.train.loss import GlobalMeanLoss


def make_objective(cfg, spec, layout, meshes, samples, shard_targets):
    """The engines' loss for `train.objective` (GlobalMeanLoss's protocol). `shard_targets`: this rank's shard of
    a target tensor under context parallelism (None: cp = 1)."""
    t, dp_group = cfg.train, meshes.dp_cp.get_group()
    if t.objective in ("dpo", "simpo", "orpo"):  # preference pairs (checked by data/rules.py)
        from disttrain.train.preference import PreferenceLoss

        return PreferenceLoss(t.objective, cfg.dpo, spec.logits, dp_group, layout.gradient_ranks, t.global_batch_size,
                              shard_targets, meshes.cp.get_group() if layout.cp > 1 else None, layout.cp,
                              packed=getattr(samples, "packs_micro_batches", False))  # packing or padding=none
    args = (spec.loss_sum, dp_group, layout.gradient_ranks, samples.masks_targets,
            t.global_batch_size * samples.targets_per_sample, shard_targets)
    if t.objective == "distill":
        from disttrain.train.distill import DistillLoss

        return DistillLoss(cfg.distill, spec.logits, *args)
    return GlobalMeanLoss(*args)


def attach_frozen_model(objective, cfg, spec, layout, meshes, device, engine, lora: bool, tokenizer,
                        masks_targets: bool, document_eos: int | None, on_meta=None, stage_io=None) -> None:
    """DPO's reference (the policy's adapters switched off under LoRA, else a frozen copy of the starting model;
    with dpo.precompute_reference none, only a table of its values) or distillation's teacher, parallelised like
    the policy. `on_meta(module)`: the dry run's, which builds the frozen model on the meta device and makes it
    fake tensors once parallelised; `stage_io(model_spec, hands_over)`: the dry run's stage shapes of a frozen
    model's pipeline (parallel/pipeline.py build_pipeline), whose last stage returns logits, or its hidden states
    where `hands_over` (a teacher's head handing them to the student's)."""
    from disttrain.train import preference_reference as reference
    from disttrain.train.starting_model import starting_model

    def start(model_spec, section=None):
        if on_meta is not None:
            with torch.device("meta"):
                return model_spec.build()
        return starting_model(cfg if section is None else cfg.model_copy(update={"model": section}), model_spec,
                              layout, device, tokenizer, masks_targets)

    def frozen(model, model_spec):
        module = reference.frozen_copy(model, model_spec, layout, meshes, device, cfg.parallel, document_eos)
        if on_meta is not None:
            on_meta(module)
        return module

    kind = cfg.train.objective
    if kind == "dpo" and cfg.dpo.precompute_reference:  # no reference model: its values, computed once
        from disttrain.train.reference_logps import PrecomputedReference

        objective.precomputed = PrecomputedReference(device)
        return
    if kind == "dpo" and layout.pp > 1:  # the reference's forward runs through a pipeline of its own (or the policy's)
        from disttrain.parallel.pipeline import build_pipeline

        engine.reference = (engine.parts, reference.lora_layers(engine.model)) if lora else (build_pipeline(
            start(spec), spec, layout, meshes, device, cfg.parallel, objective, layout.microbatches, materialize=on_meta,
            stage_io=stage_io(spec, False) if stage_io else None, frozen=True), [])
    elif kind == "dpo" and lora:
        objective.reference = reference.lora_reference(engine.model)
    elif kind == "dpo":
        copy = start(spec)
        objective.chunk_the_head(copy, spec, layout.loss_chunk_tokens)  # as the policy's (before parallelising)
        objective.reference = frozen(copy, spec)
    elif kind == "distill":
        from disttrain.train.distill import load_teacher_weights, teacher_spec

        section, teacher = teacher_spec(cfg)
        objective.teacher_logits = teacher.logits  # a Hugging Face teacher of a built-in student, say
        model = start(teacher, section)
        if on_meta is None:
            load_teacher_weights(model, cfg)
        objective.chunk_the_teacher(model, teacher, layout.loss_chunk_tokens)  # before parallelising
        if layout.pp > 1:  # the teacher's forward through a pipeline of its own, before the student's
            from disttrain.parallel.pipeline import build_pipeline

            io = stage_io(teacher, objective._teacher_head is not None) if stage_io else None
            engine.reference = (build_pipeline(model, teacher, layout, meshes, device, cfg.parallel, objective,
                                               layout.microbatches, materialize=on_meta, stage_io=io, frozen=True), [])
        else:
            objective.teacher = frozen(model, teacher)
