"""Batch normalisation over the whole data-parallel batch (SyncBatchNorm) for models with BatchNorm.

On CUDA this is torch's `SyncBatchNorm`. torch 2.13 refuses CPU tensors there, so on CPU each BatchNorm
becomes `GroupBatchNorm`: the same statistics, gathered with autograd-aware all-reduces (sum and count,
then the sum of squared deviations, as torch's own BatchNorm computes the variance in two passes).
Running statistics use the global batch's mean and unbiased variance, so every rank keeps the running
statistics one process on the whole batch would.
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional as dist_fn
from torch import nn


class GroupBatchNorm(nn.modules.batchnorm._BatchNorm):
    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, group):
        like = bn.weight if bn.weight is not None else bn.running_mean  # keep the model's dtype (fp64 runs)
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, **factory)
        self.load_state_dict(bn.state_dict())
        self.group = group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.shape[1]])])
        total = dist_fn.all_reduce(local, group=self.group)
        n, mean = total[-1], total[:-1] / total[-1]
        centred = x - mean.view(shape)
        var = dist_fn.all_reduce((centred * centred).sum(dims), group=self.group) / n
        if self.track_running_stats:
            with torch.no_grad():
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked + 1)
                self.running_mean.mul_(1 - momentum).add_(momentum * mean.detach())
                self.running_var.mul_(1 - momentum).add_(momentum * var.detach() * n / (n - 1))
                self.num_batches_tracked.add_(1)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        return y * self.weight.view(shape) + self.bias.view(shape) if self.affine else y


def convert_sync_batchnorm(module: nn.Module, group, device: torch.device) -> nn.Module:
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=group)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GroupBatchNorm):
        return GroupBatchNorm(module, group)
    for name, child in list(module.named_children()):
        setattr(module, name, convert_sync_batchnorm(child, group, device))
    return module



