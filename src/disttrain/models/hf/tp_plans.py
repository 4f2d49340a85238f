"""Tensor-parallel plans per block for the transformers families, in transformers' style names: the model's own
`base_model_tp_plan` where disttrain takes it as written, completed or replaced where it does not.

- Fused routed experts (`mlp.experts`: transformers' `packed_colwise` gate_up_proj, `rowwise` down_proj,
  `moe_tp_experts`) stay whole on every tensor-parallel rank (GLM-4-MoE, DeepSeek-V3, gpt-oss, Qwen3-Next). Each
  rank routes the same tokens (the MoE block's input is replicated: gathered from the sequence shards under
  sequence parallelism) through the same experts, so the outputs are one process's, and the gradient reaching
  the block's output is the whole one on every rank (the attention and dense MLPs of the next layer all-reduce
  theirs), so each rank's expert gradients are one process's too, with nothing to reduce. Splitting them along their intermediate
  dimension would divide their memory, but transformers' grouped `gate_up_proj` holds a gate half and an up half
  that must each be split (two blocks per rank, which no DTensor placement describes: gpt-oss's interleaved
  columns would split contiguously), and every routed row's output would then be a partial sum to all-reduce,
  with the down-projection's bias added once; the expert dispatch (models/hf/moe.py) does neither yet. Expert
  parallelism (`parallel.ep`) is the way to split experts.
- The router stays whole (its weights and gradients are the same on every rank, as above).
- DeepSeek-V3's multi-head latent attention (transformers' plan leaves it out): the low-rank latents
  (`q_a_proj`, `kv_a_proj_with_mqa` and their norms) stay whole, `q_b_proj` / `kv_b_proj` (or `q_proj` without
  a query latent) split the heads (`colwise`), `o_proj` joins them (`rowwise`). The rotary key, the last
  `qk_rope_head_dim` columns of `kv_a_proj_with_mqa`, is shared by every head: its gradient is summed over the
  ranks' heads (`rotary_key_of_all_heads`, tp_heads.SharedByAllHeads).
- gpt-oss (no plan in transformers): queries, keys, values by heads, `o_proj` rowwise, and the attention sinks
  (one logit per head) split with their heads (`hand_written`).
- Qwen3-Next and Qwen3.5's Gated DeltaNet layers split by heads (tp_linear_attention.py; transformers' plan
  gathers their projections' outputs instead, `colwise_gather_output`). Qwen3-Next's experts as above.
- GLM-4-MoE's query/key norms (`use_qk_norm`) act on each head alone: replicated with their gradients summed over
  the ranks' heads, as Qwen3's.
"""

from __future__ import annotations

# families whose fused experts are kept whole on every tensor-parallel rank (tests/test_hf_families.py proves each)
REPLICATED_EXPERTS = ("glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "gemma4_text")

ATTENTION = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise"}
QK_NORMS = {"self_attn.q_norm": "replicated_with_grad_allreduce",
            "self_attn.k_norm": "replicated_with_grad_allreduce"}
LATENT_ATTENTION = {"self_attn.q_proj": "colwise", "self_attn.q_b_proj": "colwise", "self_attn.kv_b_proj": "colwise",
                    "self_attn.o_proj": "rowwise", "self_attn.kv_a_proj_with_mqa": "rotary_key_of_all_heads"}

# linear layers whose output or gradient tensor parallelism changes with hooks of its own (DeepSeek-V3's shared
# rotary key, Qwen3.5's rows of this rank's heads): a LoRA adapter on them would not follow (models/lora.py)
HAND_SPLIT_LINEARS = ("kv_a_proj_with_mqa", "in_proj_qkv")

# Gated DeltaNet (Qwen3-Next, Qwen3.5): transformers' `colwise_gather_output` entries replaced by a split of the
# heads (its projections here, the rest in tp_linear_attention.py)
LINEAR_ATTENTION = {"linear_attn.in_proj_qkvz": "colwise", "linear_attn.in_proj_ba": "colwise",
                    "linear_attn.in_proj_z": "colwise", "linear_attn.in_proj_b": "colwise",
                    "linear_attn.in_proj_a": "colwise", "linear_attn.out_proj": "rowwise",
                    "linear_attn.norm": "replicated_with_grad_allreduce"}
# replicated linear layers of a block acting on each position alone (Gemma 4's per-layer input gate and projection):
# under sequence parallelism they run on this rank's slice like the norms, their gradients summed over the ranks
SEQUENCE_WISE = ("per_layer_input_gate", "per_layer_projection")
# Gemma 4's MoE branch sits on the decoder layer and takes its hidden states flattened to tokens; under sequence
# parallelism it runs every token on every rank, as an MoE block does (the other families' `_moe` blocks): the
# router and the norm before the experts gather this rank's tokens ("in"), the experts keep this rank's rows of
# their output ("out"); routing, statistics and gradients are then one process's on every rank
TOKEN_WISE = {"router": "in", "pre_feedforward_layernorm_2": "in", "experts": "out"}
# how many outputs a family's MoE block returns (gpt-oss's MLP also returns its router scores)
MOE_OUTPUTS = {"gpt_oss": 2}


def _routed_experts(key: str) -> bool:
    return "experts" in key.split(".")


def block_entries(config) -> dict[str, str]:
    """{path inside a block: transformers' style name}; empty when the model has no plan."""
    kind = config.model_type
    own = dict(getattr(type(config), "base_model_tp_plan", None) or {})
    if kind == "gpt_oss":
        own = {f"layers.*.{k}": v for k, v in ATTENTION.items()}
    if kind == "deepseek_v3":
        own.update({f"layers.*.{k}": v for k, v in LATENT_ATTENTION.items()})
    if kind == "glm4_moe" and getattr(config, "use_qk_norm", False):
        own.update({f"layers.*.{k}": v for k, v in QK_NORMS.items()})
    if kind in ("qwen3_next", "qwen3_5_text"):
        own = {k: v for k, v in own.items() if ".linear_attn." not in k}
        own.update({f"layers.*.{k}": v for k, v in LINEAR_ATTENTION.items()})
    if kind in REPLICATED_EXPERTS:
        own = {k: v for k, v in own.items() if not _routed_experts(k)}
    return own


def own_styles(config) -> dict:
    """Styles of disttrain's own plan entries that need the config: {name: factory}."""
    from disttrain.models.hf.tp_heads import SharedByAllHeads

    width = getattr(config, "qk_rope_head_dim", 0)
    return {"rotary_key_of_all_heads": lambda: SharedByAllHeads(width)} if width else {}


def hand_written(config) -> list:
    """[(module path in a block, function(module, tp_mesh))]: what each family needs beyond torch's styles, for the
    blocks that have that module."""
    from disttrain.models.hf.tp_heads import shard_with_heads
    from disttrain.models.hf.tp_linear_attention import split_gated_delta_net

    kind = config.model_type
    if kind == "gpt_oss":  # the attention sinks, one logit per head
        return [("self_attn", lambda module, mesh: shard_with_heads(module, "sinks", mesh))]
    if kind in ("qwen3_next", "qwen3_5_text"):
        return [("linear_attn", split_gated_delta_net)]
    return []
