"""The router: a linear layer scoring every expert, top-k choice, and the balancing bias.

Top-k is a stable descending sort, so tied scores always pick the lowest expert indices: activation
checkpointing's recomputation (and every layout) chooses the same experts as the first forward did.
The bias (aux-loss-free balancing, DeepSeek-V3) is added to the scores only to choose experts; the
combine weights come from the unbiased scores. It is a buffer: saved in checkpoints, never trained.
"""

from __future__ import annotations

import torch
from torch import nn

from disttrain.core.dtypes import at_least_fp32


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, scoring_func: str):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k, self.scoring_func = top_k, scoring_func
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (combine weights (tokens, k), chosen experts (tokens, k) int64, each token's
        probabilities over all experts (tokens, experts), which the balancing loss and entropy read)."""
        logits = at_least_fp32(self.gate(x))
        if self.scoring_func == "softmax":
            scores = probs = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores.detach() + self.expert_bias.to(scores.dtype)
        experts = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = scores.gather(1, experts)
        if self.scoring_func == "sigmoid":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor, rate: float) -> None:
        """Raise the bias of experts that got fewer than the mean tokens, lower it for those that got more."""
        self.expert_bias += rate * torch.sign(counts.mean() - counts).to(self.expert_bias.dtype)
