"""Deterministic initialisation that does not depend on the layout.

Each parameter is drawn from its own generator seeded by (seed, fully-qualified name), so a
parameter gets the same values whether the model is whole, wrapped, or split across stages.
"""

from __future__ import annotations

import hashlib
import math

import torch

from disttrain.models.llama.model import Transformer

INIT_STD = 0.02


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _std_for(name: str, n_layers: int) -> float | None:
    """None means ones (norm weights); residual-branch outputs are scaled down (GPT-2 style)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return INIT_STD / math.sqrt(2 * n_layers)
    return INIT_STD


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Fill every parameter of a materialised (non-meta) model; call after `to_empty`."""
    model.tie_weights()
    for name, param in model.named_parameters():
        std = _std_for(name, model.shape.n_layers)
        if std is None:
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(_param_seed(seed, name))
        param.normal_(0.0, std, generator=gen)
    model.reset_buffers()
