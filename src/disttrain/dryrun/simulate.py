"""One simulated rank: the real builder, parallelize and step engine under a fake process group,
with the model built on the meta device and materialised as fake tensors (shapes, no storage).

torch's memory trackers (`FSDPMemTracker` under FSDP2, `MemTracker` otherwise) attribute every
tensor the step creates to a category; `CollectiveCounter` records what the step sends. Two steps
run (optimizer states exist from the second); the collectives are the second step's.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from disttrain.dryrun.collectives import CollectiveCounter
from disttrain.dryrun.delta_rule import delta_rule_on_fake
from disttrain.dryrun.fake_world import (ddp_on_fake, forget_previous_world, gpu_defaults, grouped_mm_in_every_dtype,
                                        groups_on_the_fake_backend,
                                        materialize_fake, positions_read_as_real_ones, propagation_in_its_own_fake_mode,
                                        scaler_finds_no_overflow, stage_shapes, static_pipeline)
from disttrain.dryrun.routing import AssumedRouting, assume_routing
from disttrain.dryrun.tracking import DDPBuckets, KeepBuckets, LeafInputsSafe, StagesTracker, Tracker, TrackerPhases
from disttrain.core.errors import UserError
from disttrain.layout.layout import MESH_DIMS, Layout
from disttrain.config.resolve import ResolvedRun
from disttrain.train.phases import Phases

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




def unsupported(cfg, layout: Layout) -> str | None:
    """What the dry run cannot simulate, in one line (None: it can)."""
    if layout.engine != "torch":
        return (f"engine={layout.engine} cannot be dry-run (DeepSpeed allocates real buffers at start); "
                "allowed: engine=torch")
    if layout.gradient_wrapper == "ddp" and cfg.parallel.ddp_comm_hook != "none":
        return (f"parallel.ddp_comm_hook={cfg.parallel.ddp_comm_hook} cannot be dry-run (the hook reads the "
                "reduced values back from the process group); allowed: none")
    if cfg.model.moe.capacity_factor:
        return (f"model.moe.capacity_factor={cfg.model.moe.capacity_factor} cannot be dry-run (which tokens are "
                "dropped depends on their values); allowed: 0 (dropless)")
    return None


def rows_per_sample(cfg) -> int:
    """Sequences a sample holds: 2 for a preference objective's pairs."""
    return 2 if cfg.train.objective in ("dpo", "simpo", "orpo") else 1


def simulate(cfg, resolved: ResolvedRun, rank: int, steps: int = 2, routing: AssumedRouting | None = None) -> RankRun:
    """Play `rank` of the resolved run's world in this process, with no real memory for the model.
    The resolved device type is the kind of rank simulated ("cuda": torch's defaults there, e.g. foreach
    AdamW; the tensors still live on this CPU). MoE layers route as `routing` states (default balanced:
    dryrun/routing.py). UserError for what cannot be simulated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layout, spec = resolved.layout, resolved.spec
    problem = unsupported(cfg, layout)
    if problem:
        raise UserError(problem)
    if spec.shape is None:
        raise UserError(f"{resolved.model_source} cannot be dry-run: its ModelSpec has no shape, so there is "
                        "no token batch to make; allowed: built-in or Hugging Face language models")
    t0 = time.perf_counter()
    forget_previous_world()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        with torch.device("meta"):
            model = spec.build()
        fake = FakeTensorMode(allow_non_fake_inputs=True)

        def materialize(module):
            materialize_fake(module, fake)

        on_gpu = gpu_defaults() if resolved.device_type == "cuda" else contextlib.nullcontext()
        with on_gpu, delta_rule_on_fake():
            return measure_step(cfg, layout, spec, model, steps, materialize, fake, t0,
                                routing=routing or AssumedRouting())
    finally:
        dist.destroy_process_group()


def measure_step(cfg, layout: Layout, spec, model, steps: int = 2, materialize=None, tensor_mode=None,
                 t0: float | None = None, routing: AssumedRouting | None = None) -> RankRun:
    """Build the engine for `model` through the training code path, run `steps` steps of random tokens
    under torch's memory tracker and the collective counter. Also used on real tensors and a real
    process group, to check the simulation (tests/test_dryrun.py). `routing`: MoE layers route as it
    states instead of by their values (needed on fake tensors; on real ones, balanced routing only, which
    every rank's view agrees on)."""
    from torch.nn.parallel import DistributedDataParallel

    from disttrain.distributed.env import DistEnv
    from disttrain.distributed.mesh import build_meshes
    from disttrain.distributed.runtime import Runtime
    from disttrain.observe.breakdown import StepBreakdown
    from disttrain.train.builder import build_engine, context_shard
    from disttrain.train.objectives import attach_frozen_model, make_objective

    t0 = time.perf_counter() if t0 is None else t0
    rank, world, device = dist.get_rank(), layout.world_size, torch.device("cpu")
    meshes = build_meshes(layout, "cpu")
    runtime = Runtime(DistEnv(rank, world, rank % 8, min(world, 8), "dryrun"), device, dist.get_backend())
    lora = cfg.model.lora is not None
    if lora:  # adapters on the frozen base, as the builder puts them (train/builder.py)
        from disttrain.models.lora import inject_lora

        inject_lora(model, spec, cfg.model.lora, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(layout.compute_dtype))
    building = ddp_on_fake(tensor_mode) if tensor_mode is not None and layout.gradient_wrapper == "ddp" \
        else contextlib.nullcontext()
    with building, groups_on_the_fake_backend(tensor_mode is not None):
        # the run's objective (samples of random tokens: every target counts), its frozen model made like the trained
        # one (real runs too: same code measured)
        mean_loss = make_objective(cfg, spec, layout, meshes, SimpleNamespace(masks_targets=False,
                                                                              targets_per_sample=layout.seq_len),
                                   context_shard(layout, meshes))
        stage_io = stage_shapes(spec, layout, lambda: mean_loss.chunked, rows_per_sample(cfg)) if layout.pp > 1 else None
        engine = build_engine(cfg, layout, meshes, spec, model, runtime, Phases(StepBreakdown(device)), mean_loss,
                              materialize=materialize, stage_io=stage_io)
    if cfg.train.objective in ("dpo", "distill"):  # built on meta outside the fake mode, as the trained model was
        with groups_on_the_fake_backend(tensor_mode is not None):
            attach_frozen_model(mean_loss, cfg, spec, layout, meshes, device, engine, lora, None, False, None,
                                on_meta=materialize, stage_io=lambda frozen_spec, hands_over: stage_shapes(
                                    frozen_spec, layout, lambda: False, rows_per_sample(cfg), hands_over))
    if routing is not None and spec.moe_layers is not None:
        assume_routing(spec.moe_layers(model), layout.ep, routing)
    buckets = DDPBuckets()
    if isinstance(engine.model, DistributedDataParallel):
        engine.model.register_comm_hook(engine.model.process_group, buckets.all_reduce)
        engine.model.reducer = KeepBuckets(engine.model.reducer)
    counter = CollectiveCounter(_group_dims(layout, meshes))
    static = static_pipeline() if stage_io is not None else contextlib.nullcontext()
    own = propagation_in_its_own_fake_mode() if tensor_mode is not None else contextlib.nullcontext()
    finite = scaler_finds_no_overflow() if tensor_mode is not None else contextlib.nullcontext()
    grouped = grouped_mm_in_every_dtype() if tensor_mode is not None else contextlib.nullcontext()
    positions = positions_read_as_real_ones(cfg.data.document_masking) if tensor_mode is not None \
        else contextlib.nullcontext()
    with tensor_mode or contextlib.nullcontext(), static, own, finite, grouped, positions:
        return _tracked_steps(cfg, layout, spec, engine, steps, counter, buckets, rank, t0)


def track_unwrapped_experts(tracker, model: nn.Module) -> None:
    """Expert parameters no FSDP unit holds (parallel/expert.py experts_need_fsdp: a one-rank expert mesh) are
    invisible to `FSDPMemTracker`, which only follows FSDP's own parameters (its `track_external` does
    nothing): track them, and their gradients, as it tracks FSDP's sharded ones."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    from disttrain.parallel.expert import is_expert_shard

    unwrapped = [p for p in model.parameters() if is_expert_shard(p)]

    def track_grad(param) -> None:
        tracker._update_and_maybe_create_winfos(param.grad, _FSDPRefType.SHARDED_GRAD)

    for param in unwrapped:
        tracker._update_and_maybe_create_winfos(param, _FSDPRefType.SHARDED_PARAM)
        param.register_post_accumulate_grad_hook(track_grad)


def _batch(layout, micro_batch: tuple) -> list:
    """A step's input: the micro-batches, or a pipeline's whole batch (its schedule cuts it), made inside the
    tracked step as a GPU's copy of the batch would be."""
    if layout.pp > 1:
        return [tuple(torch.cat([t] * layout.microbatches) for t in micro_batch)]
    return [micro_batch] * layout.microbatches


def _tracked_steps(cfg, layout, spec, engine, steps, counter, buckets, rank, t0) -> RankRun:
    from torch.distributed.fsdp import FSDPModule

    generator = torch.Generator().manual_seed(cfg.train.seed)
    rows = rows_per_sample(cfg) * layout.micro_batch
    tokens = torch.randint(0, spec.shape.vocab_size, (rows, layout.seq_len + 1), generator=generator)
    micro_batch = (tokens[:, :-1], tokens[:, 1:])
    stages = getattr(getattr(engine, "parts", None), "stages", [])
    objective = engine.mean_loss
    frozen = [m for m in (getattr(objective, "reference", None), getattr(objective, "teacher", None))
              if isinstance(m, nn.Module)]  # the reference or teacher: its memory is the rank's too
    frozen_stages = engine.reference[0].stages if getattr(engine, "reference", None) else []  # its own pipeline
    if frozen_stages:
        frozen = [engine.reference[0].model]
    precomputed = getattr(objective, "precomputed", None)
    if precomputed is not None:  # values to read, as the pass before the first step leaves them
        precomputed.tables["train"] = torch.zeros(rows * layout.microbatches, dtype=torch.float64)
    if isinstance(engine.model, FSDPModule):
        roots = nn.ModuleList([engine.model, *frozen]) if frozen else engine.model
        tracker = (StagesTracker if frozen else FSDPMemTracker)(roots, engine.optimizer)
        track_unwrapped_experts(tracker, roots)
    elif stages and isinstance(stages[0].submod, FSDPModule):  # pipeline stages, each an FSDP root
        roots = nn.ModuleList([stage.submod for stage in stages + frozen_stages])
        tracker = StagesTracker(roots, engine.optimizer)
        track_unwrapped_experts(tracker, roots)
    else:
        tracker = Tracker(buckets)
        tracker.track_external(engine.model, *frozen, engine.optimizer)
    if stages:
        tracker._mod_tracker = LeafInputsSafe()
        tracker._mod_tracker.watch(stages + frozen_stages)
    reference = getattr(objective, "reference", None)
    if callable(reference) and not isinstance(reference, nn.Module):  # LoRA: the policy itself, adapters off
        objective.reference = _own_iteration(tracker, reference)
    for stage in frozen_stages:  # forward only, m times a step: each a new iteration to the tracker, as the engine's
        stage.forward_one_chunk = _new_iteration(tracker, stage)  # phases make the trained stages' (TrackerPhases)
    with tracker, counter:
        engine.phases.subscribe(TrackerPhases(tracker, engine.model))
        buckets.tracker = tracker
        if hasattr(engine.model, "reducer"):  # DDP (ZeRO-0/1)
            buckets.stand_in(engine.model.reducer)
        for step in range(1, steps + 1):
            counter.reset()
            if precomputed is not None:
                precomputed.select("train", range(rows * layout.microbatches // 2))
            engine.train_step(_batch(layout, micro_batch), step)
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


def _own_iteration(tracker, forward):
    """The trackers refuse a module's second forward before a backward: DPO's LoRA reference runs the policy's
    forward once more, with its adapters off, before the policy's own. Each is an iteration of its own to them
    (their statistics per module go; the peak is kept)."""
    def run(*args, **kwargs):
        tracker.reset_mod_stats()
        try:
            return forward(*args, **kwargs)
        finally:
            tracker.reset_mod_stats()
    return run


def _new_iteration(tracker, stage):
    forward, module = stage.forward_one_chunk, stage.submod

    def run(*args, **kwargs):
        tracker.memory_tracking.pop(module, None)
        return forward(*args, **kwargs)
    return run


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
