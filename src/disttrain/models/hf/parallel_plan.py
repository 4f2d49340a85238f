"""How a Hugging Face decoder is split over tensor-parallel ranks: its own `base_model_tp_plan`, completed by
tp_plans.py (the pipeline split is stages.py)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from disttrain.core.errors import UserError
from disttrain.models.hf.tp_plans import (MOE_OUTPUTS, SEQUENCE_WISE, TOKEN_WISE, block_entries, hand_written,
                                          own_styles)
from disttrain.models.hf.stages import HFStage, decoder
from disttrain.models.hf.tp_heads import ReplicatedOverHeads
from disttrain.models.output_head import head_parallel_style


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
    base = decoder(module, "parallel.tp")
    return module.config, base.embed_tokens, base.layers, module.lm_head


def tensor_parallel(module: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """The model's tensor-parallel plan (its own `base_model_tp_plan`, completed by tp_plans.py) on every block.
    With sequence parallelism the residual stream between blocks is split along the sequence: the model-level
    forward still sees the whole sequence (the embedding output is replicated, so transformers derives positions
    and the causal mask from the full length), the first block takes its slice locally, norms run on slices,
    attention and MLP gather the sequence on entry and reduce-scatter on exit (an MoE block: slice its output), and
    the head gathers it back. Gemma 4's per-layer inputs (whole on every rank) are sliced as the residual stream is,
    and the replicated projections that take them run on the slice (SEQUENCE_WISE); Gemma 4's MoE branch gathers
    the tokens as an MoE block does (TOKEN_WISE)."""
    config, embed, layers, head = _parts(module)
    per_layer = bool(getattr(config, "hidden_size_per_layer_input", 0))
    for i, block in enumerate(layers.children()):
        parallelize_module(block, tp_mesh, _block_plan(config, block, sequence_parallel))
        for path, split in hand_written(config):
            if _has(block, path):
                split(block.get_submodule(path), tp_mesh)
        if sequence_parallel and (i == 0 or per_layer):
            parallelize_module(block, tp_mesh, _sliced_inputs(i == 0, per_layer))
    if embed is not None:
        parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if head is not None:
        parallelize_module(head, tp_mesh, head_parallel_style(head, Shard(1) if sequence_parallel else Replicate()))
        if sequence_parallel:
            parallelize_module(decoder(module, "parallel.tp").norm, tp_mesh, SequenceParallel(use_local_output=True))
    if getattr(config, "tie_word_embeddings", False) and embed is not None and head is not None:
        head.weight = embed.weight  # both Shard(0) of the (vocab, dim) matrix: share again


def _sliced_inputs(first: bool, per_layer: bool) -> PrepareModuleInput:
    """Sequence parallelism's slicing of a block's positional inputs, without communication (the gradient is
    all-gathered back): the first block's hidden states (the replicated embeddings), and every block's per-layer
    input (Gemma 4: its second argument)."""
    hidden = (Replicate(), Shard(1)) if first else (None, None)
    extra = ((Replicate(), Shard(1)),) if per_layer else ()
    pairs = (hidden, *extra)
    return PrepareModuleInput(input_layouts=tuple(p[0] for p in pairs),
                              desired_input_layouts=tuple(p[1] for p in pairs), use_local_output=True)


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
        if name in TOKEN_WISE and TOKEN_WISE[name] == "in":  # Gemma 4's MoE branch, on flattened tokens
            entries[name] = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True)
        elif name in TOKEN_WISE:
            entries[name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0),
                                                use_local_output=True)
        elif "norm" in name.lower() or name in SEQUENCE_WISE:
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
