"""The output head and the cross-entropy in chunks of tokens (`train.loss_chunk_tokens`): the whole
`[tokens x vocabulary]` logits never exist, only one chunk's, forward and backward.

With a 128K-256K vocabulary the logits, their fp32 copy and their gradient are the largest tensors of a step
(several GiB for a 1B model at 16K tokens a micro-batch). The head here computes, chunk by chunk, the logits
in the compute dtype, their log-sum-exp in fp32 (fp64 in an fp64 run), the loss and, while the chunk is at
hand, its gradient with respect to the hidden states and the weight; backward only scales those by the
incoming gradient. Nothing is recomputed (a checkpointed chunk would run the head's matmul a second time),
at the price of holding the weight's gradient (fp32) and the hidden states' from the forward to the backward.
PyTorch has no fused linear cross-entropy and torch.compile does not chunk one, hence this by hand.

The head takes the targets of the micro-batch from `targets_for` before the model runs (the module's own
forward, so FSDP, DDP and tensor parallelism see an ordinary call of an ordinary `nn.Linear`) and returns the
micro-batch's loss sum in place of its logits; without targets (sampling) it returns logits as before.
Under tensor parallelism the weight is split over the vocabulary: each rank computes its slice's logits, and
the maximum, the sum of exponentials and the target logit are summed over the tensor-parallel group.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.models.packed_targets import sequences_of, split
from disttrain.models.spec import IGNORE_INDEX


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp, the loss and the weight-gradient sum: fp32, fp64 in an fp64 run."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChunkedLossHead(nn.Linear):
    """An `nn.Linear` output head (the class of the model's own head is swapped: parameters, names and
    checkpoints are unchanged) that returns the target-loss sum of its micro-batch when given targets."""

    chunk_tokens: int = 2048
    targets: torch.Tensor | None = None
    per_row: bool = False  # return each row's summed target log-probability instead (preference objectives)
    hands_over: bool = False  # a distillation teacher's: return the hidden states, the student's head uses them
    objective = None  # with the targets, (hidden, weight, targets, chunk_tokens) -> the micro-batch's sum of another
    # objective than the cross-entropy (distillation's, models/output_head_distill.py), for one forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.hands_over:
            return hidden
        targets, self.targets = self.targets, None
        objective, self.objective = self.objective, None
        if targets is None:
            return super().forward(hidden)
        if objective is not None:
            return objective(hidden, self.weight, targets, self.chunk_tokens)
        function = _ChunkedRowLogProbs if self.per_row else _ChunkedCrossEntropy
        return chunked_head_call(function, hidden, self.weight, targets, self.chunk_tokens)


def why_not_chunked(head: nn.Module | None) -> str:
    """Why this output head cannot compute the loss in chunks ('' when it can)."""
    if head is None:
        return "its ModelSpec names no output_head"
    if type(head) not in (nn.Linear, ChunkedLossHead):
        return f"its output head is a {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "its output head has a bias"
    return ""


def chunkable_head(model: nn.Module, spec) -> tuple[nn.Module | None, str]:
    """(the model's output head if it can compute in chunks, else None; why not, '' when it can)."""
    head = spec.output_head(model) if spec.output_head is not None else None
    why = spec.output_head_note if spec.output_head is None and spec.output_head_note else why_not_chunked(head)
    return (None if why else head), why


def chunk_the_head_of(model: nn.Module, spec, chunk_tokens: int) -> tuple[ChunkedLossHead | None, str]:
    """(the model's output head made to compute in chunks of `chunk_tokens`, or None where it cannot or 0 asks
    for whole logits; the run's words for what the loss holds)."""
    if chunk_tokens <= 0:
        return None, "whole logits"
    head, why = chunkable_head(model, spec)
    if why:
        return None, f"whole logits ({why})"
    return chunk_output_head(head, chunk_tokens), f"chunks of {chunk_tokens} tokens"


def chunk_output_head(head: nn.Linear, chunk_tokens: int) -> ChunkedLossHead:
    """Make `head` (checked by `why_not_chunked`) a ChunkedLossHead in place."""
    head.__class__ = ChunkedLossHead
    head.chunk_tokens = chunk_tokens
    return head


@contextlib.contextmanager
def targets_for(heads: list[ChunkedLossHead], targets: torch.Tensor):
    """The next forward of each head computes the loss against `targets`; a head that did not run by the end of
    the block is a wiring error (its targets would leak into the next forward), said at once."""
    for head in heads:
        head.targets = targets
    try:
        yield
    finally:
        stale = [head for head in heads if head.targets is not None]
        for head in stale:
            head.targets = None
    if stale:
        raise RuntimeError("the output head did not run in the forward that was given its targets")


def chunked_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     chunk_tokens: int) -> torch.Tensor:
    """Sum of the token cross-entropies of `hidden @ weight.T` against `targets` (IGNORE_INDEX carries none)."""
    return chunked_head_call(_ChunkedCrossEntropy, hidden, weight, targets, chunk_tokens)


def chunked_head_call(function, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      chunk_tokens: int) -> torch.Tensor:
    """`function` (the loss sum, or the rows' log-probabilities) of `hidden @ weight.T` against `targets`. DTensor
    weights (tensor parallelism, split over the vocabulary) are computed on their local slices."""
    hidden, local, group, start = local_vocabulary(hidden, weight)
    return replicated(function.apply(hidden, local, targets, chunk_tokens, group, start), weight)


def local_vocabulary(hidden: torch.Tensor, weight: torch.Tensor):
    """(hidden states, this rank's rows of the head weight, the tensor-parallel group or None, the first vocabulary
    id of those rows) for a head computed on local slices."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(weight, DTensor):
        return hidden, weight, None, 0
    mesh = weight.device_mesh
    rows = -(-weight.shape[0] // mesh.size())  # Shard(0) cuts as torch.chunk does: ceil(vocab / tp) a rank
    # each rank's slice of the vocabulary contributes its part of the hidden states' gradient: a partial sum
    hidden = hidden.to_local(grad_placements=[Partial()]) if isinstance(hidden, DTensor) else hidden
    return hidden, weight.to_local(), mesh.get_group(), mesh.get_local_rank() * rows


def replicated(result: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A result the same on every tensor-parallel rank, as a DTensor when the head weight is one."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(weight, DTensor):
        return result
    return DTensor.from_local(result, weight.device_mesh, [Replicate()], run_check=False)


def add_chunk_gradients(dlogits, h, weight, grad_hidden, grad_weight, rows: slice) -> None:
    """A chunk's gradients from d objective / d logits, already in the matmul's dtype (callers cast and rebind,
    so that the fp32 statistics are freed before these matmuls: the planner counts one chunk's): the hidden
    states' written into `rows` of `grad_hidden`, the weight's added to `grad_weight` (in its own dtype)."""
    grad_hidden[rows] = dlogits @ weight.to(dlogits.dtype)
    if grad_weight is not None:  # None: a frozen head (LoRA's), whose weight gets no gradient
        grad_weight += (dlogits.t() @ h.to(dlogits.dtype)).to(grad_weight.dtype)


class ScaledGradients(torch.autograd.Function):
    """A head whose forward makes the gradients of a sum over tokens (`keep`), which backward only scales by the
    incoming gradient; its inputs after the hidden states and the weight get none."""

    @staticmethod
    def keep(ctx, hidden, weight, grad_hidden, grad_weight, other_inputs: int) -> None:
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.shapes, ctx.other_inputs = (hidden.shape, hidden.dtype, weight.dtype), other_inputs

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        shape, hidden_dtype, weight_dtype = ctx.shapes
        grad_hidden = (grad_hidden * grad_loss.to(grad_hidden.dtype)).to(hidden_dtype).reshape(shape)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss.to(grad_weight.dtype)).to(weight_dtype)
        return (grad_hidden, grad_weight) + (None,) * ctx.other_inputs


class _ChunkedCrossEntropy(ScaledGradients):
    """Forward computes the loss and both gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, group, vocab_start):
        flat, labels = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        if flat.shape[0] != labels.shape[0]:
            raise ValueError(f"the output head got {flat.shape[0]} positions and {labels.shape[0]} targets")
        whole = flat
        kept = positions_with_targets(labels, getattr(targets, "valid_count", None))
        if kept is not None:  # only the positions that carry a target: the others add no loss and no gradient
            flat, labels = flat[kept], labels[kept]
        rows = torch.empty_like(flat)  # the hidden states' gradient at those positions
        grad_weight = None
        loss = None
        chunk = chunk_tokens if chunk_tokens > 0 else max(1, flat.shape[0])
        for start in range(0, flat.shape[0], chunk):
            h, y = flat[start:start + chunk], labels[start:start + chunk]
            logits = F.linear(h, weight)  # the compute dtype (autocast's, or the parameters')
            stat = statistics_dtype(logits.dtype)
            if loss is None:  # a frozen head (LoRA's) gets no weight gradient: neither its buffer nor its matmuls
                grad_weight = torch.zeros(weight.shape, dtype=stat, device=weight.device) \
                    if ctx.needs_input_grad[1] else None
                loss = torch.zeros((), dtype=stat, device=weight.device)
            part, dlogits = _chunk_loss_and_grad(logits.to(stat), y, group, vocab_start)
            loss += part
            dlogits = dlogits.to(logits.dtype)
            add_chunk_gradients(dlogits, h, weight, rows, grad_weight, slice(start, start + chunk))
            # freed now, not when the next chunk rebinds them: its fp32 statistics would find this chunk's gradient
            # still held (one chunk of logits more: 0.77 GiB on gpt-oss-20b's 201,088-token vocabulary)
            del logits, dlogits
        grad_hidden = at_positions(rows, kept, whole)
        if loss is None:  # no positions at all
            loss = torch.zeros((), dtype=statistics_dtype(weight.dtype), device=weight.device)
            grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        ScaledGradients.keep(ctx, hidden, weight, grad_hidden, grad_weight, 4)
        return loss


def at_positions(rows: torch.Tensor, kept: torch.Tensor | None, whole: torch.Tensor) -> torch.Tensor:
    """Gradients computed at the `kept` positions, placed among zeros at the others (`whole`'s shape); all of
    them when none were left out."""
    return rows if kept is None else torch.zeros_like(whole).index_copy_(0, kept, rows)


def positions_with_targets(labels: torch.Tensor, count: int | None) -> torch.Tensor | None:
    """The indices of the positions that carry a target, when finding them costs no host synchronisation and some
    carry none (chat data's prompts: the head then computes only the answers' logits); None: every position.
    `count`: how many carry one, counted on the host before the copy to the device (the engine's `valid_count`),
    which sizes `nonzero_static`; without it, only a CPU's own tensors are searched. Fake tensors (the dry run)
    keep every position, as the planner counts them."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(labels) or labels.device.type == "meta":
        return None
    if count is None and labels.device.type != "cpu":
        return None
    keep = labels != IGNORE_INDEX
    index = keep.nonzero().squeeze(1) if count is None else torch.nonzero_static(keep, size=count).squeeze(1)
    return None if index.numel() == labels.numel() else index



def chunk_statistics(logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int):
    """(valid, target in this slice, its column, log-sum-exp, target logit, exp(logits - max)) of one chunk;
    `logits` are this rank's vocabulary slice [vocab_start, vocab_start + columns) when `group` (tensor
    parallel) is given, and the three statistics are the whole vocabulary's."""
    columns = logits.shape[1]
    valid = targets != IGNORE_INDEX
    here = valid & (targets >= vocab_start) & (targets < vocab_start + columns)
    index = (targets - vocab_start).clamp(0, columns - 1).unsqueeze(1)
    peak = logits.max(dim=1).values
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    probs = torch.exp(logits - peak.unsqueeze(1))
    total = probs.sum(dim=1)
    target_logit = logits.gather(1, index).squeeze(1) * here
    if group is not None:
        both = torch.stack([total, target_logit])
        dist.all_reduce(both, group=group)
        total, target_logit = both[0], both[1]
    probs /= total.unsqueeze(1)  # the softmax (this slice of it)
    return valid, here, index, peak + torch.log(total), target_logit, probs


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int):
    """(loss sum, d loss / d logits) of one chunk."""
    valid, here, index, log_sum_exp, target_logit, probs = chunk_statistics(logits, targets, group, vocab_start)
    loss = ((log_sum_exp - target_logit) * valid).sum()
    probs.scatter_add_(1, index, -here.to(probs.dtype).unsqueeze(1))  # the gradient: softmax less one at the target
    probs *= valid.unsqueeze(1)
    return loss, probs


def _labels_and_rows(targets: torch.Tensor, sequences: int | None = None):
    """(flat labels, each position's row, the number of rows): a row is a sequence, one per row of `targets`, or
    several per row in packed targets (models/packed_targets.py)."""
    sequences = sequences if sequences is not None else sequences_of(targets)
    if sequences is None:
        labels = targets.reshape(-1)
        return labels, torch.arange(labels.shape[0], device=labels.device) // targets.shape[-1], targets.shape[0]
    labels, row_of = split(targets.reshape(-1))
    return labels, row_of, sequences


class _ChunkedRowLogProbs(torch.autograd.Function):
    """Each row's summed log-probability of its valid targets (a preference objective's per-sequence figure;
    packed targets: each tagged sequence's), chunk by chunk. Its gradient weighs every token by its own row's incoming gradient, unknown until the pair
    losses are computed, so backward computes each chunk's logits again (one more matmul of the head) from the
    kept hidden states and log-sum-exps, instead of holding any chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, group, vocab_start):
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels, row_of, rows = _labels_and_rows(targets)
        if flat.shape[0] != labels.shape[0]:
            raise ValueError(f"the output head got {flat.shape[0]} positions and {labels.shape[0]} targets")
        kept = positions_with_targets(labels, getattr(targets, "valid_count", None))
        if kept is not None:  # only the completions' positions: the prompts' add nothing to any row
            flat, labels, row_of = flat[kept], labels[kept], row_of[kept]
        stat = statistics_dtype(torch.result_type(flat, weight))
        sums = torch.zeros(rows, dtype=stat, device=flat.device)
        lse = torch.zeros(labels.shape[0], dtype=stat, device=flat.device)
        chunk = chunk_tokens if chunk_tokens > 0 else max(1, flat.shape[0])
        for start in range(0, flat.shape[0], chunk):
            logits = F.linear(flat[start:start + chunk], weight)
            valid, _, _, lse_chunk, target_logit, _ = chunk_statistics(
                logits.to(stat), labels[start:start + chunk], group, vocab_start)
            lse[start:start + chunk] = lse_chunk
            sums.index_add_(0, row_of[start:start + chunk], (target_logit - lse_chunk) * valid)
        device = flat.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(hidden, weight, targets, lse, *([] if kept is None else [kept]))
        ctx.chunk, ctx.group, ctx.vocab_start = chunk, group, vocab_start
        ctx.sequences = sequences_of(targets)
        return sums

    @staticmethod
    def backward(ctx, grad_rows):
        hidden, weight, targets, lse, *kept = ctx.saved_tensors
        whole = hidden.reshape(-1, hidden.shape[-1])
        labels, row_of, _ = _labels_and_rows(targets, ctx.sequences)
        flat = whole
        if kept:
            flat, labels, row_of = whole[kept[0]], labels[kept[0]], row_of[kept[0]]
        per_token = grad_rows.to(lse.dtype)[row_of]
        grad_hidden = torch.empty_like(flat)
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        device, dtype, enabled = ctx.autocast
        columns = weight.shape[0]
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for start in range(0, flat.shape[0], ctx.chunk):
                end = start + ctx.chunk
                h, y = flat[start:end], labels[start:end]
                logits = F.linear(h, weight)
                valid = y != IGNORE_INDEX
                here = valid & (y >= ctx.vocab_start) & (y < ctx.vocab_start + columns)
                index = (y - ctx.vocab_start).clamp(0, columns - 1).unsqueeze(1)
                g = per_token[start:end] * valid
                # d log p(target) / d logits = one at the target less the softmax, times the row's gradient
                dlogits = torch.exp(logits.to(lse.dtype) - lse[start:end].unsqueeze(1)) * -g.unsqueeze(1)
                dlogits.scatter_add_(1, index, (g * here).unsqueeze(1))
                dlogits = dlogits.to(logits.dtype)
                add_chunk_gradients(dlogits, h, weight, grad_hidden, grad_weight, slice(start, end))
        grad_hidden = at_positions(grad_hidden, kept[0] if kept else None, whole)
        return (grad_hidden.reshape(hidden.shape), None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None)


def head_parallel_style(head: nn.Module, input_layout):
    """The tensor-parallel style of an output head: split over the vocabulary (column-wise) either way. A plain
    head leaves its logits vocabulary-sharded as a DTensor for `loss_parallel`; a chunked one returns the loss
    sum, the same on every rank (its sampling logits are gathered whole)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    if isinstance(head, ChunkedLossHead):
        return _chunked_head_style()(input_layouts=input_layout, output_layouts=Replicate(), use_local_output=True)
    return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)


def _chunked_head_style():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    class ChunkedHeadParallel(ColwiseParallel):
        """Column-wise, the output replicated and local; the loss sum (or the rows' log-probabilities) a copy, not
        `to_local`'s view of it (FSDP2
        warns of a module returning a view: an in-place op on it would skip its pre-backward all-gather)."""

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            if outputs.placements != (Replicate(),):  # sampling's logits, vocabulary-sharded: gathered whole
                outputs = outputs.redistribute(placements=[Replicate()], async_op=False)
            return outputs.to_local().clone() if outputs.dim() <= 1 else outputs.to_local()

    return ChunkedHeadParallel
