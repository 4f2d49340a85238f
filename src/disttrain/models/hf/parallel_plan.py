"""How a Hugging Face decoder is cut: its own `base_model_tp_plan` for tensor parallelism, and a
pipeline split of `model.layers` (embeddings with the first stage; final norm and head with the last)."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from disttrain.core.errors import UserError
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
    """Why the model's own tensor-parallel plan cannot be applied ('' when it can, or when it has none)."""
    for key, style in (getattr(type(config), "base_model_tp_plan", None) or {}).items():
        if not key.startswith("layers.*.") or style not in STYLES:
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
    """The model's own `base_model_tp_plan` on every block. With sequence parallelism the residual stream
    between blocks is split along the sequence: the model-level forward still sees the whole sequence
    (the embedding output is replicated, so transformers derives positions and the causal mask from the
    full length), the first block takes its slice locally, norms run on slices, attention and MLP gather
    the sequence on entry and reduce-scatter on exit, and the head gathers it back."""
    config, embed, layers, head = _parts(module)
    block_plan = {}
    for key, style in type(config).base_model_tp_plan.items():  # plan_problem refused any other entry
        sub = key[len("layers.*."):]
        if sequence_parallel and style == "rowwise":
            block_plan[sub] = RowwiseParallel(output_layouts=Shard(1))
        else:
            block_plan[sub] = STYLES[style]()
    if sequence_parallel:
        block_plan.update(_sequence_parallel_entries(next(iter(layers.children()))))
    for i, block in enumerate(layers.children()):
        parallelize_module(block, tp_mesh, block_plan)
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


class ReplicatedOverHeads(ParallelStyle):
    """A small module applied to each head on its own (Qwen3's and Gemma's query/key norms over `head_dim`): its
    weight is replicated over the tensor-parallel ranks, its input (batch, seq, this rank's heads, head_dim) is
    declared sharded over the heads, so DTensor sums the weight's gradient over every rank's heads, as one
    process sums it over all of them. transformers' name for it: `replicated_with_grad_allreduce`."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def replicate(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                         requires_grad=param.requires_grad))

        def heads_in(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(x.ndim - 2)], run_check=False) for x in inputs)

        return distribute_module(module, device_mesh, replicate, heads_in, lambda mod, out, mesh: out.to_local())


# The plan entries `tensor_parallel` applies (transformers' names); `plan_problem` refuses a plan with any other.
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "replicated_with_grad_allreduce": ReplicatedOverHeads}


def _sequence_parallel_entries(block: nn.Module) -> dict:
    """Norms on sequence slices; attention and MLP gather the sequence once on entry (transformers calls
    attention with `hidden_states=` and the MLP positionally)."""
    entries = {}
    for name, child in block.named_children():
        if "norm" in name.lower():
            entries[name] = SequenceParallel(use_local_output=True)
    if not entries or not hasattr(block, "self_attn") or not hasattr(block, "mlp"):
        raise UserError(f"parallel.sequence_parallel=true: block {type(block).__name__} has no norms / self_attn / mlp "
                        "to place sequence parallelism on; allowed for it: false")
    entries["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                              desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                              use_local_output=True)
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
