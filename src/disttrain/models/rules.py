"""The rules a model decides: its dimensions against each other and the data (`shape_problems`, pure Python), and
what its ModelSpec can do under the resolved layout (`spec_problems`: its plans, BatchNorm, document masking,
context parallelism). `ctx` is the run being resolved (config/resolve.py's RunContext)."""

from __future__ import annotations

from disttrain.layout.problem import Problem

ROUTER_KEYS = ("aux_loss_coef", "bias_update_rate", "capacity_factor")


def shape_problems(ctx) -> list[Problem]:
    """The model's dimensions against each other and against data.seq_len; the router's settings against them."""
    cfg, shape = ctx.cfg, ctx.shape
    problems = []
    if not shape.head_size and shape.dim % shape.n_heads:  # a set head size (Qwen3, gpt-oss) need not divide dim
        problems.append(Problem("model.n_heads", shape.n_heads, f"a divisor of model.dim={shape.dim}",
                                f"model.n_heads={shape.n_heads} does not divide model.dim={shape.dim}"))
    if shape.n_heads % shape.n_kv_heads:
        problems.append(Problem("model.n_kv_heads", shape.n_kv_heads, f"a divisor of model.n_heads={shape.n_heads}",
                                f"model.n_kv_heads={shape.n_kv_heads} does not divide model.n_heads={shape.n_heads}"))
    elif shape.head_dim % 2:
        problems.append(Problem("model.dim", shape.dim, "an even head size", f"model.dim={shape.dim} / model.n_heads="
                                f"{shape.n_heads} gives an odd head size; rotary embeddings need an even one"))
    moe, router = shape.moe, cfg.model.moe
    if moe is not None and moe.num_experts_per_tok > moe.num_experts:
        problems.append(Problem("model.moe.num_experts_per_tok", moe.num_experts_per_tok, f"1 to {moe.num_experts}",
                                f"model.moe.num_experts_per_tok={moe.num_experts_per_tok} exceeds model.moe.num_experts="
                                f"{moe.num_experts} (allowed: 1 to {moe.num_experts})"))
    if moe is not None and moe.first_k_dense_replace > shape.n_layers:
        problems.append(Problem("model.moe.first_k_dense_replace", moe.first_k_dense_replace,
                                f"at most model.n_layers={shape.n_layers}", f"model.moe.first_k_dense_replace="
                                f"{moe.first_k_dense_replace} exceeds model.n_layers={shape.n_layers}"))
    if moe is None and any(getattr(router, k) for k in ROUTER_KEYS):
        key = next(k for k in ROUTER_KEYS if getattr(router, k))
        problems.append(Problem(f"model.moe.{key}", getattr(router, key), "0", f"model.moe.{key}={getattr(router, key)} "
                                "on a dense model (no router; allowed: 0)"))
    if moe is not None and router.aux_loss_coef and cfg.precision.compute_dtype == "fp16":
        problems.append(Problem("model.moe.aux_loss_coef", router.aux_loss_coef, "bf16, fp32, fp64",
                                f"model.moe.aux_loss_coef={router.aux_loss_coef} with precision.compute_dtype=fp16: the "
                                "balancing loss's gradient bypasses fp16 loss scaling (allowed: bf16, fp32, fp64)"))
    if moe is not None and cfg.engine == "deepspeed" and router.bias_update_rate:
        problems.append(Problem("model.moe.bias_update_rate", router.bias_update_rate, "0 with engine=deepspeed",
                                f"model.moe.bias_update_rate={router.bias_update_rate} with engine=deepspeed: the bias "
                                "moves after the torch engine's optimizer step (allowed with deepspeed: 0)"))
    if moe is not None and ctx.model_key == "model.hf" and router.bias_update_rate:
        problems.append(Problem("model.moe.bias_update_rate", router.bias_update_rate, "0",
                                f"model.moe.bias_update_rate={router.bias_update_rate} with {ctx.model_source}: "
                                "transformers' routers choose experts without a balancing bias (allowed: 0)"))
    if cfg.data.seq_len > shape.max_seq_len:
        problems.append(Problem("data.seq_len", cfg.data.seq_len, f"at most model.max_seq_len={shape.max_seq_len}",
                                f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={shape.max_seq_len}"))
    return problems


def spec_problems(ctx) -> list[Problem]:
    """What the ModelSpec decides under the layout (its plans, BatchNorm, masking, context parallelism)."""
    spec, lay, cfg = ctx.spec, ctx.layout, ctx.cfg
    hf = ctx.model_key == "model.hf"
    what = f"model {spec.name}" + (f" from {ctx.model_source}" if hf else "")
    problems = []
    if lay.tp > 1 and spec.tensor_parallel is None:
        why = f" ({spec.tensor_parallel_note})" if spec.tensor_parallel_note else ""
        problems.append(Problem("parallel.tp", lay.tp, "1", f"parallel.tp={lay.tp}: {what} has no tensor-parallel "
                                f"plan{why}; allowed for it: parallel.tp=1"))
    if lay.ep > 1 and spec.moe_layers is None:
        from disttrain.models.hf.moe import SUPPORTED  # a spec exists: torch is imported already

        problems.append(Problem("parallel.ep", lay.ep, "1", f"parallel.ep={lay.ep}: {what} has no MoE layers "
                                "expert parallelism can split (the built-in MoE family and transformers' "
                                f"{', '.join(SUPPORTED)} have; allowed for it: parallel.ep=1)"))
    if lay.sequence_parallel and not spec.sequence_parallel:
        problems.append(Problem("parallel.sequence_parallel", True, "false", "parallel.sequence_parallel=true: "
                                f"{what} has no sequence-parallel plan (allowed for it: false)"))
    if lay.sequence_parallel and lay.pp > 1 and hf:
        problems.append(Problem("parallel.sequence_parallel", True, "sequence parallel or pipeline",
                                f"parallel.sequence_parallel=true with parallel.pp={lay.pp}: {what} (a later pipeline "
                                "stage of a transformers model sees only its sequence slice and cannot derive "
                                "positions); allowed for it: sequence parallel or pipeline, not both"))
    if lay.pp > 1 and (spec.pipeline_split is None or spec.shape is None):
        why = spec.pipeline_note or "needs the usual model.embed_tokens / model.layers / model.norm / lm_head decoder"
        problems.append(Problem("parallel.pp", lay.pp, "1", f"parallel.pp={lay.pp}: {what} cannot be split into "
                                f"pipeline stages ({why}; allowed for it: parallel.pp=1)"))
    if lay.balanced and lay.dp > 1 and spec.sync_batchnorm:
        # uneven shares mean ranks run different numbers of forward passes: nothing may communicate in one
        problems.append(Problem("parallel.balance", lay.balance, "equal shares", "parallel.balance/balance_weights: "
                                f"model {spec.name} synchronises BatchNorm over data parallel in every forward pass, "
                                "which needs the same number of micro-batches on every rank (allowed for it: equal "
                                "shares)"))
    if cfg.data.document_masking:  # boundaries come from token ids, which only the first stage sees
        packs = "data.packing=true" if cfg.data.packing else "data.padding=none" if cfg.data.padding == "none" else ""
        turned_on = f" ({packs} turns it on)" if packs else ""
        instead = {"data.packing=true": ", and data.packing=false",
                   "data.padding=none": ", and data.padding=longest"}.get(packs, "")
        if lay.pp > 1:
            problems.append(Problem("data.document_masking", True, "false, or parallel.pp=1", "data.document_masking="
                                    f"true{turned_on} with parallel.pp={lay.pp}: a later pipeline stage sees hidden "
                                    "states, not the token ids the document boundaries come from (allowed: "
                                    f"parallel.pp=1, or document_masking=false{instead})"))
        elif spec.mask_documents is None:
            why = spec.mask_documents_note or "its ModelSpec sets no mask_documents"
            problems.append(Problem("data.document_masking", True, "false", f"data.document_masking=true{turned_on}: "
                                    f"model {spec.name} has no document masking ({why}; allowed for it: false"
                                    f"{instead})"))
    if lay.cp > 1:
        problems += _context_problems(spec, lay, what)
    return problems


def _context_problems(spec, layout, what: str) -> list[Problem]:
    """Context parallelism needs the family's hook, and a method its attention can take."""
    cp, method = layout.cp, layout.cp_method
    if spec.context_parallel is None:
        from disttrain.models.hf.context import MODEL_TYPES

        why = spec.context_parallel_note or ("context parallelism needs the built-in model or a transformers model "
                                             f"of type {', '.join(MODEL_TYPES)}")
        return [Problem("parallel.cp", cp, "1", f"parallel.cp={cp}: {what} cannot shard its sequence ({why}; "
                        "allowed for it: parallel.cp=1)")]
    if layout.pp > 1 and spec.name != "llama":
        return [Problem("parallel.cp", cp, "1 with parallel.pp > 1", f"parallel.cp={cp} with parallel.pp={layout.pp}: "
                        f"{what} (context-parallel pipeline stages need the built-in model; allowed for it: one of "
                        "cp, pp)")]
    extras = spec.shape.extras if spec.shape is not None else None
    reach = extras.linear.conv_kernel - 1 if extras is not None and extras.linear is not None else 0
    if layout.seq_len // (2 * cp) < reach:  # a chunk's convolution reads only the chunk before it
        return [Problem("data.seq_len", layout.seq_len, f"at least {2 * cp * reach}", f"data.seq_len="
                        f"{layout.seq_len} with parallel.cp={cp}: {what}'s linear-attention convolution reaches "
                        f"{reach} tokens back, more than each of the 2 x cp chunks holds (allowed: data.seq_len >= "
                        f"{2 * cp * reach})")]
    if method not in spec.context_parallel_methods:
        allowed = ", ".join(spec.context_parallel_methods)
        return [Problem("parallel.cp_method", method, allowed, f"parallel.cp_method={method}: the attention of "
                        f"{what} cannot take it ({spec.context_parallel_note or 'not supported'}; allowed for it: "
                        f"{allowed})")]
    return []


def lora_problems(ctx) -> list[Problem]:
    """LoRA adapters: peft installed, the engine, dropout under TP, targets that exist (models/lora.py)."""
    if ctx.cfg.model.lora is None:
        return []
    from disttrain.models.lora import lora_problem

    problem = lora_problem(ctx.spec, ctx.cfg.model.lora, ctx.layout)
    return [Problem("model.lora", ctx.cfg.model.lora, "see the message", problem)] if problem else []
