"""ModelSpec: everything the framework needs to know about one model family, in one object.

The trainer, `parallel/parallelize.py`, the pipeline builder, checkpoints and export ask the spec;
none of them names a model's modules. A family (models/llama/, later models/hf/ or user code
through `model.spec=FILE.py:function`) returns one of these.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.core.dtypes import at_least_fp32
from disttrain.models.shape import ModelShape

IGNORE_INDEX = -100  # PyTorch's and transformers' ignore index: padding, prompt tokens in fine-tuning


def token_cross_entropy_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses of a micro-batch over its valid targets (targets equal to IGNORE_INDEX carry
    none); normalising is the step engine's job, in one place (train/loss.py)."""
    return F.cross_entropy(at_least_fp32(outputs).flatten(0, -2), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    """The single-device module; called under `torch.device("meta")`, then materialised."""
    init_weights: Callable[[nn.Module, int], None]
    """Fill every parameter and buffer of a materialised model from a seed, the same whatever the
    layout (e.g. one generator per parameter name); re-tie shared parameters (to_empty unties)."""
    blocks: Callable[[nn.Module], nn.Module]
    """The container (ModuleDict or ModuleList) of repeated blocks: FSDP, activation-checkpoint and
    compile units. Works on a pipeline stage too."""
    shape: ModelShape | None = None
    """Decoder dimensions (parameter count, FLOPs, layout rules, planner); None if unknown."""
    max_seq_len: int = 0
    loss_sum: Callable[[object, torch.Tensor], torch.Tensor] = token_cross_entropy_sum
    """Token-loss sum of a micro-batch from the module's output and the targets."""
    logits: Callable[[object], torch.Tensor] = lambda out: out
    """The next-token logits in the module's output (for sampling); with a chunked loss head, what the head
    returned in their place: the micro-batch's loss sum (models/output_head.py)."""
    output_head: Callable[[nn.Module], nn.Module | None] | None = None
    """The projection from hidden states to the vocabulary (an nn.Linear without bias), which then computes
    the loss in chunks of tokens (`train.loss_chunk_tokens`); None: the loss takes the whole logits."""
    output_head_note: str = ""
    """Why a family without `output_head` takes the whole logits (said in the run's start line)."""
    tensor_parallel: Callable[[nn.Module, object, bool], None] | None = None
    """Apply the TP (and sequence-parallel) plan in place to a model or a pipeline stage."""
    tensor_parallel_note: str = ""
    """Why a family without `tensor_parallel` has none (said when parallel.tp > 1 is refused)."""
    sequence_parallel: bool = True
    """Whether `tensor_parallel` also implements sequence parallelism."""
    pipeline_split: Callable[[nn.Module, list[range], list[int]], list[nn.Module]] | None = None
    """Prune the model to the stages this rank owns and return one module per owned stage; the
    parameters keep their names in the pruned model."""
    pipeline_note: str = ""
    """Why a family without `pipeline_split` cannot be split (said when parallel.pp > 1 is refused)."""
    sync_batchnorm: bool = False
    """Normalise BatchNorm layers over the whole data-parallel batch (SyncBatchNorm) when dp > 1."""
    tied_parameters: tuple[tuple[str, ...], ...] = ()
    """Groups of parameter names that are one tensor (e.g. input embedding and output layer)."""
    mask_documents: Callable[[nn.Module, int], None] | None = None
    """Make the whole (unsplit) module stop attention at an end-of-document id and restart positions
    after it (`data.document_masking`); None: the family cannot."""
    mask_documents_note: str = ""
    """Why the family cannot mask documents, where it has a reason beyond not implementing it."""
    causal: bool = False
    """The output at a position depends on the tokens before it only (a causal language model): padding after a
    micro-batch's last real token can be cut (`data.padding=longest`, data/padding.py)."""
    context_parallel: Callable[[nn.Module, object], None] | None = None
    """Make the whole module train on one context-parallel shard of each sequence (`parallel.cp`): it is then
    called with the full sequences' token ids, hands `cp.inputs` what it gets and attends through
    `cp.attention` (parallel/context.py); None: the family cannot shard its sequence."""
    context_parallel_methods: tuple[str, ...] = ("ring", "allgather", "ulysses")
    """The `parallel.cp_method`s its attention can take; `context_parallel_note` says why not the others (or, with
    `context_parallel` None, why the family cannot shard its sequence at all)."""
    context_parallel_note: str = ""
    to_hf: Callable[[dict], dict] | None = None
    from_hf: Callable[[dict], dict] | None = None
    hf_config: Callable[[], dict] | None = None
    load_pretrained: Callable[[nn.Module], None] | None = None
    """Copy pretrained weights into the initialised single-device model, if the family has them."""
    moe_layers: Callable[[nn.Module], dict] | None = None
    """Module name -> MoE layer (routing statistics, expert parallelism); None: a dense family."""
    fingerprint: str = ""
    """Identifies the parameter shapes; a checkpoint resumes only into the same fingerprint."""
    family: str = ""
    """What kind of model this is (`built-in llama`, `Hugging Face llama`, `user spec NAME`): parameter names
    depend on it, so a checkpoint loads only into its own family. Set by models/registry.py."""
    label: str = ""
    """How a run's start line names the model: the registry name, the model directory, or the spec's own name."""
    attention: str = ""
    """The attention kernel the model runs with and why, where the family chooses one (recorded as the run starts)."""

    def flops_per_token(self, seq_len: int) -> float | None:
        if self.shape is None:
            return None
        from disttrain.models.flops import model_flops_per_token

        return model_flops_per_token(self.shape, seq_len)


def build_model(spec: ModelSpec, device: torch.device, seed: int, dtype: torch.dtype | None = None) -> nn.Module:
    """Build on the meta device (no memory), materialise on `device`, then initialise; `dtype` (fp64 runs)
    converts the initialised floating-point parameters and buffers, so every dtype starts from the same values."""
    with torch.device("meta"):
        model = spec.build()
    model.to_empty(device=device)
    spec.init_weights(model, seed)
    if spec.load_pretrained is not None:
        spec.load_pretrained(model)
    if dtype is not None:
        model.to(dtype)
    return model


@torch.no_grad()
def seeded_normal_(param: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill from a generator seeded by (seed, parameter name): the same values whether the model is whole,
    wrapped or split across stages, so every layout starts from identical weights."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    param.normal_(0.0, std, generator=torch.Generator(device=param.device).manual_seed(key))


@torch.no_grad()
def copy_weights(model: nn.Module, state: dict, hint: str = "") -> None:
    """Copy `state` (by parameter name) into a materialised single-device model; ValueError naming the first
    missing or misshapen parameter."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"the weights lack {len(missing)} parameter(s) of this model (e.g. {missing[0]}{hint})")
    for name, param in params.items():
        if state[name].shape != param.shape:
            raise ValueError(f"{name} has shape {tuple(state[name].shape)} in the weights, {tuple(param.shape)} "
                             "in the model")
        param.copy_(state[name])


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
