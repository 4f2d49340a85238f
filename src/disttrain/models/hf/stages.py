"""The pipeline split of a transformers decoder: `model.layers` cut into stages (embeddings with the first,
final norm and head with the last), each stage running what the model's own forward does on its layers.

Besides the hidden states a stage passes on what its successors' layers need from earlier ones (Gemma 4):
- the per-layer input embeddings, computed on the first stage from the token ids and the embedded tokens (by
  the model's own `get_per_layer_inputs` / `project_per_layer_inputs`), the slices of the layers still to come;
- the keys and values a layer stores for later layers of its kind to reuse (`num_kv_shared_layers`), when the
  layers that reuse them sit on a later stage.
They travel as further stage outputs, so their gradients come back through the schedule to the parameters that
made them, as in one process.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from disttrain.core.errors import UserError

MASKS = {  # a layer type (config.layer_types) -> the transformers.masking_utils function its layers attend with
    "full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask", "linear_attention": "create_recurrent_attention_mask"}
PER_LAYER_MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


def layer_types(config) -> list[str]:
    """Each layer's kind (Gemma's sliding and global attention, gpt-oss's alternation, Qwen3-Next's linear
    attention); all `full_attention` for a model that does not say."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def kv_handoffs(config, ranges: list[range]) -> list[tuple[str, ...]]:
    """For each stage but the last, the layer kinds whose stored keys and values it passes on: stored on it or
    before, reused after it."""
    modes = getattr(config, "kv_sharing_modes", None) or [None] * config.num_hidden_layers
    kinds = layer_types(config)
    stage_of = {i: s for s, r in enumerate(ranges) for i in r}
    stored = {kinds[i]: stage_of[i] for i, m in enumerate(modes) if m == "store"}
    reused = {}  # kind -> the last stage reusing it
    for i, m in enumerate(modes):
        if m == "reuse":
            reused[kinds[i]] = max(reused.get(kinds[i], -1), stage_of[i])
    return [tuple(k for k in sorted(stored) if stored[k] <= s < reused.get(k, -1)) for s in range(len(ranges) - 1)]


class ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is contiguous: a stage sends its inputs' gradients back, and a send takes contiguous
    tensors only (attention's gradient of a key is a transposed view; torch's schedule makes the receiving buffer
    with the strides it had)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class HFStage(nn.Module):
    """One pipeline stage of a transformers decoder: what the model's own forward does, on some layers. Each
    layer gets the mask and the rotary table of its kind, looked up by its index in the whole model (the keys
    of `layers`), as the model's forward does by enumerating all of them. `forward(h, *carried)`: carried
    are the per-layer inputs from this stage's first layer on (Gemma 4), then the keys and values of each kind
    in `kv_in`; a stage that passes more than its hidden states returns them in the same order."""

    def __init__(self, config, embed_tokens, layers: dict, norm, lm_head, rotary_emb, first_layer: int,
                 next_layer: int | None, kv_in=(), kv_out=(), per_layer: dict | None = None, per_layer_fns=None):
        super().__init__()
        self.config = config
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        self.layers = nn.ModuleDict(layers)
        self.rotary_emb = rotary_emb
        kinds = layer_types(config)
        self.kinds = {key: kinds[int(key)] for key in layers}
        self.per_kind_rotary = "layer_type" in inspect.signature(rotary_emb.forward).parameters
        self.first_layer, self.next_layer = first_layer, next_layer
        self.kv_in, self.kv_out = tuple(kv_in), tuple(kv_out)
        self.per_layer_input = bool(getattr(config, "hidden_size_per_layer_input", 0))
        self.shares_kv = hasattr(config, "kv_sharing_modes")  # Gemma 4's layers take a `shared_kv_states` dict
        for name, module in (per_layer or {}).items():  # the first stage's per-layer input modules
            setattr(self, name, module)
        self._per_layer_fns = per_layer_fns  # the base model's bound methods (not registered: not a submodule)

    def forward(self, h: torch.Tensor, *carried: torch.Tensor):
        from transformers import masking_utils

        carried = [ContiguousGrad.apply(t) for t in carried]
        per_layer = carried.pop(0) if self.per_layer_input and self.embed_tokens is None else None
        if self.embed_tokens is not None:
            ids, h = h, self.embed_tokens(h)
            if self.per_layer_input:
                get_inputs, project = self._per_layer_fns
                per_layer = project(h, get_inputs(ids, h))
        shared = self._shared(carried)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks, rotary = {}, {}
        for kind in set(self.kinds.values()):
            masks[kind] = getattr(masking_utils, MASKS[kind])(
                config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                position_ids=position_ids)
        shared_rotary = None if self.per_kind_rotary else self.rotary_emb(h, position_ids=position_ids)
        for kind in masks:
            rotary[kind] = self.rotary_emb(h, position_ids, kind) if self.per_kind_rotary else shared_rotary
        for key, layer in self.layers.items():
            kind = self.kinds[key]
            args = (h,) if per_layer is None else (h, per_layer[:, :, int(key) - self.first_layer])
            extra = {"shared_kv_states": shared} if self.shares_kv else {}
            h = layer(*args, attention_mask=masks[kind], position_ids=position_ids, position_embeddings=rotary[kind],
                      **extra)
        if self.norm is not None:
            return self.lm_head(self.norm(h))
        outputs = [h]
        if per_layer is not None:
            outputs.append(per_layer[:, :, self.next_layer - self.first_layer:].contiguous())
        for kind in self.kv_out:
            outputs.extend(t.contiguous() for t in shared[kind])  # a send needs contiguous tensors
        return tuple(outputs) if len(outputs) > 1 else h

    def carried_examples(self, batch: int, seq: int, tp: int, dtype) -> tuple[list, list]:
        """Example tensors of what this stage receives and sends besides the hidden states (the dry run gives the
        schedule every stage's shapes up front): per-layer inputs of the layers still to come, and each kind's
        keys and values (batch, this rank's key/value heads, sequence, head dim)."""
        def example(*shape):
            return torch.empty(*shape, dtype=dtype, requires_grad=True)

        width, layers = getattr(self.config, "hidden_size_per_layer_input", 0), self.config.num_hidden_layers
        received = [example(batch, seq, layers - self.first_layer, width)] if width and self.embed_tokens is None else []
        sent = [example(batch, seq, layers - self.next_layer, width)] if width and self.next_layer is not None else []
        for kinds, into in ((self.kv_in, received), (self.kv_out, sent)):
            for kind in kinds:
                heads, dim = _key_value_shape(self.config, kind)
                into.extend(example(batch, heads // tp, seq, dim) for _ in range(2))
        return received, sent

    def _shared(self, carried: list):
        if not self.shares_kv:
            return None
        from transformers.cache_utils import KVSharingDict

        return KVSharingDict({kind: (carried[2 * i], carried[2 * i + 1]) for i, kind in enumerate(self.kv_in)})


def _key_value_shape(config, kind: str) -> tuple[int, int]:
    """(key/value heads, head dim) of the layer storing the keys and values of this kind (Gemma 4's global layers
    have their own: `per_layer_config`)."""
    modes = config.kv_sharing_modes
    index = next(i for i, (m, k) in enumerate(zip(modes, layer_types(config))) if m == "store" and k == kind)
    layer = config.per_layer_config[index] if hasattr(config, "per_layer_config") else config
    return layer.num_key_value_heads, layer.head_dim


def decoder(model: nn.Module, key: str = "parallel.pp") -> nn.Module:
    base = llama_like_decoder(model)
    if base is None:
        raise UserError(f"{key} > 1 with model.hf ({model.config.model_type}): the pipeline split needs a decoder "
                        "with model.embed_tokens, model.layers, model.norm and model.rotary_emb (Llama, Qwen2, "
                        f"Mistral); allowed for {model.config.model_type}: {key}=1")
    return base


def llama_like_decoder(model: nn.Module) -> nn.Module | None:
    """The base model when it has the usual decoder structure the split and the TP plan rely on."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    return base if base is not None and all(hasattr(base, a) for a in parts) and hasattr(model, "lm_head") else None


def can_split(model: nn.Module) -> bool:
    return llama_like_decoder(model) is not None and not stage_problem(model.config)


def stage_problem(config) -> str:
    """Why pipeline stages cannot build this model's masks ('' when they can)."""
    unknown = sorted(set(layer_types(config)) - set(MASKS))
    if unknown:
        return f"a stage cannot mask its layers of type {unknown[0]}"
    if getattr(config, "use_bidirectional_attention", False):
        return "a stage cannot build its bidirectional attention mask"
    return ""


def pipeline_split(model: nn.Module, ranges: list[range], owned: list[int]) -> list[nn.Module]:
    """Prune to this rank's layers (kept under their original names `model.layers.<i>`), one view per stage."""
    base = decoder(model)
    keep = sorted({i for s in owned for i in ranges[s]})
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in keep})
    last = len(ranges) - 1
    handoffs = kv_handoffs(model.config, ranges)
    per_layer = {n: getattr(base, n) for n in PER_LAYER_MODULES if getattr(base, n, None) is not None}
    fns = (base.get_per_layer_inputs, base.project_per_layer_inputs) if per_layer else None
    stages = [HFStage(model.config, base.embed_tokens if s == 0 else None,
                      {str(i): base.layers[str(i)] for i in ranges[s]},
                      base.norm if s == last else None, model.lm_head if s == last else None, base.rotary_emb,
                      first_layer=ranges[s].start, next_layer=ranges[s + 1].start if s < last else None,
                      kv_in=handoffs[s - 1] if s > 0 else (), kv_out=handoffs[s] if s < last else (),
                      per_layer=per_layer if s == 0 else None, per_layer_fns=fns if s == 0 else None)
              for s in owned]
    if 0 not in owned:
        base.embed_tokens = None
        for name in per_layer:
            setattr(base, name, None)
    if last not in owned:
        base.norm = None
        model.lm_head = None
    return stages
