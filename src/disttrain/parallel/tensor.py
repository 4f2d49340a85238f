"""Tensor and sequence parallelism for models/llama.py through DTensor `parallelize_module` plans.

Per block (Megatron's split): q/k/v and the MLP's gate/up projections column-wise (each rank owns
whole heads and a slice of the FFN width), the attention output and down projections row-wise
(one all-reduce each, or a reduce-scatter with sequence parallelism). The embedding is split
over the vocabulary (row-wise), the output layer over the vocabulary too (column-wise), and the
loss runs on vocabulary-sharded logits under `loss_parallel` so full logits are never gathered.

Sequence parallelism additionally shards the residual stream and the norms over the sequence:
activations between blocks are 1/tp the size, each row-wise output becomes a reduce-scatter and
each column-wise input an all-gather (same bytes as the all-reduce they replace).

The model code is untouched: attention reads its head count from the (local) tensors.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)


def block_plan(sequence_parallel: bool) -> dict:
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # gather the sequence before the column-wise projections (rotary tables stay local)
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Parallelise in place; works on a whole model or a pipeline stage (missing parts are skipped)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        # Vocabulary-sharded logits stay a DTensor for loss_parallel.
        top["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    if model.tok_embeddings is not None:
        keep_grad_sharded(model.tok_embeddings.weight)
    if getattr(model.shape, "tie_embeddings", False) and model.output is not None and model.tok_embeddings is not None:
        # Both are vocabulary-sharded the same way (Shard(0) of a (vocab, dim) matrix): share again.
        model.output.weight = model.tok_embeddings.weight


def keep_grad_sharded(param: nn.Parameter) -> None:
    """DTensor's embedding backward returns a replicated (full-size) gradient for the
    vocabulary-sharded table; slice it back to the parameter's placement as it is accumulated,
    so each rank holds 1/tp of it (a local slice, no communication)."""
    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)

    param.register_post_accumulate_grad_hook(hook)


def loss_context(model_is_tensor_parallel: bool):
    """Cross-entropy on vocabulary-sharded DTensor logits (forward and backward must be inside)."""
    return loss_parallel() if model_is_tensor_parallel else contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor result (e.g. a loss under loss_parallel) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
