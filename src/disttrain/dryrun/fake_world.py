"""Where one CPU process pretending to be a GPU rank of a large job differs from the real thing, and what
stands in: fake tensors in place of storage, a fake process group in place of the network, and torch's
GPU defaults where the CPU's would differ. Each stand-in says why it is needed."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from disttrain.layout import Layout


def shared_buffers(module) -> list[list[tuple]]:
    """(module, name) of every buffer registered more than once (e.g. a rotary table each pipeline stage
    holds): `to_empty` would give each registration its own tensor."""
    holders: dict[int, list[tuple]] = {}
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None:
                holders.setdefault(id(buf), []).append((sub, name))
    return [h for h in holders.values() if len(h) > 1]


def retie(module, groups) -> None:
    """`to_empty` gives every registered parameter its own tensor: share the tied ones again (what
    `init_weights` does for a real model), wherever this module (or pipeline stage) holds them."""
    for names in groups:
        held = [n for n in names if _has_parameter(module, n)]
        for name in held[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, module.get_parameter(held[0]))


def _has_parameter(module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def stage_shapes(spec, layout: Layout):
    """Each pipeline stage's example input and output, given up front (torch's static mode): in a real run
    the stages exchange them at the first step, which a fake group cannot carry. Pipeline parallelism is for
    decoder-only language models (validation), whose stages pass hidden states (micro-batch, sequence,
    hidden) - in the parameters' compute dtype under FSDP2's mixed-precision policy, else the fp32
    residual stream - and whose last stage returns logits over the vocabulary."""
    mp = layout.gradient_wrapper == "fsdp" and layout.param_dtype != "fp32"
    dtype = _DTYPES[layout.param_dtype] if mp else torch.float32
    logits_dtype = _DTYPES[layout.param_dtype if mp else layout.compute_dtype]
    b, t, shape = layout.micro_batch, layout.seq_len, spec.shape

    def example(stage: int):
        inputs = (torch.zeros(b, t, dtype=torch.long) if stage == 0
                  else torch.empty(b, t, shape.dim, dtype=dtype, requires_grad=True))
        last = stage == layout.n_stages - 1
        outputs = torch.empty(b, t, shape.vocab_size if last else shape.dim, dtype=logits_dtype if last else dtype,
                              requires_grad=True)
        return inputs, outputs

    return example


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def gpu_defaults():
    """What torch picks by itself on a GPU but not for tensors on this CPU: AdamW's foreach kernels
    (whose temporaries span every parameter at once, the optimizer step's own peak)."""
    from torch.optim import adam

    saved = adam._default_to_fused_or_foreach
    adam._default_to_fused_or_foreach = lambda params, differentiable, use_fused=False: (False, not differentiable)
    try:
        yield
    finally:
        adam._default_to_fused_or_foreach = saved


@contextlib.contextmanager
def groups_on_the_fake_backend(active: bool):
    """A group asked for on gloo (the fp16 step's host-side control group) on the fake backend instead:
    gloo would need a real store to connect through."""
    saved = dist.new_group
    if active:
        dist.new_group = lambda *args, backend=None, **kwargs: saved(*args, **kwargs)
    try:
        yield
    finally:
        dist.new_group = saved


@contextlib.contextmanager
def scaler_finds_no_overflow():
    """fp16's loss scaler reads whether any gradient overflowed before it lets the optimizer step; fake
    gradients have no values, so the step is taken (the common case, and the one with the optimizer's peak)."""
    saved = torch.amp.GradScaler._maybe_opt_step
    torch.amp.GradScaler._maybe_opt_step = lambda self, optimizer, state, *args, **kwargs: optimizer.step(*args, **kwargs)
    try:
        yield
    finally:
        torch.amp.GradScaler._maybe_opt_step = saved


@contextlib.contextmanager
def propagation_in_its_own_fake_mode():
    """DTensor computes each op's output shape on global-shape fake tensors, in the active fake mode if
    there is one. Under the dry run's mode the memory tracker would count those (whole, unsharded
    weight-sized) tensors as this rank's, as long as garbage collection leaves them alive; a real run
    has no active fake mode, so DTensor makes its own, which the tracker ignores. Do the same here."""
    from torch.distributed.tensor import _sharding_prop

    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


@contextlib.contextmanager
def static_pipeline():
    """Every stage takes its shapes from `stage_shapes` (torch's STATIC mode): the schedule's first-step
    vote on that reads a tensor sent between stages, which a fake group never delivers."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    saved = schedules._PipelineSchedule._warmup_p2p

    def static(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = static
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = saved


@contextlib.contextmanager
def ddp_on_fake(mode):
    """Wrap in DDP inside the fake mode, so that its reducer's gradient buckets are fake too (outside
    it they would be real memory of the whole model's size). DDP's start-up checks read parameter
    values across ranks, which fake tensors and a fake group do not have: skipped here."""
    from torch.nn.parallel import distributed

    saved = distributed._verify_param_shape_across_processes, distributed._sync_module_states
    distributed._verify_param_shape_across_processes = lambda *a, **k: None
    distributed._sync_module_states = lambda *a, **k: None
    try:
        with mode:
            yield
    finally:
        distributed._verify_param_shape_across_processes, distributed._sync_module_states = saved


def forget_previous_world() -> None:
    """Before the next simulated rank in this process: DTensor caches sharding decisions by mesh, and a
    new mesh of equal shape compares equal to the last rank's, whose cached specs name that rank's
    process groups (the group names are reused after the fake world is torn down). Without this, the
    second rank's tensor-parallel collectives ran on the first rank's groups."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._planner_cache.clear()  # keyed by a weak reference to the mesh, equal to an equal mesh's
    for value in vars(_redistribute).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
