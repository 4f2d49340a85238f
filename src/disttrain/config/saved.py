"""What a committed checkpoint's saved config says about the run that wrote it: its model (resolved by the same
registry a run uses), the tokenizer it trained with, the model directory it came from. Read by export
(`disttrain convert`), which needs no process group and no world size."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

from disttrain.config.resolve import tokenizer_for
from disttrain.config.sections import ModelConfig
from disttrain.models import registry


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
