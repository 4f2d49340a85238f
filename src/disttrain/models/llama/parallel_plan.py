"""How the built-in Llama is cut for tensor, sequence and pipeline parallelism.

Tensor parallel (Megatron's split, as DTensor `parallelize_module` plans): q/k/v and the MLP's
gate/up projections column-wise (each rank owns whole heads and a slice of the FFN width), the
attention output and down projections row-wise (one all-reduce each, or a reduce-scatter with
sequence parallelism). The embedding is split over the vocabulary (row-wise), the output layer
over the vocabulary too (column-wise): its logits left vocabulary-sharded for `loss_parallel`, or its
chunked loss summed over the ranks (models/output_head.py).
Sequence parallelism also shards the residual stream and the norms over the sequence.

Pipeline: contiguous layer ranges; the embedding goes to the first stage, the final norm and output
layer to the last. Each stage is a thin view (`StageModule`) over the pruned model, whose
parameters keep the unsplit model's names, so checkpoints reshard across layouts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from disttrain.models.llama.model import Transformer
from disttrain.models.output_head import head_parallel_style


def block_plan(sequence_parallel: bool, mlp: str = "feed_forward") -> dict:
    """`mlp`: the dense SwiGLU to split (an MoE block's shared experts; "": none, its experts stay whole)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if mlp:
        plan.update({f"{mlp}.w1": ColwiseParallel(), f"{mlp}.w3": ColwiseParallel(),
                     f"{mlp}.w2": RowwiseParallel(output_layouts=residual)})
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # gather the sequence before the column-wise projections (rotary tables and mask stay local)
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Parallelise in place; works on a whole model or a pipeline stage (missing parts are skipped)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = head_parallel_style(model.output, residual)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel, _dense_mlp(block.feed_forward)))
    if model.shape.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        # Both are vocabulary-sharded the same way (Shard(0) of a (vocab, dim) matrix): share again.
        model.output.weight = model.tok_embeddings.weight


def _dense_mlp(feed_forward: nn.Module) -> str:
    """The SwiGLU of a block the plan splits: the MLP itself, or an MoE layer's shared experts (the router
    and routed experts stay whole on every tensor-parallel rank, which sees the whole token batch)."""
    if hasattr(feed_forward, "w1"):
        return "feed_forward"
    return "feed_forward.shared_experts" if getattr(feed_forward, "shared_experts", None) is not None else ""


class StageModule(nn.Module):
    """One pipeline stage: some blocks of the pruned model, plus its embedding (first stage) or
    final norm and output layer (last stage). Runs `Transformer.forward` on those parts."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool):
        super().__init__()
        self.shape = model.shape
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.document_eos = None  # document masking needs token ids, which only the first stage has

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        return Transformer.forward(self, h, positions, documents)


def pipeline_split(model: Transformer, ranges: list[range], owned: list[int]) -> list[nn.Module]:
    """Drop what this rank's stages do not use (names of what stays are unchanged); one view per stage."""
    keep = {str(i) for s in owned for i in ranges[s]}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    last = len(ranges) - 1
    if 0 not in owned:
        model.tok_embeddings = None
    if last not in owned:
        model.norm = None
        model.output = None
    return [StageModule(model, ranges[s], s == 0, s == last) for s in owned]


def context_parallel(model: nn.Module, cp) -> None:
    """Attention through the context-parallel kernel, which gets the global document index of every token as
    its mask; the model (or a pipeline stage) is called with full token ids, of which a pre-hook keeps this
    rank's shard and hands over their global positions. A later pipeline stage gets this rank's hidden
    states, and only their positions (no document masking there)."""
    for block in model.layers.values():
        block.attention.attend = cp.attention
    model.attention_mask = _documents_as_they_are

    def shard_inputs(module, args, kwargs):
        if args[0].is_floating_point():  # hidden states from the previous pipeline stage: already sharded
            b, t = args[0].shape[:2]
            return args, {**kwargs, "positions": cp.index(t * cp.size, args[0].device).expand(b, -1)}
        tokens, positions, documents = cp.inputs(args[0], kwargs.get("positions"))
        return (tokens,), {**kwargs, "positions": positions, "documents": documents}

    model.register_forward_pre_hook(shard_inputs, with_kwargs=True)


def _documents_as_they_are(documents):
    return documents
