"""A training run as build_run assembled it on this rank, grouped by what reads each part: the model, the data,
the step engine, checkpoints, the uneven-share balancer, and the instruments that time a step."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class TrainedModel:
    """The model this rank trains."""

    module: nn.Module  # the single-device module (pruned to this rank's stages under a pipeline)
    spec: object  # its ModelSpec (models/spec.py); a user spec gets a fingerprint of its parameter shapes
    num_params: int
    lora_base: str = ""  # fingerprint of the frozen base under LoRA adapters (models/lora.py); "" without
    routing: object = None  # observe/moe.py's RoutingMonitor for an MoE model
    trainable_params: int | None = None  # under LoRA, the adapters' parameters; None: every parameter trains
    float8: str = ""  # which Linear layers take float8 matmuls (precision.float8); "": off


@dataclass
class RunData:
    """What this rank reads."""

    tokenizer: object | None  # data/tokenizer.py's Tokenizer; None for a user's dataset of (input, target) pairs
    loader: object  # data/loader.py's DistributedBatchLoader: this rank's micro-batches of every global batch
    val_samples: object  # the validation split (TokenWindows, DatasetSamples or MixtureSamples)
    tokens_per_step: int  # targets per optimizer step (tokens for a language model, samples for a classifier)


@dataclass
class Instruments:
    """What times a step and, in tests only, breaks it."""

    breakdown: object  # observe/breakdown.py's StepBreakdown: where a step's time goes
    comm_profiler: object  # observe/breakdown.py's CommProfiler: seconds per collective on profiled steps
    compute_clock: object  # train/phases.py's HostComputeClock: host compute seconds of the latest step
    faults: object  # train/faults.py's FaultInjector (test-only, off unless DISTTRAIN_FAULT is set)
    peak_flops: float | None  # per device, for MFU (None: unknown)
    flops_per_token: float | None


@dataclass
class TrainingRun:
    """One run assembled on this rank: what the loop and its jobs read."""

    cfg: object  # the RunConfig
    resolved: object  # config/resolve.py's ResolvedRun: the Layout, the ModelSpec, the tokenizer
    runtime: object  # distributed/runtime.py's Runtime: rank, world size, device, backend
    meshes: object  # distributed/mesh.py's Meshes
    model: TrainedModel
    data: RunData
    engine: object  # train/engine.py's StepEngine
    checkpoints: object  # checkpoint/manager.py's CheckpointManager
    balancer: object  # train/balance.py's Balancer
    instruments: Instruments

    @property
    def layout(self):
        return self.resolved.layout

    @property
    def dp_rank(self) -> int:
        return self.meshes.dp.get_local_rank()
