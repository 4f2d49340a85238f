"""Document boundaries inside packed sequences (`data.document_masking`).

A sequence window packs several documents, each ended by the end-of-document token. With masking,
a token attends only to earlier tokens of its own document and its position counts from that
document's start, so what it computes does not depend on the documents before it. The end token
belongs to the document it ends.
"""

from __future__ import annotations

import torch


def document_positions(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, document index) for (batch, seq) token ids; both (batch, seq) int64."""
    t = tokens.shape[-1]
    after_eos = torch.zeros_like(tokens, dtype=torch.bool)
    after_eos[:, 1:] = tokens[:, :-1] == eos_id
    index = torch.arange(t, device=tokens.device).expand_as(tokens)
    starts = torch.where(after_eos, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - starts, after_eos.long().cumsum(dim=-1)


def block_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query i may attend to key j: j <= i, same document."""
    t = documents.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :]).logical_and_(causal)[:, None]


def position_ids_from_documents(eos_id: int):
    """A forward pre-hook giving a Hugging Face model `position_ids` that restart after each `eos_id`:
    transformers reads restarting positions as packed sequences and masks attention between them."""

    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs["input_ids"]
        kwargs["position_ids"] = document_positions(tokens, eos_id)[0]
        return args, kwargs

    return hook
