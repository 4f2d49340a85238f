"""The dimensions of a decoder-only transformer: what the planner, FLOP counts and layout rules
need to know about a model, in pure Python (no torch), whatever family it comes from."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts part of a decoder: blocks whose MLP is a router over SwiGLU experts.
    Field names follow transformers' MoE configs (Qwen3-MoE, DeepSeek-V3) so that an HF config maps one to one."""
    num_experts: int
    num_experts_per_tok: int  # top-k experts each token runs through
    moe_intermediate_size: int  # each expert's SwiGLU width
    n_shared_experts: int = 0  # experts every token runs through, each moe_intermediate_size wide
    first_k_dense_replace: int = 0  # leading blocks that keep a dense MLP of ffn_hidden_dim
    scoring_func: str = "softmax"  # router scores: "softmax", or "sigmoid" with the top-k renormalised (DeepSeek-V3)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def layer_params(self, dim: int, active: bool = False) -> int:
        """One MoE layer's MLP parameters: the router, the routed experts (all, or the top-k a token uses when
        `active`) and the shared experts."""
        experts = self.num_experts_per_tok if active else self.num_experts
        return dim * self.num_experts + (experts + self.n_shared_experts) * 3 * dim * self.moe_intermediate_size


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank
    latents with their own RMSNorms; each head's query/key is a no-position part and a rotary part, values
    have their own width. Names follow transformers' DeepseekV3Config."""
    kv_lora_rank: int
    q_lora_rank: int  # 0: queries projected from the hidden state directly (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, dim: int, n_heads: int) -> int:
        """q_a, its norm and q_b (or one q projection); kv_a with the shared rotary key, its norm, kv_b; o."""
        q_out = n_heads * self.qk_head_dim
        q = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else dim * q_out
        kv = (dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + n_heads * self.v_head_dim * dim


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): a recurrent (key x value) state per value head instead of
    attention over the sequence. Names follow transformers' Qwen3NextConfig (`linear_*`)."""
    layers: int  # how many of the blocks attend this way (the rest are full attention)
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def params(self, dim: int) -> int:
        """q/k/v/z and b/a projections, the causal convolution over q/k/v, dt_bias and A_log, the gated norm and
        the output projection of one layer."""
        qk, v = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        return (dim * (2 * qk + 2 * v) + dim * 2 * self.num_value_heads + (2 * qk + v) * self.conv_kernel
                + 2 * self.num_value_heads + self.value_head_dim + v * dim)

    def flops_per_token(self, chunk: int = 64) -> float:
        """Forward and backward (3x) of the chunked gated delta rule per layer (transformers' torch implementation,
        chunks of 64 tokens), per value head: against the state, reading it with the decayed keys and with the
        queries and the delta update's outer product (2·dk·dv each); within the chunk, the keys' and the queries'
        products with the chunk's keys (2·C·dk each), the triangular solve for the corrected values and decayed
        keys (C·(dk + dv)), and the intra-chunk attention over the corrected values (2·C·dv)."""
        dk, dv = self.key_head_dim, self.value_head_dim
        per_head = 6 * dk * dv + 4 * chunk * dk + chunk * (dk + dv) + 2 * chunk * dv
        return 3 * per_head * self.num_value_heads


@dataclass(frozen=True)
class BlockExtras:
    """What transformers' newer families add to the Llama-style block, for the planner's counts: None on the
    built-in models (so their fingerprints stay as they were)."""
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3, Gemma 3): 2·head_dim a layer
    o_bias: bool = False  # a bias on the output projection (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head (gpt-oss)
    attn_output_gate: bool = False  # the query projection also gives a per-head output gate (Qwen3-Next, 3.5)
    norms_per_block: int = 2  # Gemma 2/3: 4 (before and after attention and MLP)
    sliding_window: int = 0  # the window of the layers that attend locally
    sliding_layers: int = 0  # how many layers do
    linear: LinearAttentionShape | None = None
    expert_bias: bool = False  # biases on each expert's projections (gpt-oss)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE, Qwen3-Next)
    per_layer_input: int = 0  # Gemma 4: width of each layer's own input embedding (0: none)
    per_layer_vocab: int = 0  # ... and the vocabulary of that embedding table
    kv_shared_layers: int = 0  # Gemma 4: layers reusing an earlier layer's keys and values (no k/v projections, k norm)
    dense_mlp_beside_experts: bool = False  # Gemma 4: an MoE layer keeps its dense MLP, 3 more norms, a router scale
    layer_types: tuple[str, ...] = ()  # Gemma 4: each layer's attention kind (which store and reuse keys and values)
    global_head_dim: int = 0  # Gemma 4: the full-attention layers' head size (0: the model's)
    global_kv_heads: int = 0  # ... their key-value heads (0: the model's)
    global_values_from_keys: bool = False  # ... their values are their keys' projection (no value projection)

    @property
    def own_global_attention(self) -> bool:
        """Whether the full-attention layers' attention differs from the model's (Gemma 4's `per_layer_config`)."""
        return bool(self.global_head_dim or self.global_kv_heads or self.global_values_from_keys)

    def per_layer_params(self, dim: int, layers: int, include_embedding: bool) -> int:
        """Gemma 4's per-layer inputs: the table (an embedding), the projection of the hidden state onto every
        layer's input and its norm, and in each layer a gate, a projection back and a norm."""
        width = self.per_layer_input
        if not width:
            return 0
        table = self.per_layer_vocab * layers * width if include_embedding else 0
        return table + dim * layers * width + width + layers * (2 * dim * width + dim)


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    max_seq_len: int
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)
    head_size: int = 0  # 0: dim / n_heads; set when a family decouples the two (Qwen3, Gemma)
    moe: MoEShape | None = None  # None: every block has a dense SwiGLU MLP
    mla: MLAShape | None = None  # None: grouped-query attention of n_heads / n_kv_heads x head_dim
    # Precomputed cos/sin buffers, as the built-in models hold (transformers' compute theirs per forward); the
    # planner's to count, not the model's identity (models/llama shape_fingerprint leaves it out).
    rotary_tables: bool = True
    # Which RMSNorm the model runs, for what its backward keeps (plan/norms.py); the planner's to count, like
    # `rotary_tables`: "fused" (one kernel), "module" (transformers' Llama-style module: the input upcast to fp32 and
    # the normalised tensor cast back, both kept) or "fp32_product" (the weight multiplied into the fp32 normalised
    # tensor, which is kept: gpt-oss's)
    norm_kind: str = "fused"
    extras: BlockExtras | None = None  # None: the Llama-style block (the built-in models)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def linear_layers(self) -> int:
        return self.extras.linear.layers if self.extras and self.extras.linear else 0

    def is_global(self, layer: int | None) -> bool:
        """Whether `layer` is one of Gemma 4's full-attention layers with their own attention shape."""
        x = self.extras
        return layer is not None and x is not None and x.own_global_attention and bool(x.layer_types) and \
            x.layer_types[layer] == "full_attention"

    def at_layer(self, layer: int | None) -> ModelShape:
        """The shape `layer`'s attention has: Gemma 4's full-attention layers take their own head size and key-value
        heads (transformers' `per_layer_config`); every other layer the model's."""
        if not self.is_global(layer):
            return self
        x = self.extras
        return replace(self, head_size=x.global_head_dim or self.head_dim,
                       n_kv_heads=x.global_kv_heads or self.n_kv_heads)

    def key_value_projections(self, layer: int | None = None) -> int:
        """2, or 1 where a layer's values are its keys' projection (Gemma 4's full-attention layers may be)."""
        return 1 if self.is_global(layer) and self.extras.global_values_from_keys else 2

    def attention_params(self, layer: int | None = None) -> int:
        """One full-attention block's attention projections (and their biases, norms, sinks; MLA: its latent
        norms too); `layer`'s where layers differ (Gemma 4's full-attention ones)."""
        if self.mla is not None:
            return self.mla.params(self.dim, self.n_heads)
        s, kvs = self.at_layer(layer), self.key_value_projections(layer)
        x = self.extras or BlockExtras()
        q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        q_out = 2 * q_dim if x.attn_output_gate else q_dim
        return (self.dim * (q_out + q_dim) + self.dim * kv_dim * kvs + (q_dim + kvs * kv_dim if self.qkv_bias else 0)
                + (self.dim if x.o_bias else 0) + (self.n_heads if x.attention_sinks else 0)
                + (2 * s.head_dim if x.qk_norm else 0))

    def _key_value_params(self, layer: int | None = None) -> int:
        """A full-attention layer's key and value projections (with biases) and key norm."""
        s, kvs = self.at_layer(layer), self.key_value_projections(layer)
        kv_dim = s.n_kv_heads * s.head_dim
        return kvs * self.dim * kv_dim + (kvs * kv_dim if self.qkv_bias else 0) + \
            (s.head_dim if self.extras.qk_norm else 0)

    def _moe_extras(self, active: bool) -> int:
        """gpt-oss's expert and router biases, a shared-expert gate: one MoE layer's parameters beyond MoEShape's."""
        x, moe = self.extras, self.moe
        if x is None:
            return 0
        experts = moe.num_experts_per_tok if active else moe.num_experts
        beside = 3 * self.dim * self.ffn_hidden_dim + 4 * self.dim + moe.num_experts  # MLP, norms, router scales
        return ((experts * (2 * moe.moe_intermediate_size + self.dim) if x.expert_bias else 0)
                + (moe.num_experts if x.router_bias else 0) + (self.dim if x.shared_expert_gate else 0)
                + (beside if x.dense_mlp_beside_experts else 0))

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Exact parameter count of a Llama-style decoder (SwiGLU MLP, GQA, RMSNorm, no biases) and of the
        families `extras` describes. With `active`, an MoE model's count holds only the experts one token runs
        through (what its FLOPs per token follow)."""
        linear = self.extras.linear if self.extras and self.extras.linear else None
        mixers = sum(self.attention_params(i) for i in range(self.n_layers - self.linear_layers)) + \
            (linear.params(self.dim) * linear.layers if linear else 0)
        dense_mlp = 3 * self.dim * self.ffn_hidden_dim
        mlps = sum(self.moe.layer_params(self.dim, active) + self._moe_extras(active)
                   if self.moe and self.moe.is_moe_layer(layer) else dense_mlp for layer in range(self.n_layers))
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        norms = (self.extras.norms_per_block if self.extras else 2) * self.dim
        total = mixers + self.n_layers * norms + mlps + self.dim + output
        if self.extras:
            total += self.extras.per_layer_params(self.dim, self.n_layers, include_embedding)
            total -= sum(self._key_value_params(i) for i in range(self.n_layers - self.extras.kv_shared_layers,
                                                                 self.n_layers))
        return total + (embedding if include_embedding else 0)

