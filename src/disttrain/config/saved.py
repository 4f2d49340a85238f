"""What a committed checkpoint's saved config says about the run that wrote it: its model (resolved by the same
registry a run uses), the tokenizer it trained with, the model directory it came from. Read by export
(`disttrain convert`), which needs no process group and no world size."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

from disttrain.config.sections import ModelConfig
from disttrain.models import registry


def tokenizer_for(cfg) -> str:
    """`data.tokenizer=auto`: the model's own tokenizer.json when it has one (a Hugging Face directory's), else
    bytes."""
    if cfg.data.tokenizer != "auto":
        return cfg.data.tokenizer
    return registry.model_tokenizer(cfg.model) or "byte"


@dataclass(frozen=True)
class SavedRun:
    state: dict  # the checkpoint's train_state
    model: ModelConfig  # the saved `model` section

    @cached_property
    def spec(self):
        """The ModelSpec the checkpoint's parameters belong to."""
        return registry.model_spec(self.model)

    @property
    def model_dir(self) -> str:
        """The Hugging Face directory the model came from (its tokenizer, generation config), or ""."""
        if registry.resolver_for(self.model).key != "model.hf":
            return ""
        from disttrain.core.hub import local_directory

        return local_directory(self.model.hf)  # a Hub id: its cached snapshot

    @property
    def tokenizer(self) -> str:
        """The tokenizer the run read: "byte", a tokenizer.json, or "" (a dataset of token ids). Checkpoints record
        the resolved `data.tokenizer`; older ones are resolved again by the same rule."""
        from disttrain.data.source import PY_PREFIX, tokenizer_file

        data = self.state.get("config", {}).get("data", {})
        source = data.get("source", "builtin")
        if isinstance(source, str) and source.startswith(PY_PREFIX):
            return ""
        chosen = self.state.get("tokenizer") or tokenizer_for(SimpleNamespace(
            model=self.model, data=SimpleNamespace(tokenizer=data.get("tokenizer", "auto"))))
        return tokenizer_file(source, chosen)

    @property
    def seed(self) -> int:
        return int(self.state.get("config", {}).get("train", {}).get("seed", 0))

    @property
    def fp64(self) -> bool:
        return self.state.get("config", {}).get("precision", {}).get("compute_dtype") == "fp64"


def saved_run(state: dict) -> SavedRun:
    return SavedRun(state, ModelConfig.model_validate(state["config"]["model"]))


def run_directory(path: str) -> SavedRun | None:
    """The run a disttrain run directory (or URL) holds, from the config.yaml it was started with, or None when
    `path` is no such directory (a Hugging Face model directory has a config.json instead). A run's newest
    checkpoint says what the weights are (checkpoint/export.py); this says what model they belong to, before any
    checkpoint is read."""
    import yaml

    from disttrain.core import storage

    path = str(path)
    if not storage.isfile(storage.join(path, "config.yaml")) or storage.isfile(storage.join(path, "config.json")):
        return None
    config = yaml.safe_load(storage.read_text(storage.join(path, "config.yaml"))) or {}
    return SavedRun({"config": config}, ModelConfig.model_validate(config.get("model", {})))


def has_committed_checkpoint(path: str, run: SavedRun) -> bool:
    """Whether the run directory `path` (whose config `run` read) holds a committed checkpoint (in its
    checkpoint.dir, by default its checkpoints/ folder)."""
    from disttrain.core import storage

    where = run.state["config"].get("checkpoint", {}).get("dir") or storage.join(str(path), "checkpoints")
    return any(storage.isfile(storage.join(where, name, storage.COMMIT))
               for name in storage.listdir(where))
