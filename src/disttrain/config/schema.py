"""The RunConfig: the whole config tree, its sections in sections.py, parallel_sections.py and run_sections.py.

No torch here: the launcher reads it before any process starts. load.py reads a YAML file and key=value
overrides into one; the rules that span sections are checks.py's and resolve.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, PrivateAttr

from disttrain.config.parallel_sections import ParallelConfig, PrecisionConfig
from disttrain.config.run_sections import CheckpointConfig, DistributedConfig, MetricsConfig, RunSection
from disttrain.config.sections import (SHAPE_KEYS, DataConfig, DistillConfig, LoraConfig, ModelConfig, MoEConfig,
                                       OptimConfig, PreferenceConfig, Section, TrainConfig)

__all__ = ["RunConfig", "LoraConfig", "ModelConfig", "MoEConfig"]


class RunConfig(Section):
    """A run: what trains on what (model, data, train, optim), how it is cut (parallel, precision) and what
    happens around it (checkpoint, metrics, distributed, run)."""

    engine: Literal["torch", "deepspeed"] = Field("torch", description="torch (DDP, FSDP2, ZeroRedundancyOptimizer) "
                                                  "or deepspeed (the deepspeed extra)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    dpo: PreferenceConfig = Field(default_factory=PreferenceConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    run: RunSection = Field(default_factory=RunSection)
    _warnings: list[str] = PrivateAttr(default_factory=list)  # for people, at the start of training

    @property
    def warnings(self) -> list[str]:
        """What loading decided that the user may not expect (a config file's setting given way)."""
        return self._warnings

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def checkpoint_dir(self) -> Path | str:
        """A local Path, or the URL string itself (pathlib would turn s3://b/p into s3:/b/p)."""
        if "://" in self.checkpoint.dir:
            return self.checkpoint.dir.rstrip("/")
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    def to_yaml(self, resolved) -> str:
        """The config as run (`resolved`: config/resolve.py's ResolvedRun of it): a registry model's shape keys
        hold its resolved dimensions (not nulls), a model whose shape comes from elsewhere (model.hf, model.spec)
        leaves them out."""
        from dataclasses import asdict

        tree, note = self.model_dump(mode="json", by_alias=True), ""
        if tree["model"].get("lora", 0) is None:  # no adapters: the section stays out, like any unset option
            del tree["model"]["lora"]
        if self.model.moe == MoEConfig():  # likewise the MoE section of a dense model or an MoE one as given
            del tree["model"]["moe"]
        kind = resolved.model_source.partition("=")[0]
        shape = asdict(resolved.shape) if resolved.shape is not None else None
        if kind != "model.name":
            tree["model"] = {k: v for k, v in tree["model"].items() if k not in SHAPE_KEYS}
            if kind == "model.hf":
                note = f"# model shape from {self.model.hf}/config.json: " + ", ".join(
                    f"{k}={shape[k]}" for k in SHAPE_KEYS) + "\n"
        else:
            tree["model"].update({k: shape[k] for k in SHAPE_KEYS})
            if shape["moe"]:
                tree["model"]["moe"] = {**tree["model"].get("moe", {}), **shape["moe"]}
        return note + yaml.safe_dump(tree, sort_keys=False)
