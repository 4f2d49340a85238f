"""Padding reaches no expert: it would take expert capacity, move the balancing loss and bias, and skew the
reported loads (a known failure of MoE trainers on padded fine-tuning data).

Chat data (data/chat_samples.py) ends every conversation with the end-of-document token and pads a sequence
after its last conversation with that same token, so a padding token is an end token right after an end
token: read from the token ids alone, the same for every layout, micro-batch and evaluation. (Targets cannot
tell it: prompt turns and padding both carry the ignore index.) A forward pre-hook on the whole model finds
those rows once per forward and hands the routed ones to every MoE layer (`routed_rows`); activation
checkpointing's recomputation runs before the next micro-batch's forward, so it reads the same rows.
"""

from __future__ import annotations

import torch
from torch import nn


def padding(tokens: torch.Tensor, end_id: int) -> torch.Tensor:
    """(batch, seq) token ids -> bool, True on padding: an end token whose previous token is an end token."""
    pad = torch.zeros_like(tokens, dtype=torch.bool)
    pad[:, 1:] = (tokens[:, 1:] == end_id) & (tokens[:, :-1] == end_id)
    return pad


def exclude_padding(model: nn.Module, layers, end_id: int) -> None:
    """Route only the non-padding rows of each forward of `model` (token ids in, the whole model) in `layers`."""
    layers = list(layers)

    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("input_ids")
        if tokens is None or tokens.is_floating_point():
            return
        rows = (~padding(tokens, end_id)).reshape(-1).nonzero().squeeze(1)
        for layer in layers:
            layer.routed_rows, layer.routed_rows_of = rows, tokens.numel()
        return None

    model.register_forward_pre_hook(hook, with_kwargs=True)
