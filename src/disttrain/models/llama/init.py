"""Deterministic initialisation that does not depend on the layout.

Each parameter is drawn from its own generator seeded by (seed, fully-qualified name), so a
parameter gets the same values whether the model is whole, wrapped, or split across stages.
"""

from __future__ import annotations

import math

import torch

from disttrain.models.llama.model import Transformer
from disttrain.models.spec import seeded_normal_

INIT_STD = 0.02


def _std_for(name: str, n_layers: int) -> float | None:
    """None means ones (norm weights); residual-branch outputs are scaled down (GPT-2 style)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared_experts.w2.weight")):
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
        seeded_normal_(param, seed, name, std)
    model.reset_buffers()
