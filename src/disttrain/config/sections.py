"""The config's sections, every key with its type, default, bounds and description. docs/config.md is generated
from these descriptions (`python -m disttrain.config.reference`); a test fails when a key has none or the page
is stale. Cross-section rules are checks.py's and the rule list's (resolve.py). No torch here."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from disttrain.layout.layout import LOSS_CHUNK_TOKENS

PARALLELISM_DOC = "docs/parallelism.md"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


def dotted(section, key: str):
    """`dotted(model, "moe.num_experts")`: a key's value under a section."""
    for part in key.split("."):
        section = getattr(section, part)
    return section


def show(value) -> str:
    """A value as a user writes it on the command line (`true`, not `True`)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "max_seq_len",
              "tie_embeddings", "norm_eps", "rope_theta")
FROM_NAME = "from model.name (a shape override; refused with model.hf or model.spec)"


class LoraConfig(Section):
    """LoRA adapters on a frozen base (models/lora.py); the section's presence switches them on."""

    rank: int = Field(8, gt=0, description="rank r of each adapter pair lora_A (r x in), lora_B (out x r)")
    alpha: float = Field(16.0, gt=0, description="the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    targets: list[str] = Field(default_factory=list, description="module-name patterns: a name (q_proj) or a glob "
                               "on the full name (model.layers.0.*); empty: every linear layer of the repeated "
                               "blocks (attention and MLP projections)")


class MoEConfig(Section):
    """Mixture of experts: shape keys (transformers' names) over the registry's, and how the router trains."""

    num_experts: int | None = Field(None, gt=0, description="routed experts per MoE layer (on a dense shape, this "
                                    "and the next two keys make it an MoE)")
    num_experts_per_tok: int | None = Field(None, gt=0, description="top-k experts each token runs through "
                                            "(at most num_experts)")
    moe_intermediate_size: int | None = Field(None, gt=0, description="each expert's SwiGLU width")
    n_shared_experts: int | None = Field(None, ge=0, description="experts every token runs through")
    first_k_dense_replace: int | None = Field(None, ge=0, description="leading blocks that keep a dense MLP")
    scoring_func: Literal["softmax", "sigmoid"] | None = Field(None, description="router scores: softmax top-k, or "
                                                               "sigmoid with the top-k weights renormalised "
                                                               "(DeepSeek-V3)")
    aux_loss_coef: float | None = Field(None, ge=0, description="switch-style balancing loss over the global batch "
                                        "(0: off; unset: a Hugging Face MoE model's own router_aux_loss_coef, "
                                        "0.001 for a built-in one, 0 under fp16 compute or when the bias below "
                                        "is given)")
    bias_update_rate: float | None = Field(None, ge=0, description="aux-loss-free balancing (DeepSeek-V3's; 0.001 "
                                           "is its rate): a per-expert bias used only to choose experts, moved after "
                                           "each optimizer step from the global batch's token counts (0 or unset: "
                                           "off)")
    capacity_factor: float = Field(0.0, ge=0, description="0: dropless; at least 1: each expert takes at most this "
                                   "many times its even share of a micro-batch's tokens, the rest are dropped and "
                                   "counted")

    @model_validator(mode="after")
    def _capacity(self) -> "MoEConfig":
        if 0 < self.capacity_factor < 1:
            raise ValueError(f"model.moe.capacity_factor={self.capacity_factor}: below 1 drops tokens even when "
                             "the experts are perfectly balanced (allowed: 0 for dropless, or at least 1)")
        return self


MOE_SHAPE_KEYS = tuple(MoEConfig.model_fields)[:6]  # the MoEShape's; the rest say how the router trains


class ModelConfig(Section):
    """What trains: a registry shape, a Hugging Face directory, or your own ModelSpec."""

    name: str = Field("debug", description="registry shape: debug, tiny, 125m, 1b, 7b, 13b, 70b; mixture-of-experts "
                      "shapes debug-moe, mixtral-8x7b, qwen3-30b-a3b, qwen3-235b-a22b; published models "
                      "transformers builds gpt-oss-20b, gpt-oss-120b, deepseek-v3, qwen3-next-80b-a3b")
    hf: str = Field("", description="a Hugging Face model: a local directory (config.json, optional weights and "
                                    "tokenizer) or a Hub id (org/name, org/name@revision) read from huggingface_hub's "
                                    "cache and downloaded into it when online (HF_HUB_OFFLINE=1: the cache only); "
                                    "replaces name and the shape keys; without weights it is initialised from "
                                    "train.seed")
    spec: str = Field("", description="FILE.py:function or package.module:function returning a ModelSpec for any "
                      "nn.Module (docs/guide.md, \"Your own model\")")
    dim: int | None = Field(None, gt=0, description="hidden size; " + FROM_NAME)
    n_layers: int | None = Field(None, gt=0, description="repeated blocks; " + FROM_NAME)
    n_heads: int | None = Field(None, gt=0, description="attention heads; " + FROM_NAME)
    n_kv_heads: int | None = Field(None, gt=0, description="key/value heads (fewer than n_heads: grouped-query "
                                   "attention); " + FROM_NAME)
    vocab_size: int | None = Field(None, gt=0, description="vocabulary (at least the tokenizer's); " + FROM_NAME)
    ffn_hidden_dim: int | None = Field(None, gt=0, description="SwiGLU width of a dense MLP; " + FROM_NAME)
    max_seq_len: int | None = Field(None, gt=0, description="longest sequence (at least data.seq_len); " + FROM_NAME)
    tie_embeddings: bool | None = Field(None, description="the output layer shares the embedding matrix; " + FROM_NAME)
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon; " + FROM_NAME)
    rope_theta: float | None = Field(None, gt=0, description="rotary embedding base; " + FROM_NAME)
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention"] = Field(
        "auto", description="model.hf's attention kernel: auto (PyTorch's sdpa where the model supports it, eager "
        "where it needs what sdpa cannot do: gpt-oss's attention sinks, attention-logit soft-capping), or "
        "transformers' sdpa, eager, flex_attention; the choice is recorded in the run's started event")
    init_from: str = Field("", description="weights written by `disttrain convert` (torch, safetensors or hf) to "
                           "start from (empty: random initialisation)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on the frozen model (model.lora.rank=8); "
                                    "unset: full training. Needs the lora extra (peft)")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="mixture-of-experts shape and routing "
                           f"({PARALLELISM_DOC}, expert parallelism)")

    @model_validator(mode="after")
    def _init_exists(self) -> "ModelConfig":
        if self.hf and self.spec:
            raise ValueError(f"model.hf={self.hf} and model.spec={self.spec}: give one of them")
        source = ("model.hf", self.hf, "the directory's config.json") if self.hf else \
            ("model.spec", self.spec, "the ModelSpec") if self.spec else None
        given = [k for k in SHAPE_KEYS if getattr(self, k) is not None]
        given += [f"moe.{k}" for k in MOE_SHAPE_KEYS if getattr(self.moe, k) is not None]
        if source and given:
            raise ValueError(f"model.{given[0]}={show(dotted(self, given[0]))} with {source[0]}={source[1]}: the "
                             f"shape comes from {source[2]} (allowed with {source[0]}: no shape keys)")
        if self.attn_implementation != "auto" and not self.hf:
            raise ValueError(f"model.attn_implementation={self.attn_implementation} without model.hf: the built-in "
                             "and user models choose their own attention (allowed without model.hf: auto)")
        if self.init_from and not Path(self.init_from).exists():
            raise ValueError(f"model.init_from={self.init_from}: no such file or directory (allowed: empty, or "
                             "a file or folder written by `disttrain convert`)")
        return self


class DataConfig(Section):
    """What it trains on."""

    source: str | dict[str, float] = Field("builtin", description="builtin (Python's own documentation, made at run "
                                           "time), a directory written by `disttrain prepare-data` (local or an "
                                           "object-store URL), py:FILE.py:function returning a map-style Dataset of "
                                           "(input, target) pairs, or a weighted mixture {DIR: weight, ...}")
    document_masking: bool = Field(False, description="attention stops at end-of-document tokens and positions "
                                   "restart per document (built-in and Hugging Face models; parallel.pp=1)")
    tokenizer: str = Field("auto", description="for builtin: byte (256 ids), a tokenizer.json, or auto (model.hf's "
                           "tokenizer.json if it has one, else byte); a shard directory carries its own")
    seq_len: int = Field(128, gt=0, description="tokens per sequence (at most model.max_seq_len)")
    prefetch: bool | None = Field(None, description="read the next step's batches on a background thread (the "
                                  "batches are the same either way); empty: on with a GPU, off on CPU")
    packing: bool = Field(False, description="chat data: several conversations per sequence (first-fit), with "
                          "document masking (preference pairs: each micro-batch's sequences); false: one "
                          "conversation per sequence, padded")
    padding: Literal["longest", "seq_len", "none"] = Field("longest", description="chat, instruction and preference "
                                                           "data without packing: each micro-batch padded to its "
                                                           "longest sequence (rounded up to data.pad_to_multiple_of), "
                                                           "every sequence to data.seq_len, or none: each "
                                                           "micro-batch's sequences laid end to end in as few rows "
                                                           "of data.seq_len as hold them, kept apart by document "
                                                           "masking (padding-free); all three give the same losses "
                                                           "and gradients; pipeline parallelism keeps data.seq_len")
    pad_to_multiple_of: int = Field(8, gt=0, description="with data.padding=longest: micro-batch widths are "
                                    "multiples of this (and of what sequence or context parallelism splits)")
    cache_dir: str = Field("", description="data.source on an object store: keep the byte ranges read in this local "
                           "directory (fsspec's block cache); empty: read them from the store each time")

    @model_validator(mode="after")
    def _packing_masks_documents(self) -> "DataConfig":
        """Packed conversations must not attend across each other: packing (and padding-free micro-batches, which
        pack each micro-batch alone) switches document masking on."""
        packs = "data.packing=true" if self.packing else "data.padding=none" if self.padding == "none" else ""
        if packs and not self.document_masking:
            if "document_masking" in self.model_fields_set:
                raise ValueError(f"{packs} with data.document_masking=false: packed conversations would attend to "
                                 f"each other (allowed with {packs}: document_masking=true)")
            object.__setattr__(self, "document_masking", True)
        return self


class TrainConfig(Section):
    """How long, on how much, from which seed."""

    steps: int = Field(100, gt=0, description="optimizer steps")
    global_batch_size: int = Field(8, gt=0, description="sequences per optimizer step, over all data-parallel ranks")
    micro_batch_size: int = Field(0, ge=0, description="sequences per forward pass per rank; 0: the whole per-rank "
                                  "batch (gradient accumulation = global / (dp x micro))")
    loss_chunk_tokens: int = Field(LOSS_CHUNK_TOKENS, ge=0, description="the output head and the cross-entropy "
                                   "run in chunks of this many tokens, so that a micro-batch's whole logits never "
                                   "exist (0: whole logits, as the model computes them)")
    objective: Literal["lm", "dpo", "simpo", "orpo", "distill"] = Field(
        "lm", description="lm: next-token cross-entropy on the valid targets; dpo, simpo, orpo: preference "
        "optimisation on prepared pairs (the dpo section; batch sizes then count pairs); distill: knowledge "
        "distillation from a teacher model (the distill section)")
    seed: int = Field(0, ge=0, description="fixes the initialisation and the data order")
    eval_every: int = Field(0, ge=0, description="validation every N steps (0: off)")
    eval_batches: int = Field(4, gt=0, description="global batches per validation")
    sample_tokens: int = Field(0, ge=0, description="tokens generated from the final model (0: off)")
    sample_prompt: str = Field("The ", description="the prompt of that sample (chat data: a user turn)")
    sample_temperature: float = Field(0.8, ge=0, description="sampling temperature of that sample (0: greedy, the "
                                      "most likely token each time)")
    sample_top_k: int = Field(40, ge=0, description="that sample draws from the k most likely tokens (0: from all)")
    callbacks: list[str] = Field(default_factory=list, description="your own jobs of the loop: FILE.py:Name or "
                                 "package.module:Name, each called with no arguments to make an object with "
                                 "due(step) and run(trainer) (docs/guide.md, \"Your own jobs\")")


class PreferenceConfig(Section):
    """Preference optimisation (train.objective=dpo, simpo or orpo), with TRL's meanings."""

    beta: float = Field(0.1, gt=0, description="dpo: the strength of the reference's pull (reward = beta x the "
                        "log-ratio to the reference); simpo: the scale of the length-normalised log-probabilities")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="dpo: sigmoid (the DPO paper's), ipo (squared, on log-ratios averaged over each "
        "completion's tokens) or hinge")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo sigmoid: the assumed share of pairs whose "
                                   "labels are flipped (conservative DPO)")
    gamma: float = Field(0.5, ge=0, description="simpo: the target margin between chosen and rejected rewards")
    lambda_: float = Field(0.1, ge=0, alias="lambda", description="orpo: the weight of the odds-ratio term beside "
                           "the chosen completions' cross-entropy")
    precompute_reference: bool = Field(
        False, description="dpo: the reference's log-probabilities of every pair computed once, by the starting "
        "model before the first step, and kept beside the run's checkpoints (reference_logps.pt): no reference "
        "model and no reference forward while training")


class DistillConfig(Section):
    """Knowledge distillation (train.objective=distill): the student learns the teacher's next-token distribution."""

    teacher: str = Field("", description="the teacher: a Hugging Face model directory or Hub id with weights, or "
                         "a disttrain run directory (its newest committed checkpoint; LoRA adapters folded in), "
                         "sharing the student's tokenizer and vocabulary")
    temperature: float = Field(1.0, gt=0, description="both distributions are softened by it; the divergence is "
                               "scaled by its square, so that its gradients keep their size")
    alpha: float = Field(0.5, ge=0, le=1, description="the divergence's weight; the usual cross-entropy on the "
                         "targets takes 1 - alpha")
    kl: Literal["forward", "reverse"] = Field("forward", description="forward: KL(teacher || student), which "
                                              "covers every mode of the teacher; reverse: KL(student || teacher), "
                                              "which seeks its main mode")


class MuonConfig(Section):
    """Muon's settings (optim.name=muon), with torch.optim.Muon's meaning."""

    lr: float | None = Field(None, gt=0, description="Muon's peak learning rate (default: optim.lr)")
    momentum: float = Field(0.95, ge=0, lt=1, description="momentum of the gradient average Muon orthogonalises")
    nesterov: bool = Field(True, description="Nesterov momentum")
    ns_steps: int = Field(5, ge=1, lt=100, description="Newton-Schulz iterations per step")
    weight_decay: float | None = Field(None, ge=0, description="decoupled weight decay of Muon's matrices "
                                       "(default: optim.weight_decay)")
    adjust_lr: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw", description="how each matrix's rate is scaled by its shape: match_rms_adamw (0.2 x "
        "sqrt(max(rows, cols)), so that one rate serves Muon and AdamW) or original (sqrt(max(1, rows / cols)))")


class OptimConfig(Section):
    """The optimizer and its learning-rate schedule."""

    name: Literal["adamw", "muon"] = Field("adamw", description="adamw: AdamW everywhere, weight decay on matrices "
                                           "only; muon: Muon for the matrices of the repeated blocks (attention, "
                                           "MLP and expert projections), AdamW with the keys below for the rest "
                                           "(embeddings, output head, norms, biases, routers)")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay of the matrices")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam's moment decay rates, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, description="Adam's epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="after warmup: cosine or linear decay to min_lr over the rest of the run, constant, or "
        "wsd (warmup-stable-decay: constant, then decay_shape down to min_lr over the last decay_steps)")
    decay_steps: int | None = Field(None, gt=0, description="wsd: steps of the final decay (default: decay_fraction "
                                    "of train.steps)")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the final decay's share of train.steps when "
                                  "decay_steps is unset")
    decay_shape: Literal["linear", "cosine", "sqrt"] = Field("linear", description="wsd: the final decay's shape "
                                                             "(sqrt: 1 - sqrt(progress))")
    min_lr: float = Field(0.0, ge=0, description="final learning rate")
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm over every parameter (0: off; the "
                             "norm is still logged)")
    state_dtype: Literal["fp32", "bf16", "int8"] = Field(
        "fp32", description="dtype the optimizer keeps its moments in (AdamW's two, Muon's momentum): bf16 halves "
        "their memory, each update still computed in the parameters' dtype; int8: AdamW's moments in 8 bits with a "
        "scale per 256 values (torchao's AdamW8bit, the float8 extra; not Muon, ZeRO-1, expert parallel or fp64)")
    muon: MuonConfig = Field(default_factory=MuonConfig, description="Muon's settings (optim.name=muon)")
