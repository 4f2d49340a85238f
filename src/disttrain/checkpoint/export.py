"""Export a committed checkpoint as one file (torch, safetensors) or a Hugging Face folder, and load
such weights to start a run (`model.init_from`).

Parameter names are the model's own; the `hf` format renames them through the ModelSpec's
state-dict adapter (`to_hf`/`from_hf`) and writes its `hf_config`, plus the run's tokenizer (saved by
transformers, so `AutoTokenizer.from_pretrained` reads it) and a generation config when the run had
them. Exported files are readable by everyone (0644), like any model download.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from disttrain.core.errors import UserError

FORMATS = ("torch", "safetensors", "hf", "peft")


def resolve_checkpoint(path: str | Path) -> str:
    """A step directory, a checkpoint directory, or a run directory (its newest committed checkpoint); local
    paths or URLs (a run directory's config.yaml may name remote checkpoints)."""
    from disttrain.core import storage
    from disttrain.checkpoint.manager import COMMIT, CheckpointManager

    path = str(path).rstrip("/") if storage.is_url(path) else str(path)
    if storage.isfile(storage.join(path, COMMIT)):
        return path
    ckpt_dir = storage.join(path, "checkpoints")
    config = storage.join(path, "config.yaml")
    if storage.isfile(config):
        import yaml

        configured = (yaml.safe_load(storage.read_text(config)) or {}).get("checkpoint", {}).get("dir")
        ckpt_dir = configured or ckpt_dir
    elif not storage.exists(ckpt_dir):
        ckpt_dir = path  # a checkpoint directory itself (checkpoint.dir)
    latest = CheckpointManager(ckpt_dir, rank=0).latest()
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a committed checkpoint nor a run directory holding one")
    return latest


def saved_run_of(step_dir):
    """What the checkpoint's saved config says of its run (config/saved.py)."""
    from disttrain.checkpoint.manager import CheckpointManager
    from disttrain.config.saved import saved_run

    return saved_run(CheckpointManager.read_train_state(step_dir))


def full_model_state(step_dir, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """Unsharded parameters in `dtype` (None: as saved), whatever layout or engine wrote the checkpoint; no process
    group needed."""
    from disttrain.checkpoint.manager import CheckpointManager

    if CheckpointManager.format_of(step_dir) == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag="deepspeed")
    else:  # what dcp_to_torch_save does, with the reader of the location (a local path or a URL)
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        from disttrain.core import storage

        full: dict = {}
        # the model's entries only: the optimizer's may be states of other libraries' types (8-bit moments)
        _load_state_dict(full, storage_reader=storage.dcp_reader(step_dir),
                         planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
        state = full["model"]
    return {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in state.items() if not k.startswith("rope_")}


def trained_weights(run: str, key: str) -> dict[str, torch.Tensor]:
    """The model's parameters in a run's newest committed checkpoint, by the model's own names, as saved (a LoRA
    run's adapters folded into its base, fp32), for a model built from the run's config (a distillation teacher).
    `key`: the config key that named the run, for the one-line error."""
    try:
        step_dir = resolve_checkpoint(run)
    except FileNotFoundError as exc:
        raise UserError(f"{key}={run}: {exc} (allowed: a run with a committed checkpoint, e.g. after "
                        "checkpoint.save_final=true)") from None
    saved = saved_run_of(step_dir)
    if saved.model.lora is None:
        return full_model_state(step_dir, dtype=None)
    from disttrain.checkpoint.lora_export import merged_state

    return merged_state(saved, full_model_state(step_dir), init_from)


def _untie(state: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: a tied group is stored once (under its first name)."""
    drop = {name for group in spec.tied_parameters for name in group[1:]}
    return {k: v.clone() for k, v in state.items() if k not in drop}


def export(checkpoint: str | Path, fmt: str, out: str | Path, merge_lora: bool = False) -> Path:
    """`merge_lora`: a LoRA run's adapters folded into its base (lora_export.py); `fmt` peft: the adapters alone."""
    from safetensors.torch import save_file

    from disttrain.checkpoint.lora_export import export_peft, merged_state

    step_dir = resolve_checkpoint(checkpoint)
    saved = saved_run_of(step_dir)
    spec, lora = saved.spec, saved.model.lora
    out = Path(out)
    if merge_lora and lora is None:
        raise UserError(f"--merge-lora: {step_dir} holds a run without LoRA adapters (model.lora unset); allowed "
                        "for it: convert without --merge-lora")
    if fmt == "peft":
        if lora is None or merge_lora:
            raise UserError(f"--to peft{' --merge-lora' if merge_lora else ''}: " + (
                "writes the adapters alone, not merged weights (allowed: --to peft, or --to hf --merge-lora)"
                if lora is not None else f"{step_dir} holds a run without LoRA adapters (model.lora unset); "
                "allowed for it: --to torch|safetensors|hf"))
        return _readable(export_peft(saved, full_model_state(step_dir), out))
    if lora is not None and not merge_lora:
        raise UserError(f"--to {fmt}: {step_dir} holds LoRA adapters only (the base stays frozen at its source); "
                        "allowed: --merge-lora for merged weights, or --to peft for the adapters")
    state = merged_state(saved, full_model_state(step_dir), init_from) if merge_lora else full_model_state(step_dir)
    shape = asdict(spec.shape) if spec.shape is not None else {}
    meta = {"format": "disttrain", "shape": json.dumps(shape), "source": str(step_dir)}
    if fmt == "torch":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": state, "shape": shape}, out)
    elif fmt == "safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(_untie(state, spec), str(out), metadata=meta)
    elif fmt == "hf":
        if spec.to_hf is None:
            raise UserError(f"--to hf: model {spec.name} has no Hugging Face name mapping (allowed: torch, safetensors)")
        hf_state = {k: v.clone() for k, v in spec.to_hf(_untie(state, spec)).items()}
        config = spec.hf_config()  # both may refuse what transformers cannot express: before anything is written
        out.mkdir(parents=True, exist_ok=True)
        save_file(hf_state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _save_tokenizer_and_generation(saved, out)
    else:
        raise ValueError(f"unknown format {fmt!r} (allowed: {', '.join(FORMATS)})")
    return _readable(out)


def _readable(out: Path) -> Path:
    for path in [out, *out.rglob("*")] if out.is_dir() else [out]:
        if path.is_file():
            path.chmod(0o644)  # safetensors writes 0600
    return out


def _save_tokenizer_and_generation(saved, out: Path) -> None:
    """The run's tokenizer through transformers (a model directory's own files, chat template and special
    tokens included, when it came from model.hf or from chat data) and its generation config: the model directory's, or one
    naming the tokenizer's end-of-document id (transformers' Llama default, id 2, is not ours)."""
    from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    from disttrain.data.tokenizer import load_tokenizer

    hf, spec = saved.model_dir, saved.tokenizer
    if spec and spec != "byte" and not Path(spec).is_file():
        spec = ""  # the tokenizer file is gone since training: the weights export without it
    own = bool(hf) and spec != "" and spec != "byte" and Path(spec) == Path(hf) / "tokenizer.json"
    # a chat shard directory keeps the whole tokenizer prepare-data rendered with, chat template included
    whole = spec not in ("", "byte") and (Path(spec).parent / "tokenizer_config.json").is_file()
    eos = load_tokenizer(spec).eos_id if spec else None
    if own or whole:
        AutoTokenizer.from_pretrained(hf if own else Path(spec).parent).save_pretrained(out)
    elif spec and spec != "byte":
        tok = PreTrainedTokenizerFast(tokenizer_file=spec)
        if eos is not None:
            tok.eos_token = tok.convert_ids_to_tokens(eos)
        tok.save_pretrained(out)
    elif spec == "byte":  # raw bytes: a byte-level tokenizer.json (id b = byte b), for AutoTokenizer
        from disttrain.data.tokenizer import byte_level_tokenizer

        tok, eos_token = byte_level_tokenizer()
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token).save_pretrained(out)
    if hf and (Path(hf) / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(hf).save_pretrained(out)
    elif eos is not None and not hf:
        GenerationConfig(eos_token_id=eos).save_pretrained(out)


def load_weights(path: str | Path, spec) -> dict[str, torch.Tensor]:
    """Weights written by `export` (any format), by the model's own names; never unpickles code."""
    path = Path(path)
    if path.is_dir():
        from safetensors.torch import load_file

        return spec.from_hf(load_file(str(path / "model.safetensors")))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)["model"]


@torch.no_grad()
def init_from(model: torch.nn.Module, path: str | Path, spec) -> None:
    """Copy exported weights into a materialised single-device model (before parallelisation)."""
    from disttrain.models.spec import copy_weights

    copy_weights(model, load_weights(path, spec), hint="; is model.tie_embeddings as when they were saved?")
