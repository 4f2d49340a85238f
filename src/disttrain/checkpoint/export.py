"""Export a committed checkpoint as one file (torch, safetensors) or a Hugging Face Llama folder,
and load such weights to start a run (`model.init_from`).

Parameter names are disttrain's (`layers.0.attention.wq.weight`); the `hf` format renames them to
`transformers`' LlamaForCausalLM names. disttrain's rotary embedding uses the same rotate-half
convention as HF Llama, so no weight permutation is needed.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from disttrain.models.registry import ModelShape

FORMATS = ("torch", "safetensors", "hf")
_HF_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, or a run directory (its newest committed checkpoint)."""
    from disttrain.checkpoint.manager import COMMIT, CheckpointManager

    path = Path(path)
    if (path / COMMIT).is_file():
        return path
    ckpt_dir = path / "checkpoints"
    config = path / "config.yaml"
    if config.is_file():
        import yaml

        configured = (yaml.safe_load(config.read_text()) or {}).get("checkpoint", {}).get("dir")
        ckpt_dir = Path(configured) if configured else ckpt_dir
    latest = CheckpointManager(ckpt_dir, rank=0).latest()
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a committed checkpoint nor a run directory holding one")
    return latest


def checkpoint_shape(step_dir: Path) -> ModelShape:
    from disttrain.checkpoint.manager import CheckpointManager
    from disttrain.config import ModelConfig
    from disttrain.models.registry import resolve_shape

    state = CheckpointManager.read_train_state(step_dir)
    return resolve_shape(ModelConfig.model_validate(state["config"]["model"]))


def full_model_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """Unsharded fp32 parameters, whatever layout or engine wrote the checkpoint; no process group needed."""
    if (step_dir / "deepspeed").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag="deepspeed")
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(step_dir, Path(tmp) / "full.pt")
            state = torch.load(Path(tmp) / "full.pt", weights_only=True)["model"]
    return {k: v.detach().float().contiguous() for k, v in state.items() if not k.startswith("rope_")}


def to_hf_names(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = tensor
        elif name == "norm.weight":
            out["model.norm.weight"] = tensor
        elif name == "output.weight":
            if not shape.tie_embeddings:
                out["lm_head.weight"] = tensor
        else:
            m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
            out[f"model.layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}.weight"] = tensor
    return out


def from_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    back = {v: k for k, v in _HF_LAYER.items()}
    out = {}
    for name, tensor in state.items():
        if name == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            out["norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["output.weight"] = tensor
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
            out[f"layers.{m.group(1)}.{back[m.group(2)]}.weight"] = tensor
    return out


def hf_config(shape: ModelShape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_hidden_dim, "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads, "num_key_value_heads": shape.n_kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size, "max_position_embeddings": shape.max_seq_len, "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta, "tie_word_embeddings": shape.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


def _untie(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: a tied output matrix is stored once (as the embedding)."""
    if shape.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "output.weight"}
    return {k: v.clone() for k, v in state.items()}


def export(checkpoint: str | Path, fmt: str, out: str | Path) -> Path:
    from safetensors.torch import save_file

    step_dir = resolve_checkpoint(checkpoint)
    shape = checkpoint_shape(step_dir)
    state = full_model_state(step_dir)
    out = Path(out)
    meta = {"format": "disttrain", "shape": json.dumps(asdict(shape)), "source": str(step_dir)}
    if fmt == "torch":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": state, "shape": asdict(shape)}, out)
    elif fmt == "safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(_untie(state, shape), str(out), metadata=meta)
    elif fmt == "hf":
        out.mkdir(parents=True, exist_ok=True)
        save_file(_untie(to_hf_names(state, shape), shape), str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    else:
        raise ValueError(f"unknown format {fmt!r} (allowed: {', '.join(FORMATS)})")
    return out


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights written by `export` (any format), by disttrain names; never unpickles code."""
    path = Path(path)
    if path.is_dir():
        from safetensors.torch import load_file

        return from_hf_names(load_file(str(path / "model.safetensors")))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)["model"]


@torch.no_grad()
def init_from(model: torch.nn.Module, path: str | Path) -> None:
    """Copy exported weights into a materialised single-device model (before parallelisation)."""
    state = load_weights(path)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"the weights lack {len(missing)} parameters of this model (e.g. {missing[0]}; "
                         "is model.tie_embeddings as when they were saved?)")
    for name, param in params.items():
        source = state[name]
        if source.shape != param.shape:
            raise ValueError(f"{name} has shape {tuple(source.shape)} in the weights, {tuple(param.shape)} in the model")
        param.copy_(source)
