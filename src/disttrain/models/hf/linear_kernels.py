"""The two kernels a Gated DeltaNet layer (Qwen3-Next, Qwen3.5) reaches along the sequence with, and replacing them.

transformers' Gated DeltaNet forward calls its causal convolution and its chunked recurrence by name, as module
globals of the modeling file (`KERNELS`). A layer here runs its own forward with those names pointing, for the call
only, at the kernels the layer was given (`replace`): the document-aware ones under document masking
(linear_documents.py), wrapped by context parallelism's (parallel/linear_attention.py), so the module's forward is
not rewritten and the globals are transformers' again outside the call (other models in the process keep theirs).
"""

from __future__ import annotations

import sys

from torch import nn

KERNELS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
MODEL_TYPES = ("qwen3_next", "qwen3_5_text")  # whose Gated DeltaNet layers call KERNELS by name
POSITIONS = "document_positions"  # the keyword the kernels take each token's position in its document by


def _is_layer(module: nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _is_layer(m)]


def kernels(module: nn.Module) -> tuple:
    """(convolution, recurrence) that `module`'s forward calls: transformers' own unless replaced."""
    given = getattr(module, "disttrain_kernels", None)
    if given is not None:
        return given
    names = vars(sys.modules[type(module).__module__])
    return tuple(names[name] for name in KERNELS)


def replace(module: nn.Module, conv, rule) -> None:
    """`module`'s forward calls `conv` and `rule` from now on (module doc)."""
    first = getattr(module, "disttrain_kernels", None) is None
    module.disttrain_kernels = (conv, rule)
    if not first:
        return
    names = vars(sys.modules[type(module).__module__])
    inner = module.forward

    def forward(*args, **kwargs):
        kept = {name: names[name] for name in KERNELS}
        names.update(zip(KERNELS, module.disttrain_kernels))
        try:
            return inner(*args, **kwargs)
        finally:
            names.update(kept)

    module.forward = forward


def mask_documents(model: nn.Module) -> None:
    """Each Gated DeltaNet layer of `model` restarts its convolution and recurrent state at document starts, which
    it reads from the `position_ids` its decoder layer gets (restarting per document under document masking,
    models/documents.py): a pre-hook hands them to the layer's kernels as `document_positions`."""
    from disttrain.models.hf.linear_documents import causal_conv, chunk_gated_delta_rule

    def pass_positions(layer, args, kwargs):
        return args, {**kwargs, POSITIONS: kwargs["position_ids"]}

    for module in layers(model):
        replace(module, causal_conv, chunk_gated_delta_rule)
    for holder in model.modules():  # the decoder layer holding one
        if any(_is_layer(child) for child in holder.children()):
            holder.register_forward_pre_hook(pass_positions, with_kwargs=True)
