"""One simulated rank: the real builder, parallelize and step engine under a fake process group,
with the model built on the meta device and materialised as fake tensors (shapes, no storage).

torch's memory trackers (`FSDPMemTracker` under FSDP2, `MemTracker` otherwise) attribute every
tensor the step creates to a category; `CollectiveCounter` records what the step sends. Two steps
run (optimizer states exist from the second); the collectives are the second step's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker

from disttrain.dryrun.collectives import CollectiveCounter
from disttrain.errors import UserError
from disttrain.layout import MESH_DIMS, Layout
from disttrain.train.faults import FaultInjector

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "communication")
# torch's tracker categories -> ours. Gathered (unsharded) parameters and collective buffers are
# communication: they exist because the states are sharded.
_FROM_TRACKER = {"Sharded Param": "parameters", "Parameter": "parameters", "Buffer": "parameters",
                 "Sharded Grad": "gradients", "Gradient": "gradients", "Unsharded Grad": "gradients",
                 "Optstate": "optimizer", "OptState": "optimizer", "Activation": "activations",
                 "Inputs": "activations", "Temp": "temporary", "Unsharded Param": "communication",
                 "All Gather": "communication", "Reduce Scatter": "communication", "Other": "temporary"}


@dataclass
class RankRun:
    """What one simulated rank measured."""

    rank: int
    role: str
    peak_bytes: int
    bytes: dict[str, int]  # by category, at the peak
    collectives: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    host_bytes: int = 0  # CPU offload: the sharded states, in host memory (not in peak_bytes or bytes)


class _BackwardHook(FaultInjector):
    """No faults; calls `after` once each micro-batch's backward is done (the engine's hook point)."""

    def __init__(self):
        super().__init__(rank=-1, environ={})
        self.after = lambda: None

    def after_backward(self, step=None) -> None:
        self.after()


def unsupported(cfg, layout: Layout) -> str | None:
    """What the dry run cannot simulate, in one line (None: it can)."""
    if layout.engine != "torch":
        return (f"engine={layout.engine} cannot be dry-run (DeepSpeed allocates real buffers at start); "
                "allowed: engine=torch")
    if layout.gradient_wrapper == "ddp" and cfg.parallel.ddp_comm_hook != "none":
        return (f"parallel.ddp_comm_hook={cfg.parallel.ddp_comm_hook} cannot be dry-run (the hook reads the "
                "reduced values back from the process group); allowed: none")
    return None


def simulate(cfg, layout: Layout, rank: int, steps: int = 2, device_type: str = "cuda") -> RankRun:
    """Play `rank` of `layout.world_size` in this process, with no real memory for the model.
    `device_type`: the kind of rank simulated ("cuda": torch's defaults there, e.g. foreach AdamW; the
    tensors still live on this CPU). UserError for what cannot be simulated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from disttrain.models.registry import model_spec

    problem = unsupported(cfg, layout)
    if problem:
        raise UserError(problem)
    spec = model_spec(cfg.model)
    if spec.shape is None:
        raise UserError(f"model.spec={cfg.model.spec} cannot be dry-run: its ModelSpec has no shape, so there is "
                        "no token batch to make; allowed: built-in or Hugging Face language models")
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        with torch.device("meta"):
            model = spec.build()
        fake = FakeTensorMode(allow_non_fake_inputs=True)

        def materialize(module):
            shared = _shared_buffers(module)
            with fake:
                module.to_empty(device=torch.device("cpu"))
            for holders in shared:  # one tensor again, as in the model it came from
                first = holders[0][0]._buffers[holders[0][1]]
                for owner, name in holders[1:]:
                    owner._buffers[name] = first
            _retie(module, spec.tied_parameters)

        on_gpu = _gpu_defaults() if device_type == "cuda" else contextlib.nullcontext()
        with on_gpu:
            return measure_step(cfg, layout, spec, model, steps, materialize, fake, t0)
    finally:
        dist.destroy_process_group()


def _shared_buffers(module) -> list[list[tuple]]:
    """(module, name) of every buffer registered more than once (e.g. a rotary table each pipeline stage
    holds): `to_empty` would give each registration its own tensor."""
    holders: dict[int, list[tuple]] = {}
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None:
                holders.setdefault(id(buf), []).append((sub, name))
    return [h for h in holders.values() if len(h) > 1]


def _retie(module, groups) -> None:
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


def measure_step(cfg, layout: Layout, spec, model, steps: int = 2, materialize=None, tensor_mode=None,
                 t0: float | None = None) -> RankRun:
    """Build the engine for `model` through the training code path, run `steps` steps of random tokens
    under torch's memory tracker and the collective counter. Also used on real tensors and a real
    process group, to check the simulation (tests/test_dryrun.py)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from disttrain.distributed.env import DistEnv
    from disttrain.distributed.mesh import build_meshes
    from disttrain.distributed.runtime import Runtime
    from disttrain.observe.breakdown import StepBreakdown
    from disttrain.train.builder import build_engine

    t0 = time.perf_counter() if t0 is None else t0
    rank, world, device = dist.get_rank(), layout.world_size, torch.device("cpu")
    meshes = build_meshes(layout, "cpu")
    rt = Runtime(DistEnv(rank, world, rank % 8, min(world, 8), "dryrun"), device, dist.get_backend())
    hook = _BackwardHook()
    building = _ddp_on_fake(tensor_mode) if tensor_mode is not None and layout.gradient_wrapper == "ddp" \
        else contextlib.nullcontext()
    stage_io = stage_shapes(spec, layout) if layout.pp > 1 else None  # real runs too: same code measured
    with building, _groups_on_the_fake_backend(tensor_mode is not None):
        engine = build_engine(cfg, layout, meshes, spec, model, rt, StepBreakdown(device), hook,
                              materialize=materialize, stage_io=stage_io)
    buckets = _DDPBuckets()
    if isinstance(engine.model, DistributedDataParallel):
        engine.model.register_comm_hook(engine.model.process_group, buckets.all_reduce)
        engine.model.reducer = _KeepBuckets(engine.model.reducer)
    counter = CollectiveCounter(_group_dims(layout, meshes))
    static = _static_pipeline() if stage_io is not None else contextlib.nullcontext()
    own = _propagation_in_its_own_fake_mode() if tensor_mode is not None else contextlib.nullcontext()
    finite = _scaler_finds_no_overflow() if tensor_mode is not None else contextlib.nullcontext()
    with tensor_mode or contextlib.nullcontext(), static, own, finite:
        return _tracked_steps(cfg, layout, spec, engine, steps, counter, hook, buckets, rank, t0)


def _tracked_steps(cfg, layout, spec, engine, steps, counter, hook, buckets, rank, t0) -> RankRun:
    from torch.distributed.fsdp import FSDPModule

    generator = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, spec.shape.vocab_size, (layout.micro_batch, layout.seq_len + 1), generator=generator)
    batch = [(tokens[:, :-1], tokens[:, 1:])] * layout.microbatches
    stages = getattr(getattr(engine, "parts", None), "stages", [])
    if isinstance(engine.model, FSDPModule):
        tracker = FSDPMemTracker(engine.model, engine.optimizer)
    elif stages and isinstance(stages[0].submod, FSDPModule):  # pipeline stages, each an FSDP root
        tracker = _StagesTracker(nn.ModuleList([stage.submod for stage in stages]), engine.optimizer)
    else:
        tracker = _Tracker(buckets)
        tracker.track_external(engine.model, engine.optimizer)
    if stages:
        tracker._mod_tracker = _LeafInputsSafe()
    with tracker, counter:
        hook.after = lambda: _after_backward(tracker, engine.model)
        for stage in stages:
            stage.forward_one_chunk = _each_chunk_afresh(stage.forward_one_chunk, stage.submod, tracker)
            stage.backward_one_chunk = _then(stage.backward_one_chunk, lambda m=stage.submod: _file_grads(tracker, m))
        buckets.tracker = tracker
        for step in range(1, steps + 1):
            counter.reset()
            engine.train_step(batch, step)
    snapshot = tracker.get_tracker_snapshot("peak")
    by_kind = next(iter(snapshot.values())) if snapshot else {}
    categories = dict.fromkeys(CATEGORIES, 0)
    total = 0
    for key, value in by_kind.items():
        name = getattr(key, "value", str(key))
        if name == "Total":
            total = int(value)
        elif name in _FROM_TRACKER:
            categories[_FROM_TRACKER[name]] += int(value)
        else:
            raise AssertionError(f"memory tracker category {name!r} has no dry-run category")
    total = total or sum(categories.values())
    host = 0
    if layout.cpu_offload:  # one CPU device here: take the offloaded (sharded) states out of the GPU's figures
        for key in ("parameters", "gradients", "optimizer"):
            host += categories[key]
            categories[key] = 0
    return RankRun(rank, role_of(layout, rank), total - host, categories, counter.table(), time.perf_counter() - t0,
                   host)


def _each_chunk_afresh(forward_one_chunk, module, tracker):
    """A pipeline stage runs its root module once per micro-batch before any backward; the trackers
    take a second root forward for a new iteration and refuse it unless that module's statistics
    are dropped first (the peak is kept)."""
    def run(*args, **kwargs):
        tracker.memory_tracking.pop(module, None)
        return forward_one_chunk(*args, **kwargs)
    return run


def _then(fn, after):
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            after()
    return run


def _after_backward(tracker, model) -> None:
    """Between micro-batches: clear the per-module statistics (the trackers refuse a second forward of
    the root otherwise; the peak is kept), and file the gradients FSDP2 accumulates."""
    tracker.reset_mod_stats()
    _file_grads(tracker, model)


def _file_grads(tracker, model) -> None:
    """The unsharded gradients FSDP2 accumulates between micro-batches are gradients (created in
    backward, the tracker first called them temporaries)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    if isinstance(tracker, FSDPMemTracker):
        from disttrain.observe.model_bytes import unsharded_grads

        for grad in unsharded_grads(model):
            tracker._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)


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
def _gpu_defaults():
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
def _groups_on_the_fake_backend(active: bool):
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
def _scaler_finds_no_overflow():
    """fp16's loss scaler reads whether any gradient overflowed before it lets the optimizer step; fake
    gradients have no values, so the step is taken (the common case, and the one with the optimizer's peak)."""
    saved = torch.amp.GradScaler._maybe_opt_step
    torch.amp.GradScaler._maybe_opt_step = lambda self, optimizer, state, *args, **kwargs: optimizer.step(*args, **kwargs)
    try:
        yield
    finally:
        torch.amp.GradScaler._maybe_opt_step = saved


@contextlib.contextmanager
def _propagation_in_its_own_fake_mode():
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
def _static_pipeline():
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
def _ddp_on_fake(mode):
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


class _DDPBuckets:
    """DDP's bucket all-reduce as a comm hook (the fake group's futures carry no tensor; DDP needs one
    back) that also files each bucket under gradients: the tracker first sees a bucket's storage
    inside backward and would call it a temporary, but gradients are views into it for the whole run.
    On fake tensors the reducer's per-parameter views into the bucket (made in C++ at wrap time) do not
    share the bucket's storage object, so the tracker would count a second bucket-sized temporary that a
    real run does not have: `phantom` names it (tests/test_dryrun.py compares with real tensors)."""

    tracker = None

    def __init__(self):
        self.sizes: set[int] = set()  # bytes of each bucket
        self.storages: set[int] = set()  # the buckets' own storages

    def all_reduce(self, group, bucket):
        from torch.distributed._tools.mem_tracker import _MemRefType

        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=group)
        if self.tracker is not None:
            self.tracker._update_and_maybe_create_winfos(buffer, _MemRefType.GRAD)
            self.sizes.add(buffer.untyped_storage().nbytes())
            self.storages.add(buffer.untyped_storage()._cdata)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


    def phantom(self, t: torch.Tensor) -> bool:
        from torch._subclasses.fake_tensor import is_fake

        if not self.storages or not is_fake(t):
            return False
        st = t.untyped_storage()
        return st.nbytes() in self.sizes and st._cdata not in self.storages


class _Tracker(MemTracker):
    """torch's MemTracker, blind to the fake-only copies of DDP buckets (see `_DDPBuckets`)."""

    def __init__(self, buckets: _DDPBuckets):
        super().__init__()
        self._buckets = buckets

    def _track(self, reftype, t: torch.Tensor) -> None:
        if not self._buckets.phantom(t):
            super()._track(reftype, t)


class _LeafInputsSafe(ModTracker):
    """torch's ModTracker, without backward hooks on a module's leaf inputs (a pipeline stage's received
    activations): autograd refuses them inside `autograd.grad`, which zero-bubble schedules use to
    split input from weight gradients. Those modules leave the tracked hierarchy at the end of
    backward instead, as modules without differentiable inputs do."""

    def _fw_pre_hook(self, mod, input):
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
                         for a in (input if isinstance(input, tuple) else (input,)))
        return super()._fw_pre_hook(mod, detached)


class _StagesTracker(FSDPMemTracker):
    """torch's FSDPMemTracker over several FSDP roots (this rank's pipeline stages): it only walks the
    module tree below its root, which it otherwise insists is one FSDP module."""

    def __init__(self, stages: nn.Module, optimizer):
        from torch.utils.weak import WeakIdKeyDictionary
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType, _FSDPState

        MemTracker.__init__(self)
        self._root_mod, self._optm = stages, optimizer
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        self._fsdp_state = _FSDPState.PRE_FW
        self._ref_class = _FSDPRefType


class _KeepBuckets:
    """DDP's reducer, except that it keeps its first bucket order: rebuilding copies gradient storage,
    which fake tensors do not have (same bucket sizes, so the same bytes)."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def _group_dims(layout: Layout, meshes) -> dict[frozenset, str]:
    """This rank's group along each mesh dimension, by its ranks (a group object or name differs between
    the ranks of one dimension; the members tell which dimension it is)."""
    dims = {}
    groups = [(dim, meshes.world[dim].get_group()) for dim, size in zip(MESH_DIMS, layout.mesh_shape) if size > 1]
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        groups.append(("dp", meshes.dp.get_group()))
    for dim, group in groups:
        dims[frozenset(dist.get_process_group_ranks(group))] = dim
    return dims


def role_of(layout: Layout, rank: int) -> str:
    coords = dict(zip(MESH_DIMS, _coordinates(layout, rank)))
    return ", ".join(f"{d} {coords[d]}" for d in MESH_DIMS if dict(zip(MESH_DIMS, layout.mesh_shape))[d] > 1) or "rank 0"


def _coordinates(layout: Layout, rank: int) -> list[int]:
    out = []
    for size in reversed(layout.mesh_shape):
        out.append(rank % size)
        rank //= size
    return list(reversed(out))
