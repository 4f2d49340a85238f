"""Distillation's loss in the output head's chunks of tokens (models/output_head.py): per chunk, the student's
logits from its hidden states and the teacher's from the teacher's hidden states and head weight (or a slice of
the teacher's whole logits, when the teacher's head cannot hand its hidden states over), the divergence and the
cross-entropy, and while the chunk is at hand the gradients for the student's hidden states and head weight.
Neither model's whole logits exist; backward only scales the gradients (the loss is a plain sum over tokens).

Under tensor parallelism both heads are split over the vocabulary alike: the softmaxes' maxima and sums, each
token's divergence, and the target logit are reduced over the tensor-parallel group, by hand, on local slices."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from disttrain.models.output_head import (ScaledGradients, add_chunk_gradients, chunk_statistics, local_vocabulary,
                                          replicated, statistics_dtype)
from disttrain.models.spec import IGNORE_INDEX


def chunked_distillation(hidden, weight, targets, chunk_tokens: int, *, teacher: tuple, settings) -> torch.Tensor:
    """The sum over the valid targets of alpha·T²·KL + (1 - alpha)·cross-entropy (train/distill.py's meaning).
    `teacher`: (hidden states, head weight whole over the vocabulary) or (logits whole over the vocabulary,);
    `settings`: (temperature, alpha, reverse)."""
    hidden, local, group, start = local_vocabulary(hidden, weight)
    columns = slice(start, start + local.shape[0])
    if len(teacher) == 2:
        t_hidden, t_weight = teacher
        t_source = (t_hidden.reshape(-1, t_hidden.shape[-1]), t_weight[columns])
    else:
        t_source = (teacher[0].reshape(-1, teacher[0].shape[-1])[:, columns],)
    return replicated(_ChunkedDistillation.apply(hidden, local, targets, chunk_tokens, group, start, t_source, settings),
                      weight)


def _log_softmax_(x: torch.Tensor, group) -> torch.Tensor:
    """log softmax, in place, over the whole vocabulary of rows whose columns are this rank's slice of it."""
    peak = x.max(dim=1).values
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    total = torch.exp(x - peak.unsqueeze(1)).sum(dim=1)
    if group is not None:
        dist.all_reduce(total, group=group)
    return x.sub_((peak + torch.log(total)).unsqueeze(1))


def _summed(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


class _ChunkedDistillation(ScaledGradients):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, group, vocab_start, t_source, settings):
        temperature, alpha, reverse = settings
        flat, labels = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        if flat.shape[0] != labels.shape[0]:
            raise ValueError(f"the output head got {flat.shape[0]} positions and {labels.shape[0]} targets")
        grad_hidden = torch.empty_like(flat)
        stat = statistics_dtype(torch.result_type(flat, weight))
        grad_weight = torch.zeros(weight.shape, dtype=stat, device=weight.device) if ctx.needs_input_grad[1] else None
        loss = torch.zeros((), dtype=stat, device=weight.device)
        chunk = chunk_tokens if chunk_tokens > 0 else max(1, flat.shape[0])
        for start in range(0, flat.shape[0], chunk):
            end = start + chunk
            h, y = flat[start:end], labels[start:end]
            # Each chunk-sized tensor is a vocabulary's width per token: the steps work in place and drop what they
            # are done with, so that a chunk holds its logits, their fp32 copy and three more at most
            logits = F.linear(h, weight)  # the compute dtype
            with torch.no_grad():
                teacher = F.linear(t_source[0][start:end], t_source[1]) if len(t_source) == 2 else \
                    t_source[0][start:end]
            s = logits.to(stat)
            log_s = _log_softmax_(s / temperature, group)
            log_t = _log_softmax_(teacher.to(stat) / temperature, group)
            del teacher
            valid = (y != IGNORE_INDEX).to(stat)
            if reverse:  # KL(student ‖ teacher); its gradient per logit: T·p_s·(log p_s - log p_t - KL)
                p_s = log_s.exp()
                difference = log_s.sub_(log_t)
                del log_t
                divergence = _summed((p_s * difference).sum(dim=1), group)
                dlogits = difference.sub_(divergence.unsqueeze(1)).mul_(p_s).mul_(temperature)
                del p_s
            else:  # KL(teacher ‖ student); its gradient per logit: T·(p_s - p_t)
                p_t = log_t.exp()
                divergence = _summed(log_t.sub_(log_s).mul_(p_t).sum(dim=1), group)
                del log_t
                dlogits = log_s.exp_().sub_(p_t).mul_(temperature)
                del p_t
            loss += alpha * temperature * temperature * (divergence * valid).sum()
            dlogits *= alpha * valid.unsqueeze(1)
            if alpha != 1:
                _, here, index, lse, target_logit, probs = chunk_statistics(s, y, group, vocab_start)
                loss += (1 - alpha) * ((lse - target_logit) * valid).sum()
                probs.scatter_add_(1, index, -here.to(probs.dtype).unsqueeze(1))
                dlogits += probs.mul_((1 - alpha) * valid.unsqueeze(1))
                del probs
            del s
            dlogits = dlogits.to(logits.dtype)
            add_chunk_gradients(dlogits, h, weight, grad_hidden, grad_weight, slice(start, end))
        ScaledGradients.keep(ctx, hidden, weight, grad_hidden, grad_weight, 6)
        return loss
