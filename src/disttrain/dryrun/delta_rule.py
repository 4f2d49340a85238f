"""transformers' chunked gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) on the dry run's fake tensors, in
seconds: the same memory, without walking the sequence one Python step per chunk.

What a GPU rank runs: transformers calls `torch_chunk_gated_delta_rule`, which is flash-linear-attention's Triton
kernel where the `fla` package is installed, and otherwise transformers' own torch implementation: the whole
sequence prepared in fp32 at once (queries, keys, values, the UT transform of each chunk of 64 tokens, solved with
`solve_triangular`), then a Python loop over the chunks that reads and updates the recurrent state (heads x key
dim x value dim, fp32). disttrain installs no `fla`, so a GPU rank runs the torch implementation, as this CPU
does, and the planner counts its tensors (plan/mixers.py, plan/mixer_backward.py). This stands for that
implementation, allocation for allocation at its fullest moments.

Why a stand-in: on fake tensors the loop costs what it costs on real ones in Python and dispatch, about 15 ops a
chunk forward and 40 backward, each select of a chunk's slice getting a gradient as large as the whole tensor; at
131,072 tokens a layer has 2,048 chunks, and the dry run of Qwen3-Next did not finish its first step's backward in
an hour. The values are fake, so only what is allocated, kept and freed matters; that is, for the chunks:
  forward    each chunk keeps its entering state and its corrected values (chunk x value dim) or, under autocast,
             bf16 copies of its products' inputs, and the whole tensors it reads through views (the chunk
             decays; in fp32 also the decayed queries and keys, the solved keys, the intra-chunk attention); a
             chunk's temporaries are the same for every chunk, so the forward's fullest moment is the last chunk's
             (or the output's copy after it);
  backward   the last chunk first: each slice's gradient is a whole-tensor zeros with the slice filled in, added
             into one gradient per tensor, and each chunk's saved tensors go as its nodes run; every chunk after
             the first one processed holds those gradients, one whole-tensor slice gradient more, and fewer saved
             tensors than the one processed before it, so the backward's fullest moment is the last but one
             chunk's, and no earlier chunk reaches it.
So the stand-in runs transformers' code op for op (the preparation, the first chunk, whose state may be a leaf or
need no gradient, the last `KEPT` chunks, the output) and replaces the chunks between by `_EarlierChunks`, one
autograd node that allocates what each of them keeps (listed by running one chunk on stand-in tensors under
saved-tensor hooks: the same sizes and dtypes, one tensor each), keeps the whole tensors they read alive, and
frees it all when its backward has run, where the last of those chunks' nodes would have; its gradients are
stride-0 zeros, added in place into the gradients the last chunks made, as each chunk's slice gradient would be.
Without a graph (no gradient, or context parallelism's forward, which keeps nothing: parallel/linear_attention.py)
the chunks between hold nothing beyond what every chunk holds: their state is replaced by a new one.

Why by hand: torch has no way to run a loop's memory without its ops; transformers' rule is copied op for op
(5.23's `torch_chunk_gated_delta_rule`) because the loop sits inside it. Left to transformers' own code: real
tensors, and a forward whose saved tensors go to saved-tensor hooks (activation checkpointing's, which drop or
recompute them one chunk at a time as the loop runs: one node saving all the chunks' tensors at once would hold
them together for a moment where the loop does not). `tests/test_dryrun_delta_rule.py` holds the rule's memory
and the dry run's peak and its categories to the loop's, byte for byte.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "torch_chunk_gated_delta_rule"  # the module global transformers' Gated DeltaNet layers call by name
KEPT = 2  # the last chunks run op for op: the second of them processed holds the backward's fullest moment


def _is_fake(*tensors) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return all(type(t) is FakeTensor for t in tensors)


def _hooked() -> bool:
    """Whether saved tensors go to saved-tensor hooks now (activation checkpointing)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' `l2norm` of the modeling file (flash-linear-attention's)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _chunk(i: int, new_values, k_cumdecay, query, key, intra, chunk_decay, state, out):
    """One step of transformers' scan over the chunks (its loop body): writes chunk i's output, returns the state
    leaving it."""
    v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
    inter_chunk_attn = query[:, :, i] @ state
    out[:, :, i] = inter_chunk_attn + intra[:, :, i] @ v_new
    return state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new


@dataclass
class _Kept:
    """What one step of the scan keeps for its backward: which of the whole tensors it holds through views, whether
    its entering state, and the storages it makes and keeps (autocast's copies, the corrected values: bytes)."""

    wholes: set[int]
    state: bool
    made: list[int]
    leaving: torch.dtype  # the leaving state's dtype


def _kept(wholes, state, out) -> _Kept:
    """A step of the scan past the first run once on stand-ins of its inputs (fresh fake tensors, outside the dry
    run's modes: not counted), its saved tensors listed by saved-tensor hooks. Autocast and which inputs need
    gradients decide what it keeps, as they do for the real step; the stand-ins are leaves where the real inputs
    are (autocast keeps one copy of a leaf that needs a gradient, a copy per use of any other tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    def like(t):
        made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).requires_grad_(t.requires_grad)
        return made if t.is_leaf or not t.requires_grad else made.view_as(made)

    with _disable_current_modes(), FakeTensorMode(), torch.enable_grad():
        probes = [like(t) for t in (*wholes, state)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            leaving = _chunk(1, *probes, torch.zeros(out.shape, dtype=out.dtype))
        storages = [p.untyped_storage()._cdata for p in probes]
        made: dict[int, int] = {}
        for t in saved:
            st = t.untyped_storage()
            if st._cdata not in storages:
                made.setdefault(st._cdata, st.nbytes())
        found = {t.untyped_storage()._cdata for t in saved}
        return _Kept({j for j in range(len(wholes)) if storages[j] in found}, storages[-1] in found,
                     list(made.values()), leaving.dtype)


class _EarlierChunks(torch.autograd.Function):
    """n chunks of the scan from the second as one node (module doc): writes nothing into the output (fake values),
    keeps what each chunk keeps (`kept`), returns the state leaving the last of them."""

    @staticmethod
    def forward(ctx, n, kept, new_values, k_cumdecay, query, key, intra, chunk_decay, state, out):
        wholes = (new_values, k_cumdecay, query, key, intra, chunk_decay)
        held = [state] if kept.state else []
        for i in range(n):
            if i > 0 and kept.state:  # the state entering chunk i, which chunk i - 1 made
                held.append(state.new_empty(state.shape, dtype=kept.leaving))
            held += [torch.empty(nbytes, dtype=torch.uint8) for nbytes in kept.made]
        leaving = state.new_empty(state.shape, dtype=kept.leaving)
        ctx.mark_dirty(out)
        ctx.save_for_backward(*[wholes[j] for j in sorted(kept.wholes)], *held)
        ctx.shapes, ctx.state = [t.shape for t in wholes], state
        return out, leaving

    @staticmethod
    def backward(ctx, grad_out, grad_leaving):
        state, ctx.state = ctx.state, None
        zero = grad_out.new_zeros(())  # each chunk's slices add zeros into the gradients the later chunks made
        needed = ctx.needs_input_grad[2:8]
        grads = [zero.expand(shape) if need else None for shape, need in zip(ctx.shapes, needed)]
        grad_state = torch.empty_like(state) if ctx.needs_input_grad[8] else None
        return None, None, *grads, grad_state, None


def _earlier_chunks(n: int, wholes, state, out):
    """(out, the state leaving them) after n chunks from the second (module doc): one `_EarlierChunks` node where
    they keep tensors for a backward, a new state in place of the one given where they keep nothing."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (*wholes, state))):
        return out, torch.empty_like(state)
    return _EarlierChunks.apply(n, _kept(wholes, state, out), *wholes, state, out)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """transformers 5.23's `torch_chunk_gated_delta_rule`, op for op but for the scan's chunks before the last
    `KEPT` (module doc). Fake tensors only: the output's values are not computed."""
    initial_dtype = query.dtype
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    recurrent_state_shape = (batch_size, num_v_heads, k_head_dim, v_head_dim)
    padded_output_shape = (batch_size, num_v_heads, -1, v_head_dim)
    decay = g
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, decay)
    ]
    if use_qk_l2norm_in_kernel:
        query = _l2norm(query, dim=-1, eps=1e-6)
        key = _l2norm(key, dim=-1, eps=1e-6)
    scaling = query.shape[-1] ** -0.5
    query = query * scaling
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    num_chunks = (sequence_length + pad_size) // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise_decay = pairwise_decay.masked_fill(strictly_upper_mask, float("-inf"))
    pairwise_decay = pairwise_decay.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    if initial_state is None:
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=new_values.dtype, device=new_values.device)
    else:
        last_recurrent_state = initial_state.to(new_values)
    core_attn_out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]

    wholes = (new_values, k_cumdecay, query, key, intra_chunk_attn, chunk_decay)
    resume = num_chunks - KEPT  # the chunks from 1 to resume - 1 are `_EarlierChunks`, when there are any
    i = 0
    while i < num_chunks:  # transformers' loop
        if i == 1 and resume > 1:
            core_attn_out, last_recurrent_state = _earlier_chunks(resume - 1, wholes, last_recurrent_state,
                                                                  core_attn_out)
            i = resume
            continue
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ last_recurrent_state
        inter_chunk_attn = query[:, :, i] @ last_recurrent_state
        core_attn_out[:, :, i] = inter_chunk_attn + intra_chunk_attn[:, :, i] @ v_new
        last_recurrent_state = last_recurrent_state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
        i += 1

    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.reshape(padded_output_shape)
    core_attn_out = core_attn_out[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return core_attn_out, last_recurrent_state


def on_fake(original):
    """`original` (transformers' rule) with calls on fake tensors sent to the stand-in, but for a forward whose
    saved tensors go to hooks (module doc)."""

    def rule(query, key, value, g, beta, *args, initial_state=None, **kwargs):
        inputs = (query, key, value, g, beta) + (() if initial_state is None else (initial_state,))
        saving = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        if not _is_fake(*inputs) or (saving and _hooked()):
            return original(query, key, value, g, beta, *args, initial_state=initial_state, **kwargs)
        return chunk_gated_delta_rule(query, key, value, g, beta, *args, initial_state=initial_state, **kwargs)

    rule.disttrain_stands_for = original
    return rule


@contextlib.contextmanager
def delta_rule_on_fake():
    """Every loaded transformers modeling file that calls `torch_chunk_gated_delta_rule` by name calls `on_fake`'s
    rule while this lasts (a layer's kernels are read when context parallelism wraps them: parallel/
    linear_attention.py; enter before the model is parallelised)."""
    saved = {}
    for name, module in list(sys.modules.items()):
        rule = getattr(module, NAME, None) if name.startswith("transformers.models.") else None
        if rule is not None and not hasattr(rule, "disttrain_stands_for"):
            saved[module] = rule
            setattr(module, NAME, on_fake(rule))
    try:
        yield
    finally:
        for module, rule in saved.items():
            setattr(module, NAME, rule)
