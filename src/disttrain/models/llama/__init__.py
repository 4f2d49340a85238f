"""The built-in Llama-style decoder as a ModelSpec. Its module names appear nowhere else."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from functools import partial

from disttrain.models.shape import ModelShape


def llama_spec(shape: ModelShape):
    from disttrain.models.llama import hf_names, parallel_plan
    from disttrain.models.llama.init import init_weights
    from disttrain.models.llama.model import Transformer, mask_documents
    from disttrain.models.spec import ModelSpec

    if shape.moe is not None:
        raise ValueError("an MoE shape is the MoE family's (models.moe.moe_spec; models.registry.model_spec picks it)")
    tied = (("tok_embeddings.weight", "output.weight"),) if shape.tie_embeddings else ()
    return ModelSpec(
        name="llama", build=partial(Transformer, shape), init_weights=init_weights, blocks=lambda m: m.layers,
        shape=shape, max_seq_len=shape.max_seq_len, tensor_parallel=parallel_plan.tensor_parallel,
        pipeline_split=parallel_plan.pipeline_split, tied_parameters=tied, mask_documents=mask_documents,
        causal=True, context_parallel=parallel_plan.context_parallel,
        to_hf=partial(hf_names.to_hf, shape=shape), from_hf=hf_names.from_hf,
        hf_config=partial(hf_names.hf_config, shape), fingerprint=shape_fingerprint(shape),
        output_head=lambda m: m.output)


def shape_fingerprint(shape: ModelShape) -> str:
    # how to count, not what is trained; `extras` (the newer families' additions) never set for the built-in models
    dims = {k: v for k, v in asdict(shape).items() if k not in ("rotary_tables", "norm_kind", "extras")}
    return hashlib.sha256(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:16]
