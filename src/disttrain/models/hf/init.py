"""Initialise a transformers model from its config by the architecture's own rules, the same on every layout.

transformers knows how each family starts: Gemma's `(1 + weight)` norms at zero and its embedding scale,
gpt-oss's attention sinks and expert biases, Qwen3-Next's `A_log` and `dt_bias`, every rotary table. Those
rules live in each model's `_init_weights(module)`, which draws from torch's global generator in module
order. disttrain calls the same method module by module, but reseeds the generator from (seed, module name)
before each call, so a module's values do not depend on what was drawn before it: the whole model, a
pipeline stage or a model with one module more start from the same weights. Weights tied to another
(`lm_head` to the embedding) are drawn once, by the module that comes first.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def _module_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name or '<root>'}".encode()).digest()[:8], "little") >> 1


def _modules_with_owner(model: nn.Module):
    """(name, module, the PreTrainedModel whose `_init_weights` rules it), children before parents as
    transformers' own `initialize_weights` visits them; a nested PreTrainedModel (a text model inside a
    multimodal one) rules its own subtree."""
    from transformers import PreTrainedModel

    def visit(module: nn.Module, name: str, owner):
        for child_name, child in module.named_children():
            yield from visit(child, f"{name}.{child_name}" if name else child_name,
                             child if isinstance(child, PreTrainedModel) else owner)
        yield name, module, owner

    yield from visit(model, "", model)


@torch.no_grad()
def init_by_architecture(model: nn.Module, seed: int) -> None:
    """Fill every parameter and buffer of a materialised (`to_empty`) transformers model."""
    from transformers import initialization

    model.tie_weights()
    first = next(model.parameters())
    devices = [first.device.index or 0] if first.device.type == "cuda" else []
    seen: set[int] = set()
    with torch.random.fork_rng(devices=devices), initialization.guard_torch_init_functions():
        for name, module, owner in _modules_with_owner(model):
            own = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t is not None]
            if own and all(id(t) in seen for t in own):
                continue  # a tied module (lm_head): its weight was drawn where it is first owned
            seen.update(id(t) for t in own)
            torch.manual_seed(_module_seed(seed, name))
            owner._init_weights(module)
