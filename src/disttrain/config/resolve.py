"""One run, resolved once: (config, world size, device type) -> the Layout, the model and its shape,
the tokenizer and the dtypes, after every rule that needs them has passed.

The launcher, each worker, the builder, the dry run and the planner read the `ResolvedRun` instead of
re-deriving any part of it, so a layout is built and a user's ModelSpec is called once per process.
Rules come from layout.py (how a run is cut) and validation.py (what the config sections say to each
other); the ones here need the resolved ModelSpec or the device. Raises UserError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from disttrain.core.errors import UserError
from disttrain.layout.layout import Layout
from disttrain.layout.problem import Problem
from disttrain.layout.rules import batch_problems, cut_problems
from disttrain.layout.world_rules import world_problems
from disttrain.models.registry import model_shape, model_spec
from disttrain.models.shape import ModelShape
from disttrain.config.checks import check_data, check_engine_installed, check_shape

if TYPE_CHECKING:  # the spec's module imports torch; the planner resolves without it
    from disttrain.models.spec import ModelSpec


@dataclass(frozen=True)
class ResolvedRun:
    """What a config means on a given world: everything the set-up path needs, derived once."""

    layout: Layout
    spec: ModelSpec | None  # None only when planning without a world size (no torch there)
    shape: ModelShape | None  # None: a user ModelSpec without known dimensions
    tokenizer: str  # `data.tokenizer` with `auto` resolved
    device_type: str

    @property
    def param_dtype(self) -> str:
        return self.layout.param_dtype

    @property
    def compute_dtype(self) -> str:
        return self.layout.compute_dtype

    @property
    def reduce_dtype(self) -> str:
        return self.layout.reduce_dtype


def resolve_run(cfg, world_size: int | None, device_type: str) -> ResolvedRun:
    """Resolve and check `cfg` on `world_size` ranks of `device_type` ("cuda" or "cpu").

    `world_size` None (the planner reading a config): only the rules that hold whatever the world size
    run, the ModelSpec stays unresolved unless the shape comes from it (model.spec), and `dp_shard=-1`
    stands as 1. Rules run in the order users meet them: the model's dimensions, how it is cut, the
    engine, the data; then the world size, the batch split, and what the model and the device can do."""
    spec = model_spec(cfg.model) if cfg.model.spec else None  # a user's spec is where its shape comes from
    shape = spec.shape if spec is not None else model_shape(cfg.model)
    if shape is not None:
        check_shape(cfg, shape)
    p = cfg.parallel
    world = [] if world_size is None else world_problems(p.dp_replicate, p.dp_shard, p.tp, p.pp, world_size, p.cp)
    layout = Layout.from_config(cfg, None if world else world_size, device_type)
    _raise_first(cut_problems(shape, layout))
    if world_size is not None:
        check_engine_installed(cfg)
    tokenizer = tokenizer_for(cfg)
    check_data(cfg, shape, tokenizer)
    if world_size is not None:
        _raise_first(world or batch_problems(layout))
        spec = spec or model_spec(cfg.model)  # built-in and Hugging Face specs: once the cut is known good
        _raise_first(model_problems(spec, layout, cfg, device_type))
    return ResolvedRun(layout=layout, spec=spec, shape=shape, tokenizer=tokenizer, device_type=device_type)


def tokenizer_for(cfg) -> str:
    """`data.tokenizer=auto`: the Hugging Face model directory's tokenizer.json when it has one, else bytes."""
    if cfg.data.tokenizer != "auto":
        return cfg.data.tokenizer
    if cfg.model.hf and (Path(cfg.model.hf) / "tokenizer.json").is_file():
        return str(Path(cfg.model.hf) / "tokenizer.json")
    return "byte"


def _raise_first(problems: list[Problem]) -> None:
    if problems:
        raise UserError(str(problems[0]))


def model_problems(spec, layout: Layout, cfg, device_type: str) -> list[Problem]:
    """Rules the ModelSpec decides (its plans, BatchNorm, masking) and the device: they need the resolved spec."""
    what = f"model {spec.name}" + (f" from model.hf={cfg.model.hf}" if cfg.model.hf else "")
    lay, problems = layout, []
    if lay.tp > 1 and spec.tensor_parallel is None:
        problems.append(Problem("parallel.tp", lay.tp, "1", f"parallel.tp={lay.tp}: {what} has no tensor-parallel "
                                "plan (allowed for it: parallel.tp=1)"))
    if lay.ep > 1 and spec.moe_layers is None:
        problems.append(Problem("parallel.ep", lay.ep, "1", f"parallel.ep={lay.ep}: {what} has no MoE layers "
                                "expert parallelism can split (the built-in MoE family and transformers' qwen3_moe, "
                                "qwen2_moe, mixtral, olmoe have; allowed for it: parallel.ep=1)"))
    if lay.sequence_parallel and not spec.sequence_parallel:
        problems.append(Problem("parallel.sequence_parallel", True, "false", "parallel.sequence_parallel=true: "
                                f"{what} has no sequence-parallel plan (allowed for it: false)"))
    if lay.sequence_parallel and lay.pp > 1 and cfg.model.hf:
        problems.append(Problem("parallel.sequence_parallel", True, "sequence parallel or pipeline",
                                f"parallel.sequence_parallel=true with parallel.pp={lay.pp}: {what} (a later pipeline "
                                "stage of a transformers model sees only its sequence slice and cannot derive "
                                "positions); allowed for it: sequence parallel or pipeline, not both"))
    if lay.pp > 1 and (spec.pipeline_split is None or spec.shape is None):
        problems.append(Problem("parallel.pp", lay.pp, "1", f"parallel.pp={lay.pp}: {what} cannot be split into "
                                "pipeline stages (needs the usual model.embed_tokens / model.layers / model.norm / "
                                "lm_head decoder; allowed for it: parallel.pp=1)"))
    if lay.balanced and lay.dp > 1 and spec.sync_batchnorm:
        # uneven shares mean ranks run different numbers of forward passes: nothing may communicate in one
        problems.append(Problem("parallel.balance", lay.balance, "equal shares", "parallel.balance/balance_weights: "
                                f"model {spec.name} synchronises BatchNorm over data parallel in every forward pass, "
                                "which needs the same number of micro-batches on every rank (allowed for it: equal "
                                "shares)"))
    if cfg.data.document_masking:  # boundaries come from token ids, which only the first stage sees
        if lay.pp > 1:
            problems.append(Problem("data.document_masking", True, "false, or parallel.pp=1", "data.document_masking="
                                    f"true with parallel.pp={lay.pp}: a later pipeline stage sees hidden states, not "
                                    "the token ids the document boundaries come from (allowed: parallel.pp=1, or "
                                    "document_masking=false)"))
        elif spec.mask_documents is None:
            problems.append(Problem("data.document_masking", True, "false", f"data.document_masking=true: model "
                                    f"{spec.name} has no document masking (its ModelSpec sets no mask_documents; "
                                    "allowed for it: false)"))
    if lay.cp > 1:
        problems += _context_problems(spec, lay, what)
    if cfg.model.lora is not None:
        from disttrain.models.lora import lora_problem

        problem = lora_problem(spec, cfg, lay)
        if problem:
            problems.append(Problem("model.lora", cfg.model.lora, "see the message", problem))
    if cfg.parallel.compile and lay.tp > 1 and device_type == "cpu":
        # torch 2.13: the compiled block's backward hands a plain tensor to DTensor's redistribute
        # backward ("'Tensor' object has no attribute '_local_tensor'"); eager TP and compiled DDP/FSDP work.
        problems.append(Problem("parallel.compile", True, "false with tp > 1 on CPU", "parallel.compile=true with "
                                f"parallel.tp={lay.tp} does not run on CPU with this torch (compiled DTensor backward "
                                "fails); allowed on CPU: parallel.compile=false with tp > 1, or compile with tp=1"))
    return problems


def _context_problems(spec, layout: Layout, what: str) -> list[Problem]:
    """Context parallelism needs the family's hook, and a method its attention can take."""
    cp, method = layout.cp, layout.cp_method
    if spec.context_parallel is None:
        return [Problem("parallel.cp", cp, "1", f"parallel.cp={cp}: {what} cannot shard its sequence (context "
                        "parallelism needs the built-in model or a transformers llama, mistral, qwen2 or qwen3 "
                        "model; allowed for it: parallel.cp=1)")]
    if layout.pp > 1 and spec.name != "llama":
        return [Problem("parallel.cp", cp, "1 with parallel.pp > 1", f"parallel.cp={cp} with parallel.pp={layout.pp}: "
                        f"{what} (context-parallel pipeline stages need the built-in model; allowed for it: one of "
                        "cp, pp)")]
    if method not in spec.context_parallel_methods:
        allowed = ", ".join(spec.context_parallel_methods)
        return [Problem("parallel.cp_method", method, allowed, f"parallel.cp_method={method}: the attention of "
                        f"{what} cannot take it ({spec.context_parallel_note or 'not supported'}; allowed for it: "
                        f"{allowed})")]
    return []
