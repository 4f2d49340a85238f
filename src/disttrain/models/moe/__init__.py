"""The built-in mixture-of-experts family: the Llama blocks (models/llama/) with the MLP of every block
from `first_k_dense_replace` on replaced by an MoE layer (models/moe/layer.py). Single-device code;
expert parallelism is applied from outside (parallel/expert.py)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from torch import nn

from disttrain.models.moe.layer import MoEFeedForward, MoERouting
from disttrain.models.shape import ModelShape

__all__ = ["MoEFeedForward", "MoERouting", "moe_layers", "moe_spec"]


def block_mlp(shape: ModelShape, routing: MoERouting, layer: int) -> nn.Module:
    """Block `layer`'s MLP: dense SwiGLU before `first_k_dense_replace`, else the MoE layer."""
    from disttrain.models.llama.model import FeedForward

    moe = shape.moe
    if not moe.is_moe_layer(layer):
        return FeedForward(shape.dim, shape.ffn_hidden_dim)
    shared = FeedForward(shape.dim, moe.moe_intermediate_size * moe.n_shared_experts) if moe.n_shared_experts else None
    return MoEFeedForward(shape.dim, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
                          moe.n_shared_experts, moe.scoring_func, routing, shared)


def moe_spec(shape: ModelShape, routing: MoERouting | None = None):
    from disttrain.models.llama import llama_spec
    from disttrain.models.llama.model import Transformer

    routing = routing or MoERouting()
    dense = llama_spec(replace(shape, moe=None))
    # tensor parallel: the dense model's plan splits attention and shared experts, not the routed experts;
    # no sequence parallelism (the router would see a slice of the sequence)
    from disttrain.models.llama import moe_hf_names as hf_names

    return replace(dense, name="moe", build=partial(Transformer, shape, partial(block_mlp, shape, routing)),
                   shape=shape, sequence_parallel=False, to_hf=partial(hf_names.to_hf, shape=shape),
                   from_hf=hf_names.from_hf, hf_config=partial(hf_names.hf_config, shape),
                   moe_layers=moe_layers, fingerprint=_fingerprint(shape))


def moe_layers(model: nn.Module) -> dict[str, MoEFeedForward]:
    """Every MoE layer of a model (or pipeline stage), by module name (wrapper prefixes included)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}


def _fingerprint(shape: ModelShape) -> str:
    from disttrain.models.llama import shape_fingerprint

    return shape_fingerprint(shape)
