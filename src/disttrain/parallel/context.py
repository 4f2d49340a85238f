"""Context parallelism: each sequence sharded over the `cp` ranks of the mesh, attention across shards.

Each sequence of `seq_len` tokens is cut into 2 x cp chunks; context rank r holds chunks r and
2cp - 1 - r (head-tail), so that under a causal mask every rank does the same attention work. The model
keeps its single-device code: the ModelSpec's `context_parallel` hook (a) hands the model this rank's
tokens with their global positions (rotary embeddings) and the global document index of every token
(document masking), and (b) swaps its attention kernel for `ContextParallel.attention`, which sees the
other ranks' keys and values by one of three methods:
  ring       K/V blocks passed round the ranks, merged with the online-softmax rule (ring_attention.py)
  allgather  K/V gathered once per layer, attention with an explicit mask (gathered_attention.py)
  ulysses    all-to-all from sequence shards to head shards and back (gathered_attention.py)
Each takes sliding windows, attention sinks (sink_attention.py for the gathering methods) and values of
another head dim than the keys. Linear-attention layers (Gated DeltaNet) take their convolution's reach and their
recurrent state from the chunk before each of this rank's (linear_attention.py), whatever the method.
Targets are sharded the same way (train/loss.py), and for the loss and the gradients a context rank
counts as one more data-parallel rank: FSDP shards and reduces over dp x cp (distributed/mesh.py).
"""

from __future__ import annotations

import torch
from torch import nn

from disttrain.models.documents import document_positions
from disttrain.parallel.context_shards import shard_index


class ContextParallel:
    """This rank's view of the context-parallel group: which tokens it holds, and the attention kernel
    (q, k, v, documents) -> out that models call in place of their single-device one. `documents`:
    the global (batch, seq_len) document index of every token, or None (one causal sequence)."""

    def __init__(self, mesh, method: str, seq_len: int, eos_id: int | None = None):
        self.mesh, self.group, self.method = mesh, mesh.get_group(), method
        self.rank, self.size = mesh.get_local_rank(), mesh.size()
        self.seq_len, self.eos_id = seq_len, eos_id
        self._index: dict = {}
        self.ring_work = [0, 0]  # the ring's K/V blocks left out (wholly outside a sliding window), query-key pairs
        # computed (each block's rows x columns, forward and backward)

    def index(self, seq_len: int, device, rank: int | None = None) -> torch.Tensor:
        key = (seq_len, str(device), self.rank if rank is None else rank)
        if key not in self._index:
            self._index[key] = shard_index(seq_len, key[2], self.size, device)
        return self._index[key]

    def gathered_index(self, seq_len: int, device) -> torch.Tensor:
        """Global positions of the tokens of a gather over the group (rank 0's, then rank 1's, ...)."""
        return torch.cat([self.index(seq_len, device, r) for r in range(self.size)])

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (batch, seq_len, ...) tensor (inputs, targets, positions)."""
        if t.shape[1] % (2 * self.size):
            raise ValueError(f"sequence length {t.shape[1]} is not divisible by 2 x cp = {2 * self.size}")
        return t[:, self.index(t.shape[1], t.device)]

    def inputs(self, tokens: torch.Tensor, positions: torch.Tensor | None = None):
        """Full (batch, seq_len) token ids -> (this rank's tokens, their global positions, the global
        document index of every token or None). Positions restart per document under document masking."""
        documents = None
        if self.eos_id is not None:
            doc_positions, documents = document_positions(tokens, self.eos_id)
            positions = doc_positions if positions is None else positions
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.shard(tokens), self.shard(positions), documents

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                  scale: float | None = None, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q (batch, heads, local tokens, head_dim), k/v (batch, kv heads, local tokens, head_dim; v's head dim
        may differ); `scale` None: head_dim ** -0.5; `window`: sliding-window attention; `sinks` (heads,):
        attention sinks, a learned logit per head in the softmax denominator (gpt-oss)."""
        if self.method == "ring":
            from disttrain.parallel.ring_attention import ring_attention

            return ring_attention(q, k, v, documents, self, scale, window, sinks)
        from disttrain.parallel import gathered_attention

        kernel = gathered_attention.allgather_attention if self.method == "allgather" else \
            gathered_attention.ulysses_attention
        return kernel(q, k, v, documents, self, scale, window, sinks)


    def causal_conv(self, conv, x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None,
                    document_positions=None, **kwargs):
        """The model's causal depthwise convolution `conv` of this rank's (batch, channels, tokens) as over the
        whole sequence (linear_attention.py); `document_positions`: under document masking."""
        from disttrain.parallel.linear_attention import causal_conv

        return causal_conv(conv, x, weight, bias, self, activation, document_positions)

    def gated_delta_rule(self, rule, query, key, value, g, beta, **kwargs):
        """The model's chunked gated-delta-rule kernel `rule` over this rank's tokens as over the whole sequence,
        the recurrent state passed from rank to rank (linear_attention.py)."""
        from disttrain.parallel.linear_attention import chunk_gated_delta_rule

        return chunk_gated_delta_rule(rule, query, key, value, g, beta, self, **kwargs)


def apply_context_parallel(model: nn.Module, spec, cp_mesh, method: str, seq_len: int,
                           eos_id: int | None) -> ContextParallel:
    """Make the whole (unsplit) module train on this rank's shard of each sequence; `eos_id`: document
    masking's end token (None: off). The model is then called with the full sequences' token ids."""
    cp = ContextParallel(cp_mesh, method, seq_len, eos_id)
    spec.context_parallel(model, cp)
    return cp
