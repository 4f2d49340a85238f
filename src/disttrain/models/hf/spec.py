"""A Hugging Face causal LM (a local `save_pretrained` directory) as a ModelSpec.

The module is transformers' own `AutoModelForCausalLM` built from config.json (with the attention kernel it
needs, kernels.py; no KV cache), so parameter names are the checkpoint's and `disttrain convert --to hf` is an
identity mapping. What the framework adds from outside: the architecture's own initialisation seeded by module
name (the same on every layout, init.py), the model's own tensor-parallel plan (`base_model_tp_plan`), a
pipeline split of `model.layers`, weights read with safetensors, and norms and routers that stay float64 in fp64
runs (float64.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from disttrain.core.errors import UserError
from disttrain.models.hf.float64 import keep_float64
from disttrain.core.hub import local_directory
from disttrain.models.hf.shape import hf_shape, read_config
from disttrain.models.spec import ModelSpec, copy_weights, token_cross_entropy_sum


def _load_config(directory: str):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"model.hf={directory}: transformers cannot read its config.json "
                        f"({str(exc).splitlines()[0]})") from None
    config.use_cache = False
    return config


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """The architecture's own initialisation, seeded by module name (models/hf/init.py). Non-persistent buffers
    of modules that hold a config are rebuilt first, for a family whose `_init_weights` misses one."""
    from disttrain.models.hf.init import init_by_architecture

    rebuild_buffers(model)
    init_by_architecture(model, seed)


@torch.no_grad()
def rebuild_buffers(model: nn.Module) -> None:
    for module in model.modules():
        persistent = set(module.state_dict(keep_vars=True).keys())
        lost = [n for n, _ in module.named_buffers(recurse=False) if n not in persistent]
        if lost and hasattr(module, "config"):
            device = getattr(module, lost[0]).device
            with torch.device(device):
                fresh = type(module)(module.config)
            for n in lost:
                getattr(module, n).copy_(getattr(fresh, n))


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


@torch.no_grad()
def load_pretrained(model: nn.Module, directory: str) -> None:
    """Copy the directory's safetensors weights into a materialised model (before parallelisation)."""
    from safetensors.torch import load_file

    files = _weight_files(Path(directory))
    if not files:
        return
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    if any(name.endswith("experts.gate_up_proj") and name not in state for name, _ in model.named_parameters()):
        state = _converted_by_transformers(directory)
    try:
        copy_weights(model, state)
    except ValueError as exc:
        raise UserError(f"model.hf={directory}: {exc} its config.json describes") from None


def _converted_by_transformers(directory: str) -> dict:
    """MoE checkpoints hold one matrix per expert (`experts.0.gate_proj`, Mixtral's `block_sparse_moe...w1`);
    transformers' loader converts them to its fused 3-D parameters, so it reads them (a second copy in memory
    while loading)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    return loaded.state_dict()


def _published_config(raw: dict):
    from transformers import AutoConfig

    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    config.use_cache = False
    return config


def hf_spec(directory: str, routing=None, attention: str = "auto", config: dict | None = None) -> ModelSpec:
    """`routing`: model.moe's training keys (a models.moe.MoERouting) for a sparse-MoE family (models/hf/moe.py).
    `directory`: a local directory or a Hub id (read from its cached snapshot, core/hub.py); with `config` (a
    config.json's contents: a registry name's, models/hf/published.py) only the name in messages, no weights.
    `attention`: model.attn_implementation (models/hf/kernels.py)."""
    from functools import partial

    from disttrain.models.hf import kernels, parallel_plan, stages
    from disttrain.models.hf.moe import SUPPORTED, hf_moe_layers
    from disttrain.models.hf.shape import config_shape
    from disttrain.models.moe.layer import MoERouting

    weights = config is None  # a registry name has none
    if weights:
        directory = local_directory(directory)
        shape, raw, config = hf_shape(directory), read_config(directory), _load_config(directory)
    else:
        shape, raw, config = config_shape(config, f"model.name={directory}"), config, _published_config(config)
    source = f"model.hf={directory}" if weights else f"model.name={directory}"
    attn_implementation, attention_why = kernels.choose_attention(config, attention, source)
    experts = kernels.experts_implementation(config)

    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32, **experts)
        keep_float64(model)  # fp64 runs (build_model converts after init) stay float64 in norms and routers
        return model

    with torch.device("meta"):
        splittable = stages.can_split(build())
    tied = (("model.embed_tokens.weight", "lm_head.weight"),) if shape.tie_embeddings else ()
    tp_note = "" if parallel_plan.block_entries(config) else "its config class has no base_model_tp_plan"
    tp_note = tp_note or parallel_plan.plan_problem(config)
    from disttrain.models.hf import context, linear_kernels

    linear = "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or [])
    documents_note = "its linear-attention layers carry their state across document boundaries, which document " \
        f"masking restarts for {' and '.join(linear_kernels.MODEL_TYPES)} only" \
        if linear and config.model_type not in linear_kernels.MODEL_TYPES else ""
    softcap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    fingerprint = hashlib.sha256(json.dumps({k: raw.get(k) for k in sorted(raw) if k not in (
        "transformers_version", "torch_dtype", "dtype", "use_cache", "architectures")}, sort_keys=True,
        default=str).encode()).hexdigest()[:16]
    return ModelSpec(
        name=config.model_type, build=build,
        init_weights=init_weights,
        blocks=lambda m: parallel_plan.blocks(m), shape=shape, max_seq_len=shape.max_seq_len,
        loss_sum=lambda out, targets: token_cross_entropy_sum(logits_of(out), targets), logits=logits_of,
        tensor_parallel=None if tp_note else parallel_plan.tensor_parallel, tensor_parallel_note=tp_note,
        sequence_parallel=not tp_note, pipeline_split=stages.pipeline_split if splittable else None,
        pipeline_note=stages.stage_problem(config), tied_parameters=tied,
        mask_documents=None if documents_note else mask_documents, causal=True,  # causal language models only
        mask_documents_note=documents_note,
        moe_layers=partial(hf_moe_layers, routing=routing or MoERouting())
        if config.model_type in SUPPORTED and shape.moe is not None else None,  # Gemma 4: its MoE block is optional
        context_parallel=context.context_parallel if config.model_type in context.MODEL_TYPES else None,
        context_parallel_note=context.refusal(config),  # every method takes windows, sinks and latent attention
        to_hf=dict, from_hf=dict, hf_config=lambda: {**raw, "use_cache": True},
        load_pretrained=lambda m: load_pretrained(m, directory) if weights else None,
        fingerprint=fingerprint,
        attention=f"{attn_implementation} ({attention_why})" if attention_why else attn_implementation,
        output_head=None if softcap else (lambda m: m.get_output_embeddings()),
        output_head_note=f"transformers soft-caps its logits (final_logit_softcapping={softcap})" if softcap else "")


def mask_documents(model: nn.Module, eos_id: int) -> None:
    """Positions restart after each `eos_id` (transformers then masks attention between documents); Gated DeltaNet
    layers restart their convolution and recurrent state there too (linear_kernels.py)."""
    from disttrain.models.documents import position_ids_from_documents
    from disttrain.models.hf import linear_kernels

    model.register_forward_pre_hook(position_ids_from_documents(eos_id), with_kwargs=True)
    linear_kernels.mask_documents(model)


def logits_of(out) -> torch.Tensor:
    """transformers returns a ModelOutput; a pipeline stage returns the logits tensor itself."""
    return out if isinstance(out, torch.Tensor) else out.logits
