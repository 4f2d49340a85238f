"""How a Hugging Face decoder is cut: its own `base_model_tp_plan` for tensor parallelism, and a
pipeline split of `model.layers` (embeddings with the first stage; final norm and head with the last)."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from disttrain.core.errors import UserError
from disttrain.models.hf.tp_plans import MOE_OUTPUTS, block_entries, hand_written, own_styles
from disttrain.models.hf.tp_heads import ReplicatedOverHeads
from disttrain.models.output_head import head_parallel_style


MASKS = {  # a layer type (config.layer_types) -> the transformers.masking_utils function its layers attend with
    "full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask", "linear_attention": "create_recurrent_attention_mask"}


def layer_types(config) -> list[str]:
    """Each layer's kind (Gemma's sliding and global attention, gpt-oss's alternation, Qwen3-Next's linear
    attention); all `full_attention` for a model that does not say."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


class HFStage(nn.Module):
    """One pipeline stage of a transformers decoder: what the model's own forward does, on some layers. Each
    layer gets the mask and the rotary table of its kind, looked up by its index in the whole model (the keys
    of `layers`), as the model's forward does by enumerating all of them."""

    def __init__(self, config, embed_tokens, layers: dict, norm, lm_head, rotary_emb):
        super().__init__()
        self.config = config
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        self.layers = nn.ModuleDict(layers)
        self.rotary_emb = rotary_emb
        kinds = layer_types(config)
        self.kinds = {key: kinds[int(key)] for key in layers}
        self.per_kind_rotary = "layer_type" in inspect.signature(rotary_emb.forward).parameters

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from transformers import masking_utils

        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks, rotary = {}, {}
        for kind in set(self.kinds.values()):
            masks[kind] = getattr(masking_utils, MASKS[kind])(
                config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                position_ids=position_ids)
        shared = None if self.per_kind_rotary else self.rotary_emb(h, position_ids=position_ids)
        for kind in masks:
            rotary[kind] = self.rotary_emb(h, position_ids, kind) if self.per_kind_rotary else shared
        for key, layer in self.layers.items():
            kind = self.kinds[key]
            h = layer(h, attention_mask=masks[kind], position_ids=position_ids, position_embeddings=rotary[kind])
        if self.norm is not None:
            h = self.lm_head(self.norm(h))
        return h


def _decoder(model: nn.Module, key: str = "parallel.pp") -> nn.Module:
    base = _llama_like_decoder(model)
    if base is None:
        raise UserError(f"{key} > 1 with model.hf ({model.config.model_type}): the pipeline split needs a decoder "
                        "with model.embed_tokens, model.layers, model.norm and model.rotary_emb (Llama, Qwen2, "
                        f"Mistral); allowed for {model.config.model_type}: {key}=1")
    return base


def _llama_like_decoder(model: nn.Module) -> nn.Module | None:
    """The base model when it has the usual decoder structure the split and the TP plan rely on."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    return base if base is not None and all(hasattr(base, a) for a in parts) and hasattr(model, "lm_head") else None


def can_split(model: nn.Module) -> bool:
    return _llama_like_decoder(model) is not None and not stage_problem(model.config)


def stage_problem(config) -> str:
    """Why pipeline stages cannot build this model's masks ('' when they can)."""
    unknown = sorted(set(layer_types(config)) - set(MASKS))
    if unknown:
        return f"a stage cannot mask its layers of type {unknown[0]}"
    if getattr(config, "use_bidirectional_attention", False):
        return "a stage cannot build its bidirectional attention mask"
    if getattr(config, "hidden_size_per_layer_input", 0):
        return "its layers take per-layer input embeddings (Gemma 4), which a stage does not pass on"
    if getattr(config, "num_kv_shared_layers", 0):
        return "later layers reuse earlier layers' keys and values, which a stage does not pass on"
    return ""


def plan_problem(config) -> str:
    """Why the model's tensor-parallel plan (tp_plans.py) cannot be applied ('' when it can, or when it has none)."""
    for key, style in block_entries(config).items():
        if not key.startswith("layers.*.") or style not in {**STYLES, **own_styles(config)}:
            return f"its plan entry {key}={style} is not supported yet"
    return ""


def blocks(module: nn.Module) -> nn.Module:
    """The repeated blocks: `model.layers` (Llama-like), else the base model's largest ModuleList (GPT-2's `h`)."""
    if isinstance(module, HFStage):
        return module.layers
    base = getattr(module, getattr(module, "base_model_prefix", ""), None) or module
    if hasattr(base, "layers"):
        return base.layers
    lists = [m for m in base.children() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise UserError(f"model {type(module).__name__} has no list of repeated blocks to shard and checkpoint")
    return max(lists, key=len)


def _parts(module: nn.Module):
    """(config, embedding, layers, output head) of a whole model or of a stage."""
    if isinstance(module, HFStage):
        return module.config, module.embed_tokens, module.layers, module.lm_head
    decoder = _decoder(module, "parallel.tp")
    return module.config, decoder.embed_tokens, decoder.layers, module.lm_head


def tensor_parallel(module: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """The model's tensor-parallel plan (its own `base_model_tp_plan`, completed by tp_plans.py) on every block.
    With sequence parallelism the residual stream between blocks is split along the sequence: the model-level
    forward still sees the whole sequence (the embedding output is replicated, so transformers derives positions
    and the causal mask from the full length), the first block takes its slice locally, norms run on slices,
    attention and MLP gather the sequence on entry and reduce-scatter on exit (an MoE block: slice its output), and
    the head gathers it back."""
    config, embed, layers, head = _parts(module)
    for i, block in enumerate(layers.children()):
        parallelize_module(block, tp_mesh, _block_plan(config, block, sequence_parallel))
        for path, split in hand_written(config):
            if _has(block, path):
                split(block.get_submodule(path), tp_mesh)
        if sequence_parallel and i == 0:  # replicated embeddings in, this rank's slice out (no communication)
            parallelize_module(block, tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                  desired_input_layouts=(Shard(1),),
                                                                  use_local_output=True))
    if embed is not None:
        parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if head is not None:
        parallelize_module(head, tp_mesh, head_parallel_style(head, Shard(1) if sequence_parallel else Replicate()))
        if sequence_parallel:
            parallelize_module(_decoder(module, "parallel.tp").norm, tp_mesh, SequenceParallel(use_local_output=True))
    if getattr(config, "tie_word_embeddings", False) and embed is not None and head is not None:
        head.weight = embed.weight  # both Shard(0) of the (vocab, dim) matrix: share again


# The plan entries `tensor_parallel` applies (transformers' names); `plan_problem` refuses a plan with any other.
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "replicated_with_grad_allreduce": ReplicatedOverHeads}


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def _moe(block: nn.Module) -> bool:
    return hasattr(getattr(block, "mlp", None), "experts")


def _block_plan(config, block: nn.Module, sequence_parallel: bool) -> dict:
    """The styles of one block: the plan's entries this block has (a dense first layer has no shared experts, an
    MoE layer no dense MLP). With sequence parallelism the attention's and dense MLP's rowwise layers
    reduce-scatter to sequence slices; in an MoE block the shared experts all-reduce (their output is added to
    the routed experts', whole on every rank) and the block's output is sliced (`_sequence_parallel_entries`)."""
    plan, styles = {}, {**STYLES, **own_styles(config)}
    for key, style in block_entries(config).items():  # plan_problem refused any other entry
        sub = key[len("layers.*."):]
        if not _has(block, sub):
            continue
        if sequence_parallel and style == "rowwise" and not (_moe(block) and sub.startswith("mlp.")):
            plan[sub] = RowwiseParallel(output_layouts=Shard(1))
        else:
            plan[sub] = styles[style]()
    if sequence_parallel:
        plan.update(_sequence_parallel_entries(block, MOE_OUTPUTS.get(config.model_type, 1)))
    return plan


def _sequence_parallel_entries(block: nn.Module, moe_outputs: int = 1) -> dict:
    """Norms on sequence slices; attention and MLP gather the sequence once on entry (transformers calls
    attention with `hidden_states=` and the MLP positionally). An MoE block's output, whole on every rank, is
    sliced back to this rank's part of the sequence (no communication; its other outputs, gpt-oss's router
    scores, pass through)."""
    entries = {}
    for name, child in block.named_children():
        if "norm" in name.lower():
            entries[name] = SequenceParallel(use_local_output=True)
    attention = "self_attn" if hasattr(block, "self_attn") else "linear_attn"  # Gated DeltaNet layers
    if not entries or not hasattr(block, attention) or not hasattr(block, "mlp"):
        raise UserError(f"parallel.sequence_parallel=true: block {type(block).__name__} has no norms / self_attn / mlp "
                        "to place sequence parallelism on; allowed for it: false")
    entries[attention] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True)
    if _moe(block):
        rest = (None,) * (moe_outputs - 1)
        entries["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(), *rest), desired_output_layouts=(Shard(1), *rest), use_local_output=True)
    else:
        entries["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
    return entries


def pipeline_split(model: nn.Module, ranges: list[range], owned: list[int]) -> list[nn.Module]:
    """Prune to this rank's layers (kept under their original names `model.layers.<i>`), one view per stage."""
    decoder = _decoder(model)
    keep = sorted({i for s in owned for i in ranges[s]})
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in keep})
    last = len(ranges) - 1
    stages = [HFStage(model.config, decoder.embed_tokens if s == 0 else None,
                      {str(i): decoder.layers[str(i)] for i in ranges[s]},
                      decoder.norm if s == last else None, model.lm_head if s == last else None, decoder.rotary_emb)
              for s in owned]
    if 0 not in owned:
        decoder.embed_tokens = None
    if last not in owned:
        decoder.norm = None
        model.lm_head = None
    return stages
