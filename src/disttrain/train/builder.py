"""Assemble a run from its config: Layout -> meshes -> data -> ModelSpec -> model -> parallelize -> engine
(train/run.py holds what is assembled).

Every decision about the layout was made when the Layout was resolved; this module only follows it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from disttrain.checkpoint.manager import CheckpointManager
from disttrain.config.schema import RunConfig
from disttrain.core.errors import UserError
from disttrain.data.loader import DistributedBatchLoader
from disttrain.data.padding import padding_multiple
from disttrain.data.source import load_samples, make_sampler
from disttrain.distributed.mesh import Meshes, build_meshes
from disttrain.distributed.runtime import Runtime
from disttrain.layout.layout import Layout
from disttrain.models.spec import ModelSpec, count_params
from disttrain.observe.breakdown import CommProfiler, StepBreakdown, device_clock
from disttrain.observe.mfu import peak_flops_per_device
from disttrain.config.resolve import ResolvedRun, resolve_run
from disttrain.train.balance import Balancer
from disttrain.train.engine import OptimizerStep, StepEngine
from disttrain.train.faults import FaultInjector
from disttrain.train.loss import GlobalMeanLoss
from disttrain.train.objectives import attach_frozen_model, make_objective
from disttrain.train.optim import build_optimizer, build_scheduler
from disttrain.train.phases import HostComputeClock, Phases
from disttrain.train.precision import Precision
from disttrain.train.starting_model import starting_model
from disttrain.train.state_dtype import adamw_class
from disttrain.train.run import Instruments, RunData, TrainedModel, TrainingRun

log = logging.getLogger(__name__)


def build_run(cfg: RunConfig, runtime: Runtime, resolved: ResolvedRun | None = None) -> TrainingRun:
    """`resolved`: the run as this process already resolved it (the launcher does, before the process group
    starts); None resolves it here."""
    resolved = resolved or resolve_run(cfg, runtime.world_size, runtime.device.type)
    layout = resolved.layout
    if runtime.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "config.yaml").write_text(cfg.to_yaml(resolved))
    dist.barrier()
    meshes = build_meshes(layout, runtime.device.type)
    dp_rank, dp_size = meshes.dp.get_local_rank(), meshes.dp.size()

    t = cfg.train
    tokenizer, train_samples, val_samples = load_samples(cfg.data.source, resolved.tokenizer, cfg.data.seq_len,
                                                          cfg.data.packing, cfg.data.cache_dir,
                                                          padding_free=cfg.data.padding == "none")
    sampler = make_sampler(train_samples, cfg.data.source, t.global_batch_size, t.seed)
    balancer = Balancer(layout, dp_rank, cfg.parallel.balance_every, device_clock(runtime.device))
    # a pipeline schedule cuts this rank's batch into its micro-batches itself: the loader hands it over whole
    per_forward = layout.sequences_per_rank if layout.pp > 1 else t.micro_batch_size
    loader = DistributedBatchLoader(train_samples, sampler, dp_rank, dp_size, per_forward,
                                    balancer.shares if layout.balanced else None,
                                    prefetch=cfg.data.prefetch if cfg.data.prefetch is not None else runtime.device.type == "cuda",
                                    pin_memory=runtime.device.type == "cuda",
                                    pad_multiple=padding_multiple(cfg.data, layout)
                                    if train_samples.pads_sequences and resolved.spec.causal else 0)

    spec = resolved.spec
    log.info("model %s (%s, from %s)", spec.label, spec.family, resolved.model_source)
    model = starting_model(cfg, spec, layout, runtime.device, tokenizer, train_samples.masks_targets)
    if not spec.fingerprint:  # a user spec: identify checkpoints by parameter names and shapes
        shapes = json.dumps([(n, list(p.shape)) for n, p in model.named_parameters()])
        spec = replace(spec, fingerprint=hashlib.sha256(shapes.encode()).hexdigest()[:16])
    lora_base = ""
    if cfg.model.lora is not None:  # resolve_run checked peft, the layout and the targets
        from disttrain.models.lora import apply_lora

        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(layout.compute_dtype)  # the frozen base's storage
        lora_base = apply_lora(model, spec, cfg.model.lora, t.seed, base_dtype=low)
    float8 = float8_choice(model, spec, layout, runtime.device)
    num_params = count_params(model)
    breakdown = StepBreakdown(runtime.device)
    breakdown.watch_input_module(model)
    faults = FaultInjector(runtime.rank)
    compute_clock = HostComputeClock()
    # fault injection innermost (last in, first out), so what it simulates (a slow rank) counts as phase time
    phases = Phases(breakdown, compute_clock, *([balancer.timer] if balancer.timer is not None else []), faults)
    mean_loss = make_objective(cfg, spec, layout, meshes, train_samples, context_shard(layout, meshes))
    eos = tokenizer.eos_id if cfg.data.document_masking else None
    engine = build_engine(cfg, layout, meshes, spec, model, runtime, phases, mean_loss, document_eos=eos)
    if t.objective in ("dpo", "distill"):  # the reference or the teacher, frozen, parallelised like the model
        attach_frozen_model(mean_loss, cfg, spec, layout, meshes, runtime.device, engine, bool(lora_base), tokenizer,
                            train_samples.masks_targets, eos)
    peak_flops, _ = peak_flops_per_device(cfg, layout, runtime.device)
    routing = None
    if spec.moe_layers is not None:
        from disttrain.observe.moe import RoutingMonitor

        routing = RoutingMonitor(spec.moe_layers(model), meshes.pp.get_group() if layout.pp > 1 else None)
    tokens_per_step = t.global_batch_size * loader.windows.targets_per_sample
    return TrainingRun(
        cfg=cfg, resolved=replace(resolved, spec=spec), runtime=runtime, meshes=meshes, engine=engine, balancer=balancer,
        model=TrainedModel(model, spec, num_params, lora_base, routing, trainable_params=sum(
            p.numel() for p in model.parameters() if p.requires_grad) if lora_base else None, float8=float8),
        data=RunData(tokenizer, loader, val_samples, tokens_per_step),
        checkpoints=CheckpointManager(cfg.checkpoint_dir, runtime.rank, cfg.checkpoint.keep_last, cfg.checkpoint.async_save),
        instruments=Instruments(breakdown, CommProfiler(cfg.metrics.comm_profile_every, runtime.device), compute_clock,
                                faults, peak_flops, spec.flops_per_token(cfg.data.seq_len)))


def float8_choice(model: nn.Module, spec: ModelSpec, layout: Layout, device: torch.device) -> str:
    """What `precision.float8` will convert (parallelize does), said as the run starts; refuses a GPU without
    float8 matmuls in one line. "": float8 is off."""
    if layout.float8 == "off":
        return ""
    from disttrain.parallel.float8 import choose_layers, float8_device_problem

    problem = float8_device_problem(device)
    if problem:
        raise UserError(problem)
    emulated = "" if device.type == "cuda" else ("; on this CPU through torchao's emulation (the float8 rounding, "
                                                 "no float8 kernel): for testing numerics, many times slower")
    return choose_layers(model, spec).describe() + emulated


def build_engine(cfg: RunConfig, layout: Layout, meshes: Meshes, spec: ModelSpec, model: nn.Module, runtime: Runtime,
                 phases: Phases, mean_loss: GlobalMeanLoss, materialize=None, stage_io=None,
                 document_eos: int | None = None) -> StepEngine:
    """The one place that picks an engine: DeepSpeed, a pipeline schedule, or plain torch.
    `materialize(module)`: for a model built on the meta device (the dry run), called once the
    layout is applied and before the optimizer sees the parameters; `stage_io`: pipeline stage shapes
    given up front (parallel/pipeline.py)."""
    device, dp_group = runtime.device, meshes.dp_cp.get_group()  # gradients and loss sums: dp x cp
    tensor_parallel = layout.tp > 1
    mean_loss.chunk_the_head(model, spec, layout.loss_chunk_tokens)
    engine = _build_engine(cfg, layout, meshes, spec, model, device, dp_group, tensor_parallel, phases, mean_loss,
                           materialize, stage_io, document_eos)
    mean_loss.find_heads(engine.model)  # wrapped, or a pipeline's stages: the heads this rank kept
    return engine


def _build_engine(cfg: RunConfig, layout: Layout, meshes: Meshes, spec: ModelSpec, model: nn.Module, device,
                  dp_group, tensor_parallel: bool, phases: Phases, mean_loss: GlobalMeanLoss, materialize, stage_io,
                  document_eos: int | None) -> StepEngine:
    if layout.engine == "deepspeed":
        from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
        from disttrain.train.deepspeed_engine import DeepSpeedEngine

        apply_activation_checkpointing(spec.blocks(model), layout.activation_checkpointing)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
        return DeepSpeedEngine(model, optimizer, scheduler, layout, cfg.optim.grad_clip, device, mean_loss, dp_group,
                               phases)
    precision = Precision(layout.compute_dtype, device)
    if layout.pp > 1:
        from disttrain.parallel.pipeline import build_pipeline
        from disttrain.parallel.tied import TiedAcrossStages
        from disttrain.train.pipeline_engine import PipelineEngine

        parts = build_pipeline(model, spec, layout, meshes, device, cfg.parallel, mean_loss, layout.microbatches,
                               materialize, stage_io)
        tied = TiedAcrossStages(parts.model, spec.tied_parameters, layout, meshes)
        optimizer = build_optimizer(parts.model, cfg.optim, dp_group if layout.gradient_wrapper == "ddp" else None)
        step = _optimizer_step(cfg, optimizer, precision, parts.group)
        _route_moe(step, spec, model, layout, meshes)
        return PipelineEngine(parts, mean_loss, optimizer, step, precision, device, tensor_parallel, dp_group, phases,
                              tied)
    from disttrain.parallel.parallelize import parallelize
    from disttrain.train.torch_engine import TorchEngine

    if materialize is not None and layout.gradient_wrapper != "fsdp":
        materialize(model)  # DDP checks and broadcasts parameter storage as it wraps
    wrapped = parallelize(model, spec, layout, meshes, device, cfg.parallel, document_eos)
    if materialize is not None and layout.gradient_wrapper == "fsdp":
        materialize(wrapped)  # fully_shard takes meta parameters, not fake ones
    zero1_adamw = layout.sharded_optimizer and cfg.optim.name == "adamw"  # ZeRO-1 with Muon: train/muon.py
    if zero1_adamw:
        from disttrain.parallel.zero1 import build_zero1_optimizer

        same_experts = meshes.same_experts.get_group() if layout.ep > 1 and layout.efsdp > 1 else None
        optimizer = build_zero1_optimizer(wrapped, cfg.optim, dp_group, same_experts, adamw_class(cfg.optim))
    else:
        optimizer = build_optimizer(wrapped, cfg.optim, dp_group if layout.gradient_wrapper == "ddp" else None,
                                    shard_states=layout.sharded_optimizer)
    # DDP's gradients as views into its buckets are zeroed in place (engine.py); copies are freed as usual
    bucket_views = layout.gradient_wrapper == "ddp" and cfg.parallel.ddp_gradient_as_bucket_view
    step = _optimizer_step(cfg, optimizer, precision, None, keep_gradients=bucket_views)
    _route_moe(step, spec, wrapped, layout, meshes)
    return TorchEngine(wrapped, optimizer, step, mean_loss, precision, device, tensor_parallel, dp_group, phases,
                       sharded_optimizer=zero1_adamw, keep_gathered=layout.keep_gathered,
                       reduce_every_microbatch=layout.reduces_every_microbatch)


def _route_moe(step: OptimizerStep, spec: ModelSpec, model: nn.Module, layout: Layout, meshes: Meshes) -> None:
    """MoE models: routing statistics and the balancing bias after each step; expert gradients under DDP."""
    if spec.moe_layers is None:
        return
    from disttrain.parallel.expert import ExpertGradients, finish_routing_step

    if layout.ep > 1:
        step.before_clip.append(ExpertGradients(model, layout, meshes))
    step.after_step.append(finish_routing_step(spec.moe_layers(model)))


def _optimizer_step(cfg: RunConfig, optimizer, precision: Precision, pp_group,
                    keep_gradients: bool = False) -> OptimizerStep:
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    control = dist.new_group(backend="gloo") if precision.scaler.is_enabled() else None
    return OptimizerStep(optimizer, scheduler, precision, cfg.optim.grad_clip, cfg.metrics.nonfinite, pp_group,
                         control, keep_gradients)


def context_shard(layout: Layout, meshes: Meshes):
    """This rank's shard of a (batch, seq) target tensor under context parallelism (None: cp = 1)."""
    if layout.cp == 1:
        return None
    from functools import partial

    from disttrain.parallel.context_shards import shard_sequence

    return partial(shard_sequence, rank=meshes.cp.get_local_rank(), size=layout.cp)
