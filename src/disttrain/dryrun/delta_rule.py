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
So transformers' own rule runs (the preparation, the first chunk, whose state may be a leaf or need no gradient,
the last `KEPT` chunks, the output), its loop over the chunks shortened: the `range` it iterates, in its module's
globals for the call, yields the first chunk, then replaces the chunks between by `_EarlierChunks`, one autograd
node that allocates what each of them keeps (listed by running one chunk on stand-in tensors under saved-tensor
hooks: the same sizes and dtypes, one tensor each), keeps the whole tensors they read alive, and frees it all when
its backward has run, where the last of those chunks' nodes would have; its gradients are stride-0 zeros, added
in place into the gradients the last chunks made, as each chunk's slice gradient would be. Without a graph (no
gradient, or context parallelism's forward, which keeps nothing: parallel/linear_attention.py) the chunks between
hold nothing beyond what every chunk holds: their state is replaced by a new one.

Why by hand: torch has no way to run a loop's memory without its ops. The node reads the loop's tensors from the
rule's frame by transformers' names (`WHOLES`), and updates its state and output in place, so that the loop
goes on with them; a transformers whose names differ runs its whole loop. Left to transformers' loop as well:
real tensors, and a forward whose saved tensors go to saved-tensor hooks (activation checkpointing's, which drop
or recompute them one chunk at a time as the loop runs: one node saving all the chunks' tensors at once would
hold them together for a moment where the loop does not). `tests/test_dryrun_delta_rule.py` holds the rule's memory
and the dry run's peak and its categories to the loop's, byte for byte.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

NAME = "torch_chunk_gated_delta_rule"  # the module global transformers' Gated DeltaNet layers call by name
KEPT = 2  # the last chunks run op for op: the second of them processed holds the backward's fullest moment


def _is_fake(*tensors) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return all(type(t) is FakeTensor for t in tensors)


def _hooked() -> bool:
    """Whether saved tensors go to saved-tensor hooks now (activation checkpointing)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _chunk(i: int, corrections, read_weights, queries, keys, within, decays, state, out):
    """One step of the gated delta rule's scan over chunks, as transformers' loop takes it: the chunk's corrected
    values (what the state entering it does not already predict), its output (the state read by its decayed queries
    plus its own causal part), and the state leaving it (decayed, plus the keys' outer product with the
    corrections). Only run on stand-ins, to list what a step keeps (`_kept`)."""
    corrected = corrections[:, :, i] - read_weights[:, :, i] @ state
    out[:, :, i] = queries[:, :, i] @ state + within[:, :, i] @ corrected
    return state * decays[:, :, i] + keys[:, :, i].transpose(-1, -2) @ corrected


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
    keeps what each chunk keeps (`kept`), and takes the state entering the second chunk for the state leaving the
    last of them, in place (the loop's own variable goes on to the chunks after), keeping a stand-in of it where
    the second chunk keeps its entering state."""

    @staticmethod
    def forward(ctx, n, kept, new_values, k_cumdecay, query, key, intra, chunk_decay, state, out):
        wholes = (new_values, k_cumdecay, query, key, intra, chunk_decay)
        held = []
        for i in range(n):
            if kept.state:  # the state entering chunk i; chunk i - 1 made it, but for the first
                held.append(state.new_empty(state.shape, dtype=kept.leaving if i else state.dtype))
            held += [torch.empty(nbytes, dtype=torch.uint8) for nbytes in kept.made]
        ctx.mark_dirty(out, state)
        ctx.save_for_backward(*[wholes[j] for j in sorted(kept.wholes)], *held)
        ctx.shapes, ctx.state = [t.shape for t in wholes], (state.shape, state.dtype, state.device)
        return out, state

    @staticmethod
    def backward(ctx, grad_out, grad_leaving):
        zero = grad_out.new_zeros(())  # each chunk's slices add zeros into the gradients the later chunks made
        needed = ctx.needs_input_grad[2:8]
        grads = [zero.expand(shape) if need else None for shape, need in zip(ctx.shapes, needed)]
        shape, dtype, device = ctx.state
        grad_state = torch.empty(shape, dtype=dtype, device=device) if ctx.needs_input_grad[8] else None
        return None, None, *grads, grad_state, None


def _earlier_chunks(n: int, wholes, state, out) -> None:
    """n chunks from the second (module doc): one `_EarlierChunks` node where they keep tensors for a backward;
    nothing where they keep nothing (each chunk's state replaces the one before: the state after the first
    chunk stands for the state after the last of them)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*wholes, state)):
        _EarlierChunks.apply(n, _kept(wholes, state, out), *wholes, state, out)


# transformers' names, in the rule's frame, for the whole tensors a chunk reads, its state and its output
WHOLES = ("new_values", "k_cumdecay", "query", "key", "intra_chunk_attn", "chunk_decay")
STATE, OUT, CHUNKS = "last_recurrent_state", "core_attn_out", "num_chunks"


def _scan_range(*args):
    """`range` as the rule's module sees it during a stand-in call (`on_fake`): the rule's loop over its chunks
    (`range(num_chunks)`, called from a frame whose `num_chunks` it is) yields the first chunk, then, once that
    chunk has run, applies `_EarlierChunks` to the frame's tensors for the chunks before the last `KEPT`, and
    yields those. Any other call is range's."""
    frame = sys._getframe(1)
    if len(args) != 1 or args[0] <= KEPT + 1 or _frame_names(frame, (CHUNKS,)) != [args[0]]:
        return range(*args)
    return _skipping(frame, args[0])


def _frame_names(frame, names) -> list | None:
    """The values of `names` in `frame` (None if one is missing). Before Python 3.13 `f_locals` is a dict the frame
    keeps, holding every local it copied until the frame ends: emptied here, or a tensor the loop replaces would
    outlive its place in it (the first chunk's, at the forward's peak)."""
    found = frame.f_locals
    values = [found[name] for name in names] if all(name in found for name in names) else None
    if type(found) is dict:
        found.clear()
    return values


def _skipping(frame, n: int):
    yield 0
    found = _frame_names(frame, (*WHOLES, STATE, OUT))  # read again: the tensors after the first chunk
    if found is None:  # another transformers: its loop, unchanged
        yield from range(1, n)
        return
    _earlier_chunks(n - KEPT - 1, tuple(found[:-2]), *found[-2:])
    del found
    yield from range(n - KEPT, n)


def on_fake(original):
    """`original` (transformers' rule) with its loop over the chunks shortened (`_scan_range`) for calls on fake
    tensors, but for a forward whose saved tensors go to hooks (module doc)."""
    scope = inspect.unwrap(original).__globals__  # the modeling file's globals, where the loop finds `range`

    def rule(query, key, value, g, beta, *args, initial_state=None, **kwargs):
        inputs = (query, key, value, g, beta) + (() if initial_state is None else (initial_state,))
        saving = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        if not _is_fake(*inputs) or (saving and _hooked()):
            return original(query, key, value, g, beta, *args, initial_state=initial_state, **kwargs)
        shadowed = scope.get("range", None)
        scope["range"] = _scan_range
        try:
            return original(query, key, value, g, beta, *args, initial_state=initial_state, **kwargs)
        finally:
            if shadowed is None:
                del scope["range"]
            else:
                scope["range"] = shadowed

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
