"""What a config's sections say to each other, read from the config alone (no model shape, layout or world size):
run by `load_config` in every process, before anything else. Each check returns `Problem`s whose message is
the one line a user reads."""

from __future__ import annotations

import importlib.util

from disttrain.layout.problem import Problem
from disttrain.models.registry import MODEL_SHAPES

INSTALL_HINT = ("engine=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install -c constraints.txt "
                "--no-build-isolation 'disttrain[deepspeed]'")


def _problem(key: str, value, message: str, allowed: str = "see the message") -> Problem:
    return Problem(key, value, allowed, message)


def config_problems(cfg) -> list[Problem]:
    """Checks of the config alone, in the order users meet them; the first is what `load_config` reports."""
    problems = []
    if not (cfg.model.hf or cfg.model.spec) and cfg.model.name not in MODEL_SHAPES:
        problems.append(_problem("model.name", cfg.model.name, f"model.name={cfg.model.name}: unknown model (allowed: "
                                 f"{', '.join(MODEL_SHAPES)})", ", ".join(MODEL_SHAPES)))
    problems += engine_key_problems(cfg)
    for key in ("mlflow", "wandb"):
        if getattr(cfg.metrics, key) and importlib.util.find_spec(key) is None:
            problems.append(_problem(f"metrics.{key}", True, f"metrics.{key}=true needs the {key} package, which is not "
                                     f"installed (pip install {key}; allowed without it: false)", "false"))
    t, parallel = cfg.train, cfg.parallel
    if t.micro_batch_size and t.global_batch_size % t.micro_batch_size:
        problems.append(_problem("train.micro_batch_size", t.micro_batch_size, f"train.global_batch_size="
                                 f"{t.global_batch_size} is not a multiple of train.micro_batch_size="
                                 f"{t.micro_batch_size}"))
    auto, weights = parallel.balance == "auto", parallel.balance_weights
    uneven = auto or weights
    key = "parallel.balance=auto" if auto else f"parallel.balance_weights={weights}"
    if uneven and not t.micro_batch_size:
        problems.append(_problem("train.micro_batch_size", 0, f"{key} needs train.micro_batch_size > 0: uneven shares "
                                 "are counted in micro-batches"))
    if uneven and parallel.ddp_broadcast_buffers:
        problems.append(_problem("parallel.ddp_broadcast_buffers", True, "parallel.ddp_broadcast_buffers=true "
                                 "broadcasts buffers in every forward pass, which needs the same number of micro-batches "
                                 "on every rank (with uneven shares allowed: false)", "false"))
    o = cfg.optim
    if o.min_lr > o.lr:
        problems.append(_problem("optim.min_lr", o.min_lr, f"optim.min_lr={o.min_lr} exceeds optim.lr={o.lr}"))
    if o.warmup_steps > t.steps:
        problems.append(_problem("optim.warmup_steps", o.warmup_steps, f"optim.warmup_steps={o.warmup_steps} exceeds "
                                 f"train.steps={t.steps}"))
    if not all(0 <= b < 1 for b in o.betas):
        problems.append(_problem("optim.betas", list(o.betas), f"optim.betas={list(o.betas)}: each beta must be in "
                                 "[0, 1)"))
    if o.schedule == "wsd" and o.decay_steps is not None and o.decay_steps > t.steps - o.warmup_steps:
        problems.append(_problem("optim.decay_steps", o.decay_steps, f"optim.decay_steps={o.decay_steps} exceeds "
                                 f"train.steps - optim.warmup_steps = {t.steps - o.warmup_steps}"))
    if o.name == "muon":
        problems += _muon_problems(cfg)
    if o.state_dtype != "fp32" and cfg.engine == "deepspeed":
        problems.append(_problem("optim.state_dtype", o.state_dtype, f"optim.state_dtype={o.state_dtype} needs "
                                 "engine=torch (DeepSpeed keeps its own optimizer states; allowed with "
                                 "engine=deepspeed: fp32)", "fp32"))
    return problems + float8_problems(cfg) + int8_state_problems(cfg)


def int8_state_problems(cfg) -> list[Problem]:
    """optim.state_dtype=int8: torchao's 8-bit AdamW, where it holds plain tensors or FSDP2's / TP's DTensors."""
    if cfg.optim.state_dtype != "int8" or cfg.engine == "deepspeed":  # (DeepSpeed: refused above)
        return []
    conflicts = [(cfg.optim.name == "muon", "optim.name=muon", "8-bit states are AdamW's (torchao's AdamW8bit)"),
                 (cfg.parallel.zero_stage == 1, "parallel.zero_stage=1", "ZeRO-1's sharded optimizer keeps its own "
                  "states (use zero_stage 2 or 3, which shard 8-bit states too)"),
                 (cfg.parallel.ep > 1, f"parallel.ep={cfg.parallel.ep}", "expert shards' states are shown whole in "
                  "checkpoints, which 8-bit blocks do not allow"),
                 (cfg.precision.compute_dtype == "fp64", "precision.compute_dtype=fp64", "the 8-bit step computes "
                  "in fp32")]
    why = next((c[1:] for c in conflicts if c[0]), None)  # the first that applies
    if why:
        return [_problem("optim.state_dtype", "int8", f"optim.state_dtype=int8 with {why[0]}: {why[1]} "
                         "(allowed there: fp32, bf16)", "fp32, bf16")]
    if importlib.util.find_spec("torchao") is None:
        return [_problem("optim.state_dtype", "int8", "optim.state_dtype=int8 needs torchao, which is not installed "
                         f"({FLOAT8_HINT}; allowed without it: fp32, bf16)", "fp32, bf16")]
    return []


FLOAT8_HINT = "pip install -c constraints.txt 'disttrain[float8]'"


def float8_problems(cfg) -> list[Problem]:
    """precision.float8=rowwise: torchao's float8 training, under the torch engine, from fp32 or bf16 compute."""
    if cfg.precision.float8 == "off":
        return []
    compute = cfg.precision.compute_dtype
    if compute in ("fp16", "fp64"):
        why = "fp16's range is too narrow for float8's scaling" if compute == "fp16" else \
            "float8 rounding is what fp64 runs exist to rule out"
        return [_problem("precision.float8", "rowwise", f"precision.float8=rowwise with precision.compute_dtype="
                         f"{compute}: {why} (allowed with float8: fp32, bf16; or precision.float8=off)", "off")]
    if cfg.engine == "deepspeed":
        return [_problem("precision.float8", "rowwise", "precision.float8=rowwise needs engine=torch (DeepSpeed builds "
                         "its own modules; allowed with engine=deepspeed: off)", "off")]
    if importlib.util.find_spec("torchao") is None:
        return [_problem("precision.float8", "rowwise", "precision.float8=rowwise needs torchao, which is not "
                         f"installed ({FLOAT8_HINT}; allowed without it: off)", "off")]
    return []


def _muon_problems(cfg) -> list[Problem]:
    """What Muon does not compose with: LoRA's adapters, DeepSpeed's own optimizer step."""
    if cfg.model.lora is not None:
        return [_problem("optim.name", "muon", "optim.name=muon with model.lora: LoRA trains low-rank adapters, "
                         "whose factors Muon's orthogonalisation does not suit (allowed with model.lora: adamw)",
                         "adamw")]
    if cfg.engine == "deepspeed":
        return [_problem("optim.name", "muon", "optim.name=muon needs engine=torch (DeepSpeed steps its own "
                         "optimizer; allowed with engine=deepspeed: adamw)", "adamw")]
    return []


def engine_key_problems(cfg) -> list[Problem]:
    """Keys that only one engine or one gradient wrapper reads."""
    prec, hook, stage = cfg.precision, cfg.parallel.ddp_comm_hook, cfg.parallel.zero_stage
    if prec.compute_dtype == "fp64":
        if cfg.engine == "deepspeed":
            return [_problem("precision.compute_dtype", "fp64", "precision.compute_dtype=fp64 needs engine=torch "
                             "(DeepSpeed trains in fp32, bf16 or fp16; allowed with engine=deepspeed: fp32, bf16, fp16)")]
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(prec, key) not in ("auto", "fp64"):
                return [_problem(f"precision.{key}", getattr(prec, key), f"precision.{key}={getattr(prec, key)} with "
                                 "precision.compute_dtype=fp64: everything is double precision then (allowed: auto, "
                                 "fp64)", "auto, fp64")]
    if cfg.engine == "deepspeed":
        if hook != "none":
            return [_problem("parallel.ddp_comm_hook", hook, f"parallel.ddp_comm_hook={hook} needs engine=torch "
                             "(allowed with engine=deepspeed: none)", "none")]
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(prec, key) not in ("fp32", "auto"):
                return [_problem(f"precision.{key}", getattr(prec, key), f"precision.{key}={getattr(prec, key)} needs "
                                 "engine=torch; with engine=deepspeed set precision.compute_dtype (allowed: auto, fp32)",
                                 "auto, fp32")]
        if cfg.checkpoint.async_save:
            return [_problem("checkpoint.async", True, "checkpoint.async=true needs engine=torch (DeepSpeed saves "
                             "synchronously; allowed: false)", "false")]
        if "://" in cfg.checkpoint.dir:
            return [_problem("checkpoint.dir", cfg.checkpoint.dir, f"checkpoint.dir={cfg.checkpoint.dir} needs "
                             "engine=torch (DeepSpeed writes to local paths only; allowed with engine=deepspeed: a local "
                             "or mounted directory)")]
        return []
    if stage < 2:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(prec, key)
            if value not in ("fp32", "auto") and prec.compute_dtype != "fp64":
                return [_problem(f"precision.{key}", value, f"precision.{key}={value} needs parallel.zero_stage 2 or 3 "
                                 f"(FSDP2's mixed-precision policy); with zero_stage={stage} allowed: fp32 (use "
                                 "precision.compute_dtype for autocast, parallel.ddp_comm_hook to compress gradients)",
                                 "fp32")]
    elif hook != "none":
        return [_problem("parallel.ddp_comm_hook", hook, f"parallel.ddp_comm_hook={hook} applies to DDP (zero_stage 0 "
                         f"or 1), not zero_stage={stage} (use precision.reduce_dtype)", "none")]
    return []


def engine_installed(ctx) -> list[Problem]:
    """engine=deepspeed needs the package on this machine (not needed to plan or export its config)."""
    if ctx.cfg.engine != "deepspeed":
        return []
    try:
        available = importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        available = False
    return [] if available else [_problem("engine", "deepspeed", INSTALL_HINT, "torch")]


def callback_problems(ctx) -> list[Problem]:
    """`train.callbacks`: each names something that loads and can be called (it makes a job when training starts)."""
    from disttrain.core.errors import UserError
    from disttrain.core.user_code import load_function

    for ref in ctx.cfg.train.callbacks:
        try:
            load_function("train.callbacks", ref)
        except UserError as exc:
            return [_problem("train.callbacks", ref, str(exc), "FILE.py:Name or package.module:Name")]
    return []


def distill_problems(ctx) -> list[Problem]:
    """train.objective=distill: a teacher with weights, the student's vocabulary and tokenizer."""
    import hashlib
    from pathlib import Path

    from disttrain.config.saved import has_committed_checkpoint, run_directory
    from disttrain.config.sections import ModelConfig
    from disttrain.core.errors import UserError
    from disttrain.core.hub import local_directory
    from disttrain.models import registry

    cfg = ctx.cfg
    teacher = cfg.distill.teacher
    if cfg.train.objective != "distill":
        return []
    if not teacher:
        return [_problem("distill.teacher", "", "train.objective=distill needs distill.teacher=DIR (a Hugging Face "
                         "model directory or Hub id with weights, or a disttrain run directory)", "a model directory")]
    if cfg.engine == "deepspeed":
        return [_problem("engine", "deepspeed", "engine=deepspeed with train.objective=distill: the teacher is "
                         "sharded by the torch engine's layouts only, so far (allowed: engine=torch)", "torch")]
    run = run_directory(teacher)
    try:
        if run is not None:  # a disttrain run: its model and tokenizer as its config says; weights: its checkpoint
            shape, own = registry.model_shape(run.model), Path(run.tokenizer or "byte")
        else:
            directory = Path(local_directory(teacher, "distill.teacher"))
            shape, own = registry.model_shape(ModelConfig(hf=teacher)), directory / "tokenizer.json"
    except UserError as exc:
        return [_problem("distill.teacher", teacher, str(exc))]
    if run is not None and not has_committed_checkpoint(teacher, run):
        return [_problem("distill.teacher", teacher, f"distill.teacher={teacher}: this run directory holds no "
                         "committed checkpoint to teach with (allowed: a run with one, e.g. after "
                         "checkpoint.save_final=true)")]
    if run is None and not any(directory.glob("*.safetensors")) and not any(directory.glob("*.bin")):
        return [_problem("distill.teacher", teacher, f"distill.teacher={teacher}: holds no weights (*.safetensors): "
                         "a teacher initialised at random teaches nothing (allowed: a model saved with weights, or "
                         "a disttrain run directory)")]
    if ctx.shape is not None and shape is not None and shape.vocab_size != ctx.shape.vocab_size:
        return [_problem("distill.teacher", teacher, f"distill.teacher={teacher}: its vocabulary has "
                         f"{shape.vocab_size} tokens, the student's {ctx.shape.vocab_size}: the two distributions "
                         "must be over the same tokens (allowed: a teacher with the student's tokenizer)")]
    from disttrain.data.source import PY_PREFIX, tokenizer_file

    source = cfg.data.source
    data = ctx.tokenizer if isinstance(source, str) and source.startswith(PY_PREFIX) else \
        tokenizer_file(source, ctx.tokenizer)
    if own.is_file() and data != "byte" and Path(data).is_file() and \
            hashlib.sha256(own.read_bytes()).digest() != hashlib.sha256(Path(data).read_bytes()).digest():
        return [_problem("distill.teacher", teacher, f"distill.teacher={teacher}: its tokenizer.json differs from "
                         f"the run's ({data}): teacher and student must share the tokenizer")]
    return []
