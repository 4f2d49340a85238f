"""The RunConfig tree: YAML + dotted ``key=value`` overrides, validated before any process starts.

Every user mistake becomes a `UserError` (errors.py) whose message is one line naming the key,
the value and what is allowed; the CLI prints it and exits with status 2. Rules that span
sections live in validation.py. No torch here: loading is instant and runs in the launcher.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from disttrain.core.errors import ConfigError, UserError
from disttrain.config.overrides import merge_trees as _merge, parse_overrides

__all__ = ["ConfigError", "UserError", "RunConfig", "load_config", "parse_overrides"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "max_seq_len",
              "tie_embeddings", "norm_eps", "rope_theta")


class LoraConfig(_Section):
    """LoRA adapters on a frozen base (models/lora.py); the section's presence switches them on."""

    rank: int = Field(8, gt=0, description="rank r of each adapter pair lora_A (r x in), lora_B (out x r)")
    alpha: float = Field(16.0, gt=0, description="the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    targets: list[str] = Field(default_factory=list, description="module-name patterns: a name (q_proj) or a glob "
                               "on the full name (model.layers.0.*); empty: every linear layer of the repeated "
                               "blocks (attention and MLP projections)")


class MoEConfig(_Section):
    """Mixture of experts (models/moe/): shape keys (transformers' names) over the registry's; router training."""

    num_experts: int | None = Field(None, gt=0, description="routed experts per MoE layer")
    num_experts_per_tok: int | None = Field(None, gt=0, description="top-k experts each token runs through")
    moe_intermediate_size: int | None = Field(None, gt=0, description="each expert's SwiGLU width")
    n_shared_experts: int | None = Field(None, ge=0, description="experts every token runs through")
    first_k_dense_replace: int | None = Field(None, ge=0, description="leading blocks with a dense MLP")
    scoring_func: Literal["softmax", "sigmoid"] | None = Field(None, description="softmax, or sigmoid + top-k renormalised")
    aux_loss_coef: float = Field(0.0, ge=0, description="switch-style balancing loss over the global batch (0: off)")
    bias_update_rate: float = Field(0.0, ge=0, description="per-expert bias step after each optimizer step (0: off)")
    capacity_factor: float = Field(0.0, ge=0, description="0: dropless; else each expert takes at most "
                                   "capacity_factor x its even share of a micro-batch's tokens, the rest dropped")

    @model_validator(mode="after")
    def _capacity(self) -> "MoEConfig":
        if 0 < self.capacity_factor < 1:
            raise ValueError(f"model.moe.capacity_factor={self.capacity_factor}: below 1 drops tokens even when "
                             "the experts are perfectly balanced (allowed: 0 for dropless, or at least 1)")
        return self


MOE_SHAPE_KEYS = tuple(MoEConfig.model_fields)[:6]  # the MoEShape's; the rest say how the router trains


class ModelConfig(_Section):
    name: str = "debug"
    hf: str = Field("", description="a local Hugging Face model directory (config.json, optional weights and "
                                    "tokenizer); replaces name and the shape keys")
    spec: str = Field("", description="FILE.py:function or package.module:function returning a ModelSpec")
    dim: int | None = Field(None, gt=0)
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    n_kv_heads: int | None = Field(None, gt=0)
    vocab_size: int | None = Field(None, gt=0)
    ffn_hidden_dim: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    norm_eps: float | None = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    init_from: str = Field("", description="weights from `disttrain convert` to start from (empty: random init)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on the frozen model (model.lora.rank=8)")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="mixture-of-experts shape and routing")

    @model_validator(mode="after")
    def _init_exists(self) -> "ModelConfig":
        if self.hf and self.spec:
            raise ValueError(f"model.hf={self.hf} and model.spec={self.spec}: give one of them")
        source = ("model.hf", self.hf, "the directory's config.json") if self.hf else \
            ("model.spec", self.spec, "the ModelSpec") if self.spec else None
        given = [k for k in SHAPE_KEYS if getattr(self, k) is not None]
        given += [f"moe.{k}" for k in MOE_SHAPE_KEYS if getattr(self.moe, k) is not None]
        if source and given:
            raise ValueError(f"model.{given[0]}={_show(_dotted(self, given[0]))} with {source[0]}={source[1]}: the "
                             f"shape comes from {source[2]} (allowed with {source[0]}: no shape keys)")
        if self.init_from and not Path(self.init_from).exists():
            raise ValueError(f"model.init_from={self.init_from}: no such file or directory (allowed: empty, or "
                             "a file or folder written by `disttrain convert`)")
        return self


class DataConfig(_Section):
    source: str | dict[str, float] = Field("builtin", description="builtin, a prepare-data directory, "
                                           "py:FILE.py:function, or a mixture {DIR: weight, ...}")
    document_masking: bool = Field(False, description="attention stops at end-of-document tokens and "
                                   "positions restart per document")
    tokenizer: str = Field("auto", description="auto: model.hf's tokenizer.json if it has one, else byte")
    seq_len: int = Field(128, gt=0)
    prefetch: bool | None = Field(None, description="read the next step's batches on a background thread; "
                                  "empty: on with a GPU, off on CPU")
    packing: bool = Field(False, description="chat data: several conversations per sequence (first-fit), with "
                          "document masking; false: one conversation per sequence, padded")
    cache_dir: str = Field("", description="data.source on an object store: keep the byte ranges read in this local "
                           "directory (fsspec's block cache); empty: read them from the store each time")

    @model_validator(mode="after")
    def _packing_masks_documents(self) -> "DataConfig":
        """Packed conversations must not attend across each other: packing switches document masking on."""
        if self.packing and not self.document_masking:
            if "document_masking" in self.model_fields_set:
                raise ValueError("data.packing=true with data.document_masking=false: packed conversations would "
                                 "attend to each other (allowed with packing: document_masking=true)")
            object.__setattr__(self, "document_masking", True)
        return self


class TrainConfig(_Section):
    steps: int = Field(100, gt=0)
    global_batch_size: int = Field(8, gt=0)
    micro_batch_size: int = Field(0, ge=0, description="0: global_batch_size / data-parallel size")
    seed: int = Field(0, ge=0)
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(4, gt=0)
    sample_tokens: int = Field(0, ge=0, description="tokens generated from the final model (0: off)")
    sample_prompt: str = "The "


class OptimConfig(_Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm (0: off)")


class ParallelConfig(_Section):
    dp_replicate: int = Field(1, gt=0)
    dp_shard: int = Field(-1, ge=-1, description="-1: whatever is left of the world size")
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    ep: int = Field(1, gt=0, description="expert-parallel degree: experts split over this many data-parallel ranks")
    cp: int = Field(1, gt=0, description="context parallel: each sequence sharded over this many ranks")
    cp_method: Literal["ring", "allgather", "ulysses"] = Field(
        "ring", description="how attention sees the other shards: ring (K/V passed round), allgather (K/V "
        "gathered once per layer), ulysses (all-to-all to head shards)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    pp_microbatches: int = Field(0, ge=0, description="0: per-rank batch / train.micro_batch_size")
    pp_layers: list[int] = Field(default_factory=list, description="layers per pipeline stage; []: balanced")
    zero_stage: int = Field(0, ge=0, le=3)
    sequence_parallel: bool = False
    cpu_offload: bool = False
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    ddp_comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = Field(1, gt=0)
    powersgd_start_iter: int = Field(2, ge=2)
    ddp_bucket_cap_mb: float = Field(25.0, gt=0)
    ddp_broadcast_buffers: bool = False
    ddp_find_unused_parameters: bool = False
    ddp_static_graph: bool = False
    ddp_gradient_as_bucket_view: bool = True
    balance_weights: list[float] = Field(default_factory=list, description="one weight per data-parallel rank: "
                                         "uneven shares of the global batch; []: equal")
    balance: Literal["off", "auto"] = Field("off", description="auto: re-split the global batch by measured speed")
    balance_every: int = Field(20, gt=0, description="steps between re-splits under balance=auto")


Dtype = Literal["fp32", "bf16", "fp16", "fp64"]


class PrecisionConfig(_Section):
    param_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp64"] = "auto"
    compute_dtype: Dtype = "fp32"
    reduce_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp64"] = Field(
        "auto", description="auto: fp64 when compute_dtype=fp64, else fp32")


class CheckpointConfig(_Section):
    dir: str = Field("", description="empty: <run dir>/checkpoints; or an fsspec URL (s3://bucket/prefix, gs://, "
                     "az://) with credentials from the environment or a profile")
    every_steps: int = Field(0, ge=0)
    every_minutes: float = Field(0.0, ge=0)
    keep_last: int = Field(0, ge=0)
    async_save: bool = Field(False, alias="async")
    save_final: bool = True
    resume: str = "auto"

    @model_validator(mode="after")
    def _check(self) -> "CheckpointConfig":
        if self.resume not in ("auto", "none") and "://" not in self.resume and not Path(self.resume).is_dir():
            raise ValueError(f"checkpoint.resume={self.resume}: no such checkpoint directory "
                             "(allowed: auto, none, or an existing checkpoints/step_* directory)")
        return self


class MetricsConfig(_Section):
    log_every: int = Field(1, ge=0)
    jsonl: bool = True
    tensorboard: bool = False
    prometheus_port: int = Field(0, ge=0, le=65535, description="0: off; rank r serves on port + local rank")
    prometheus_host: str = "127.0.0.1"
    peak_tflops: float = Field(0.0, ge=0)
    sync_check_every: int = Field(100, ge=0, description="compare data-parallel replicas every N steps (0: off)")
    comm_profile_every: int = Field(200, ge=0, description="profile one step in N for communication per collective (0: off)")
    mlflow: bool = False
    wandb: bool = False
    nonfinite: Literal["stop", "skip_step"] = "stop"


class DistributedConfig(_Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(600.0, gt=0, description="collective timeout before a hung rank errors out")
    watchdog_factor: float = Field(20.0, ge=0, description="hang = no step for this many median step times (0: off)")
    watchdog_min_s: float = Field(300.0, gt=0, description="never call a hang before this many seconds")


class RunSection(_Section):
    name: str = ""
    dir: str = "runs"
    allow_changes: bool = Field(False, description="auto-resume this run although its data, optimizer, schedule, "
                                "batch, seed or precision changed")


class RunConfig(_Section):
    engine: Literal["torch", "deepspeed"] = "torch"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
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

    def to_yaml(self) -> str:
        """The config as run: a registry model's shape keys hold its resolved dimensions (not nulls), a model
        whose shape comes from elsewhere (model.hf, model.spec) leaves them out."""
        from dataclasses import asdict

        tree, note = self.model_dump(mode="json", by_alias=True), ""
        if tree["model"].get("lora", 0) is None:  # no adapters: the section stays out, like any unset option
            del tree["model"]["lora"]
        if self.model.moe == MoEConfig():  # likewise the MoE section of a dense model or an MoE one as given
            del tree["model"]["moe"]
        if self.model.hf or self.model.spec:
            tree["model"] = {k: v for k, v in tree["model"].items() if k not in SHAPE_KEYS}
            if self.model.hf:
                from disttrain.models.hf.shape import hf_shape

                shape = asdict(hf_shape(self.model.hf))
                note = f"# model shape from {self.model.hf}/config.json: " + ", ".join(
                    f"{k}={shape[k]}" for k in SHAPE_KEYS) + "\n"
        elif self.model.name in _registry_shapes():
            from disttrain.models.llama.shapes import resolve_shape

            shape = asdict(resolve_shape(self.model))
            tree["model"].update({k: shape[k] for k in SHAPE_KEYS})
            if shape["moe"]:
                tree["model"]["moe"] = {**tree["model"].get("moe", {}), **shape["moe"]}
        return note + yaml.safe_dump(tree, sort_keys=False)


def _registry_shapes() -> dict:
    from disttrain.models.llama.shapes import MODEL_SHAPES

    return MODEL_SHAPES


def _dotted(section: Any, key: str) -> Any:
    for part in key.split("."):
        section = getattr(section, part)
    return section


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _format_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        if msg.startswith(("model.", "data.", "train.", "optim.", "parallel.", "precision.",
                           "checkpoint.", "metrics.", "distributed.", "run.")):
            return msg
    if err["type"] == "extra_forbidden":
        section = RunConfig
        for part in loc[:-1]:
            section = section.model_fields[part].annotation
        allowed = ", ".join(f.alias or n for n, f in section.model_fields.items())
        return f"{key}: unknown key (allowed in {'.'.join(loc[:-1]) or 'the top level'}: {allowed})"
    return f"{key}={_show(err.get('input'))}: {msg[0].lower() + msg[1:]}"


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load, override and validate; raises ConfigError with a one-line message."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {p}{where} is not valid YAML") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(loaded).__name__}")
        data = loaded or {}
    data = _merge(data, parse_overrides(overrides or []))
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
    if not cfg.run.name:
        cfg.run.name = Path(path).stem if path is not None else "run"
    _prefer_the_models_tokenizer(cfg, path, "tokenizer" in parse_overrides(overrides or []).get("data", {}))
    from disttrain.config.checks import validate_config

    validate_config(cfg)
    return cfg


def _prefer_the_models_tokenizer(cfg: RunConfig, path, on_command_line: bool) -> None:
    """model.hf=DIR with DIR/tokenizer.json trains with that tokenizer unless `data.tokenizer` is given on
    the command line: a config file's value (`byte` in a config written for the built-in model) gives way
    to `auto`, named in a warning. Shard directories carry their own tokenizer, so only `builtin` is affected."""
    tok = cfg.data.tokenizer
    if not cfg.model.hf or on_command_line or tok == "auto" or cfg.data.source != "builtin":
        return
    own = Path(cfg.model.hf) / "tokenizer.json"
    if not own.is_file():
        return
    cfg.data.tokenizer = "auto"
    if tok == "byte" or not Path(tok).is_file() or not Path(tok).samefile(own):
        cfg.warnings.append(f"data.tokenizer={tok} from {path} is not used: model.hf={cfg.model.hf} has its own "
                            f"tokenizer ({own}), which trains instead; give data.tokenizer={tok} on the command "
                            "line to keep it")
