"""Rules that span config sections: what a RunConfig's sections say to each other.

`validate_config` needs nothing but the config (run when a config is loaded, in every process);
`check_shape`, `check_data` and `check_engine_installed` need the model's shape or this machine and
run once, from `resolve.resolve_run`. Layout rules live in layout.py, model rules in the model's shape
and spec: nothing here re-derives them. Raises UserError.
"""

from __future__ import annotations

import importlib.util

from disttrain.core.errors import UserError
from disttrain.models.registry import MODEL_SHAPES

INSTALL_HINT = ("engine=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install -c constraints.txt "
                "--no-build-isolation 'disttrain[deepspeed]'")


def validate_config(cfg) -> None:
    """Checks of the config alone: no model shape, no layout, no world size."""
    if not (cfg.model.hf or cfg.model.spec) and cfg.model.name not in MODEL_SHAPES:
        raise UserError(f"model.name={cfg.model.name}: unknown model (allowed: {', '.join(MODEL_SHAPES)})")
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


def check_shape(cfg, shape) -> None:
    """The model's dimensions against each other and against data.seq_len."""
    if shape.dim % shape.n_heads:
        raise UserError(f"model.n_heads={shape.n_heads} does not divide model.dim={shape.dim}")
    if shape.n_heads % shape.n_kv_heads:
        raise UserError(f"model.n_kv_heads={shape.n_kv_heads} does not divide model.n_heads={shape.n_heads}")
    if (shape.dim // shape.n_heads) % 2:
        raise UserError(f"model.dim={shape.dim} / model.n_heads={shape.n_heads} gives an odd head size; "
                        "rotary embeddings need an even one")
    moe = shape.moe
    if moe is not None and moe.num_experts_per_tok > moe.num_experts:
        raise UserError(f"model.moe.num_experts_per_tok={moe.num_experts_per_tok} exceeds model.moe.num_experts="
                        f"{moe.num_experts} (allowed: 1 to {moe.num_experts})")
    if moe is not None and moe.first_k_dense_replace > shape.n_layers:
        raise UserError(f"model.moe.first_k_dense_replace={moe.first_k_dense_replace} exceeds model.n_layers="
                        f"{shape.n_layers}")
    if moe is None and (cfg.model.moe.aux_loss_coef or cfg.model.moe.bias_update_rate or cfg.model.moe.capacity_factor):
        key = next(k for k in ("aux_loss_coef", "bias_update_rate", "capacity_factor") if getattr(cfg.model.moe, k))
        raise UserError(f"model.moe.{key}={getattr(cfg.model.moe, key)} on a dense model (no router; allowed: 0)")
    if moe is not None and cfg.model.moe.aux_loss_coef and cfg.precision.compute_dtype == "fp16":
        raise UserError(f"model.moe.aux_loss_coef={cfg.model.moe.aux_loss_coef} with precision.compute_dtype=fp16: "
                        "the balancing loss's gradient bypasses fp16 loss scaling (allowed: bf16, fp32, fp64)")
    if moe is not None and cfg.engine == "deepspeed" and cfg.model.moe.bias_update_rate:
        raise UserError(f"model.moe.bias_update_rate={cfg.model.moe.bias_update_rate} with engine=deepspeed: the bias "
                        "moves after the torch engine's optimizer step (allowed with deepspeed: 0)")
    if moe is not None and cfg.model.hf and cfg.model.moe.bias_update_rate:
        raise UserError(f"model.moe.bias_update_rate={cfg.model.moe.bias_update_rate} with model.hf={cfg.model.hf}: "
                        "transformers' routers choose experts without a balancing bias (allowed: 0)")
    if cfg.data.seq_len > shape.max_seq_len:
        raise UserError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={shape.max_seq_len}")


def check_data(cfg, shape, tokenizer: str) -> None:
    """The data keys (read without any tokens) against the model and `data.document_masking`."""
    from disttrain.data.source import PY_PREFIX, describe_source

    source = cfg.data.source
    info = describe_source(source, tokenizer)
    if cfg.data.document_masking and isinstance(source, str) and source.startswith(PY_PREFIX):
        raise UserError(f"data.document_masking=true needs token windows with end-of-document tokens; "
                        f"data.source={source} gives (input, target) pairs (allowed with it: false)")
    if cfg.data.document_masking and info.eos_id is None:
        raise UserError(f"data.document_masking=true: the tokenizer of data.source={source} has no "
                        "end-of-document token to mask at (allowed with it: false)")
    if cfg.data.packing:
        _check_packing(source)
    if shape is not None and shape.vocab_size < info.vocab_size:
        raise UserError(f"model.vocab_size={shape.vocab_size} is smaller than the tokenizer's vocabulary "
                        f"({info.vocab_size} tokens from {info.tokenizer_name}); set model.vocab_size>={info.vocab_size}")


def _check_packing(source) -> None:
    """data.packing packs conversations of chat shard directories, kept apart at their end tokens."""
    from disttrain.data.shards import read_meta

    for directory in (source if isinstance(source, dict) else [source]):
        meta = read_meta(directory) if directory != "builtin" and not str(directory).startswith("py:") else {}
        if "chat" not in meta:
            raise UserError(f"data.packing=true: data.source={directory} is not chat data (text token windows are "
                            "packed already; allowed: a prepare-data directory of chat or instruction records, or "
                            "data.packing=false)")
        inside = meta["chat"]["eos_inside"]
        if inside:
            raise UserError(f"data.packing=true: {inside} conversations of {directory} hold the end-of-document "
                            "token inside (the chat template ends turns with it), so packing cannot keep them "
                            "apart (allowed for it: data.packing=false)")


def check_engine_installed(cfg) -> None:
    """engine=deepspeed needs the package on this machine (not needed to plan or export its config)."""
    if cfg.engine != "deepspeed":
        return
    try:
        available = importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        available = False
    if not available:
        raise UserError(INSTALL_HINT)


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
        if "://" in cfg.checkpoint.dir:
            raise UserError(f"checkpoint.dir={cfg.checkpoint.dir} needs engine=torch (DeepSpeed writes to local "
                            "paths only; allowed with engine=deepspeed: a local or mounted directory)")
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
