"""Rules that span config sections: the one place a RunConfig is judged before any process starts.

`validate_config` needs no world size (run when a config is loaded); `validate_world` adds the
rules that need one (run by the launcher and by every rank). Layout rules come from layout.py,
model rules from the model's shape: nothing here re-derives them. Raises UserError.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from disttrain.errors import UserError
from disttrain.layout import Layout, cut_problems, layout_problems
from disttrain.models.registry import MODEL_SHAPES, model_shape

INSTALL_HINT = ("engine=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install -c constraints.txt "
                "--no-build-isolation 'disttrain[deepspeed]'")


def validate_config(cfg) -> None:
    """Checks that need no world size."""
    if not (cfg.model.hf or cfg.model.spec) and cfg.model.name not in MODEL_SHAPES:
        raise UserError(f"model.name={cfg.model.name}: unknown model (allowed: {', '.join(MODEL_SHAPES)})")
    shape = model_shape(cfg.model)  # None: a user ModelSpec without known dimensions
    if shape is not None:
        _check_shape(cfg, shape)
    problems = cut_problems(shape, Layout.from_config(cfg, world_size=None))
    if problems:
        raise UserError(problems[0])
    _check_keys_for_engine(cfg)
    for key in ("mlflow", "wandb"):
        if getattr(cfg.metrics, key) and importlib.util.find_spec(key) is None:
            raise UserError(f"metrics.{key}=true needs the {key} package, which is not installed "
                            f"(pip install {key}; allowed without it: false)")
    t = cfg.train
    if t.micro_batch_size and t.global_batch_size % t.micro_batch_size:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                        f"train.micro_batch_size={t.micro_batch_size}")
    p = cfg.parallel
    if (p.balance == "auto" or p.balance_weights) and not t.micro_batch_size:
        key = "parallel.balance=auto" if p.balance == "auto" else f"parallel.balance_weights={p.balance_weights}"
        raise UserError(f"{key} needs train.micro_batch_size > 0: uneven shares are counted in micro-batches")
    if (p.balance == "auto" or p.balance_weights) and p.ddp_broadcast_buffers:
        raise UserError("parallel.ddp_broadcast_buffers=true broadcasts buffers in every forward pass, which needs "
                        "the same number of micro-batches on every rank (with uneven shares allowed: false)")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise UserError(f"optim.min_lr={cfg.optim.min_lr} exceeds optim.lr={cfg.optim.lr}")
    if cfg.optim.warmup_steps > t.steps:
        raise UserError(f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds train.steps={t.steps}")
    if not all(0 <= b < 1 for b in cfg.optim.betas):
        raise UserError(f"optim.betas={list(cfg.optim.betas)}: each beta must be in [0, 1)")
    from disttrain.data.source import PY_PREFIX, describe_source

    info = describe_source(cfg.data.source, tokenizer_for(cfg))
    if cfg.data.document_masking and info.eos_id is None and not str(cfg.data.source).startswith(PY_PREFIX):
        raise UserError(f"data.document_masking=true: the tokenizer of data.source={cfg.data.source} has no "
                        "end-of-document token to mask at (allowed with it: false)")
    if shape is not None and shape.vocab_size < info.vocab_size:
        raise UserError(f"model.vocab_size={shape.vocab_size} is smaller than the tokenizer's vocabulary "
                        f"({info.vocab_size} tokens from {info.tokenizer_name}); set model.vocab_size>={info.vocab_size}")


def _check_shape(cfg, shape) -> None:
    if shape.dim % shape.n_heads:
        raise UserError(f"model.n_heads={shape.n_heads} does not divide model.dim={shape.dim}")
    if shape.n_heads % shape.n_kv_heads:
        raise UserError(f"model.n_kv_heads={shape.n_kv_heads} does not divide model.n_heads={shape.n_heads}")
    if (shape.dim // shape.n_heads) % 2:
        raise UserError(f"model.dim={shape.dim} / model.n_heads={shape.n_heads} gives an odd head size; "
                        "rotary embeddings need an even one")
    if cfg.data.seq_len > shape.max_seq_len:
        raise UserError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={shape.max_seq_len}")


def tokenizer_for(cfg) -> str:
    """`data.tokenizer=auto`: the Hugging Face model directory's tokenizer.json when it has one, else bytes."""
    if cfg.data.tokenizer != "auto":
        return cfg.data.tokenizer
    if cfg.model.hf and (Path(cfg.model.hf) / "tokenizer.json").is_file():
        return str(Path(cfg.model.hf) / "tokenizer.json")
    return "byte"


def _check_keys_for_engine(cfg) -> None:
    """Keys that only one engine or one gradient wrapper reads."""
    p, prec = cfg.parallel, cfg.precision
    if prec.compute_dtype == "fp64":
        if cfg.engine == "deepspeed":
            raise UserError("precision.compute_dtype=fp64 needs engine=torch (DeepSpeed trains in fp32, bf16 or fp16; "
                            "allowed with engine=deepspeed: fp32, bf16, fp16)")
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(prec, key) not in ("auto", "fp64"):
                raise UserError(f"precision.{key}={getattr(prec, key)} with precision.compute_dtype=fp64: everything "
                                "is double precision then (allowed: auto, fp64)")
    if cfg.engine == "deepspeed":
        if p.ddp_comm_hook != "none":
            raise UserError(f"parallel.ddp_comm_hook={p.ddp_comm_hook} needs engine=torch (allowed with "
                            "engine=deepspeed: none)")
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(prec, key) not in ("fp32", "auto"):
                raise UserError(f"precision.{key}={getattr(prec, key)} needs engine=torch; with "
                                "engine=deepspeed set precision.compute_dtype (allowed: auto, fp32)")
        if cfg.checkpoint.async_save:
            raise UserError("checkpoint.async=true needs engine=torch (DeepSpeed saves synchronously; allowed: false)")
        try:
            available = importlib.util.find_spec("deepspeed") is not None
        except (ImportError, ValueError):
            available = False
        if not available:
            raise UserError(INSTALL_HINT)
        return
    if p.zero_stage < 2:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(prec, key)
            if value not in ("fp32", "auto") and prec.compute_dtype != "fp64":
                raise UserError(f"precision.{key}={value} needs parallel.zero_stage 2 or 3 (FSDP2's mixed-precision "
                                f"policy); with zero_stage={p.zero_stage} allowed: fp32 (use precision.compute_dtype "
                                "for autocast, parallel.ddp_comm_hook to compress gradients)")
    elif p.ddp_comm_hook != "none":
        raise UserError(f"parallel.ddp_comm_hook={p.ddp_comm_hook} applies to DDP (zero_stage 0 or 1), "
                        f"not zero_stage={p.zero_stage} (use precision.reduce_dtype)")


def _check_model_can_be_cut(cfg, layout: Layout) -> None:
    """Model parallelism needs the model's cooperation (its ModelSpec's plan); imports torch."""
    from disttrain.models.registry import model_spec

    spec = model_spec(cfg.model)
    what = f"model {spec.name}" + (f" from model.hf={cfg.model.hf}" if cfg.model.hf else "")
    if layout.tp > 1 and spec.tensor_parallel is None:
        raise UserError(f"parallel.tp={layout.tp}: {what} has no tensor-parallel plan (allowed for it: parallel.tp=1)")
    if layout.sequence_parallel and not spec.sequence_parallel:
        raise UserError(f"parallel.sequence_parallel=true: {what} has no sequence-parallel plan (allowed for it: "
                        "false)")
    if layout.sequence_parallel and layout.pp > 1 and cfg.model.hf:
        raise UserError(f"parallel.sequence_parallel=true with parallel.pp={layout.pp}: {what} (a later pipeline "
                        "stage of a transformers model sees only its sequence slice and cannot derive positions); "
                        "allowed for it: sequence parallel or pipeline, not both")
    if layout.pp > 1 and (spec.pipeline_split is None or spec.shape is None):
        raise UserError(f"parallel.pp={layout.pp}: {what} cannot be split into pipeline stages (needs the usual "
                        "model.embed_tokens / model.layers / model.norm / lm_head decoder; allowed for it: "
                        "parallel.pp=1)")


def _check_document_masking(cfg, layout: Layout) -> None:
    """Masking needs token ids with end-of-document tokens, seen by the whole model at once."""
    from disttrain.data.source import PY_PREFIX
    from disttrain.models.registry import model_spec

    source = cfg.data.source
    if isinstance(source, str) and source.startswith(PY_PREFIX):
        raise UserError(f"data.document_masking=true needs token windows with end-of-document tokens; "
                        f"data.source={source} gives (input, target) pairs (allowed with it: false)")
    if layout.pp > 1:
        raise UserError(f"data.document_masking=true with parallel.pp={layout.pp}: a later pipeline stage sees "
                        "hidden states, not the token ids the document boundaries come from (allowed: "
                        "parallel.pp=1, or document_masking=false)")
    spec = model_spec(cfg.model)
    if spec.mask_documents is None:
        raise UserError(f"data.document_masking=true: model {spec.name} has no document masking (its ModelSpec "
                        "sets no mask_documents; allowed for it: false)")


def _check_model_can_be_balanced(cfg) -> None:
    """Uneven shares mean ranks run different numbers of forward passes: nothing may communicate in one."""
    from disttrain.models.registry import model_spec

    spec = model_spec(cfg.model)
    if spec.sync_batchnorm:
        raise UserError(f"parallel.balance/balance_weights: model {spec.name} synchronises BatchNorm over data "
                        "parallel in every forward pass, which needs the same number of micro-batches on every "
                        "rank (allowed for it: equal shares)")


def validate_world(cfg, world_size: int, device_type: str = "cuda") -> Layout:
    """Checks that need the number of processes (and the device kind); returns the resolved Layout."""
    layout = Layout.from_config(cfg, world_size, device_type)  # raises on degrees that miss the world size
    problems = layout_problems(model_shape(cfg.model), layout)
    if problems:
        raise UserError(problems[0])
    if layout.tp > 1 or layout.pp > 1:
        _check_model_can_be_cut(cfg, layout)
    if layout.balanced and layout.dp > 1:
        _check_model_can_be_balanced(cfg)
    if cfg.data.document_masking:
        _check_document_masking(cfg, layout)
    if cfg.parallel.compile and layout.tp > 1 and device_type == "cpu":
        # torch 2.13: the compiled block's backward hands a plain tensor to DTensor's redistribute
        # backward ("'Tensor' object has no attribute '_local_tensor'"); eager TP and compiled DDP/FSDP work.
        raise UserError(f"parallel.compile=true with parallel.tp={layout.tp} does not run on CPU with this torch "
                        "(compiled DTensor backward fails); allowed on CPU: parallel.compile=false with tp > 1, "
                        "or compile with tp=1")
    return layout
