"""The dry run's chunked gated delta rule (dryrun/delta_rule.py) holds what transformers' own loop over the chunks
holds, byte for byte, in a fraction of the ops: the rule alone under torch's memory tracker (with and without
autocast, a recurrent state coming in that needs a gradient, no gradient at all), and the dry run of a tiny
Qwen3-Next (peak and categories) with and without it."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_models import saved_family

# two key heads serving four value heads each, as Qwen3-Next's 16 and 32; 10 chunks of 64 (the last padded)
B, T, KEY_HEADS, VALUE_HEADS, DK, DV = 1, 600, 2, 4, 32, 16


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _transformers_rule():
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next.torch_chunk_gated_delta_rule


def _memory(rule, autocast: bool, state_grad: bool, grad: bool = True) -> tuple[list[int], int]:
    """([the peak in the forward, what the forward leaves, the peak, what the backward leaves] in bytes beyond the
    inputs, ops dispatched) for one call of `rule` on fake tensors (bf16 inputs) under torch's memory tracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def total(tracker, kind):
        return next(iter(tracker.get_tracker_snapshot(kind).values()))["Total"]

    with FakeTensorMode():
        tracker, count = MemTracker(), _Count()
        with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
            def made(*shape, dtype=torch.bfloat16):  # not leaves, as the layer's (autocast copies those afresh)
                return torch.randn(*shape, dtype=dtype, requires_grad=True) * 1

            q, k = made(B, T, KEY_HEADS, DK), made(B, T, KEY_HEADS, DK)
            v, g, beta = made(B, T, VALUE_HEADS, DV), made(B, T, VALUE_HEADS, dtype=torch.float32), \
                made(B, T, VALUE_HEADS)
            state = torch.randn(B, VALUE_HEADS, DK, DV).requires_grad_() if state_grad else None
            base = total(tracker, "current")
            with count:
                out, final = rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=state_grad,
                                  use_qk_l2norm_in_kernel=True)
            forward = [total(tracker, "peak") - base, total(tracker, "current") - base]
            if grad:
                outputs = [out, final] if state_grad else [out]
                with count:
                    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
                del outputs
            del out, final
            gc.collect()
            return forward + [total(tracker, "peak") - base, total(tracker, "current") - base], count.ops


@pytest.mark.parametrize("autocast,state_grad,grad", [(True, False, True), (False, False, True), (True, True, True),
                                                      (True, False, False)])
def test_the_stand_in_holds_what_transformers_loop_holds(autocast, state_grad, grad):
    """Without a state coming in (a sequence's start) and with one that needs a gradient (a context-parallel
    chunk's backward), under bf16 autocast (the dry run's compute dtype: each chunk's products keep bf16 copies of
    their inputs) and in fp32, and without a gradient (context parallelism's forward): the same bytes at the
    forward's peak, after it, at the step's peak and after the backward, in under half the ops."""
    from disttrain.dryrun.delta_rule import on_fake

    real = _transformers_rule()
    expected, real_ops = _memory(real, autocast, state_grad, grad)
    got, ops = _memory(on_fake(real), autocast, state_grad, grad)
    assert got == expected
    assert ops < real_ops / 2, (ops, real_ops)


def test_real_tensors_and_checkpointed_forwards_keep_transformers_loop():
    """Real tensors run transformers' whole loop (the same values); so does a forward whose saved tensors go to
    saved-tensor hooks (activation checkpointing drops them chunk by chunk); and leaving puts the module's rule and
    its loop's `range` back."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    from torch._subclasses.fake_tensor import FakeTensorMode

    from disttrain.dryrun.delta_rule import delta_rule_on_fake, on_fake

    real = _transformers_rule()
    with delta_rule_on_fake():
        stand_in = modeling_qwen3_next.torch_chunk_gated_delta_rule
        assert stand_in is not real and stand_in.disttrain_stands_for is real
    assert modeling_qwen3_next.torch_chunk_gated_delta_rule is real

    rule = on_fake(real)
    q, k = torch.randn(1, 600, 2, 8), torch.randn(1, 600, 2, 8)
    v, g, beta = torch.randn(1, 600, 4, 8), -torch.rand(1, 600, 4), torch.rand(1, 600, 4)
    expected, _ = real(q, k, v, g=g, beta=beta)
    got, _ = rule(q, k, v, g=g, beta=beta)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    def ops(call, *context) -> int:
        count = _Count()
        with contextlib.ExitStack() as stack:
            for entered in context:
                stack.enter_context(entered)
            with count:
                call(*fake[:3], g=fake[3], beta=fake[4])
        return count.ops

    def hooks():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    with FakeTensorMode():
        fake = [torch.empty(t.shape, requires_grad=True) for t in (q, k, v, g, beta)]
        whole = ops(real)
        assert ops(rule, hooks()) > whole * 0.9  # checkpointed: transformers' loop (its ops, give or take a few)
        assert ops(rule, torch.no_grad(), hooks()) < whole / 2  # nothing saved: shortened
        assert ops(rule) < whole / 2
    assert "range" not in vars(modeling_qwen3_next)


SHAPE = dict(max_position_embeddings=4096, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=32,
             linear_value_head_dim=32)
CASES = {  # name -> (tokens, world size, overrides): rank 0
    "zero2": (1024, 2, ("parallel.zero_stage=2",)),
    # Qwen3-Next's 131,072-token layout in small: ZeRO-3, experts over 2 ranks, 2 context ranks, full checkpointing
    "context full": (2048, 4, ("parallel.zero_stage=3", "parallel.ep=2", "parallel.cp=2",
                               "parallel.activation_checkpointing=full")),
}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return saved_family(tmp_path_factory, "qwen3_next", **SHAPE)


@pytest.mark.parametrize("name", list(CASES))
def test_the_dry_run_peaks_where_transformers_loop_does(name, qwen3_next, monkeypatch):
    """A tiny Qwen3-Next (three Gated DeltaNet layers of four) whose chunk scans run 16 or 8 chunks: the dry run's
    peak and every category at it are the same bytes with the stand-in as with transformers' loop."""
    import disttrain.dryrun.simulate as simulate
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config

    tokens, world, overrides = CASES[name]
    cfg = load_config(None, [f"model.hf={qwen3_next}", f"data.seq_len={tokens}", "precision.compute_dtype=bf16",
                             f"train.global_batch_size={world}", "train.micro_batch_size=1", *overrides])
    stand_in = dry_run(cfg, world, [0])["ranks"][0]
    monkeypatch.setattr(simulate, "delta_rule_on_fake", contextlib.nullcontext)
    loop = dry_run(cfg, world, [0])["ranks"][0]
    assert (stand_in["peak_bytes"], stand_in["bytes"]) == (loop["peak_bytes"], loop["bytes"])
