"""Sampling from a trained model (no KV cache: for demos and smoke checks, not serving)."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, max_seq_len: int,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0, stop_id: int | None = None,
             pad_multiple: int = 1, logits_of=lambda out: out) -> list[int]:
    """`temperature` 0: the most likely token each time; `top_k` 0: from every token. `pad_multiple`: right-pad each forward's input to a multiple of this (a sequence-parallel
    model splits the sequence evenly); causal attention keeps the real positions unaffected."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        window = ids[:, -(max_seq_len - pad_multiple + 1):]
        n = window.shape[1]
        pad = -n % pad_multiple
        if pad:
            window = torch.cat([window, window.new_zeros((1, pad))], dim=1)
        out = logits_of(model(window))
        if hasattr(out, "full_tensor"):  # vocabulary-sharded logits of a tensor-parallel model
            out = out.full_tensor()
        logits = out[:, n - 1, :].float()
        if temperature == 0:  # greedy
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        if stop_id is not None and int(nxt) == stop_id:
            break
        ids = torch.cat([ids, nxt], dim=1)
    model.train(was_training)
    return ids[0, len(prompt):].tolist()
