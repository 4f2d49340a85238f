"""One run, resolved once: (config, world size, device type) -> the Layout, the model (its family, shape and
ModelSpec), the tokenizer and the dtypes, after every rule has passed.

Resolving is one loop over RULES, the validity rules in the order users meet them: the machine's backend, the
model's dimensions, how the run is cut, the engine, the data; then the world size, the batch split, and what the
model and the device can do. Each rule is `(RunContext) -> problems` and lives in its family's package; the first problem
stops the run with its one-line message. The launcher, each worker, the builder, the dry run and the planner
read the `ResolvedRun` instead of re-deriving any part of it, so a layout is built and a ModelSpec is called
once per process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from disttrain.config.checks import callback_problems, distill_problems, engine_installed
from disttrain.config.saved import tokenizer_for
from disttrain.core.errors import UserError
from disttrain.data.rules import data_problems
from disttrain.distributed.rules import backend_problems
from disttrain.layout.layout import Layout
from disttrain.layout.problem import Problem
from disttrain.layout.rules import batch_problems, cut_problems
from disttrain.layout.world_rules import world_problems
from disttrain.models import registry
from disttrain.models.rules import lora_problems, shape_problems, spec_problems
from disttrain.models.shape import ModelShape
from disttrain.parallel.rules import compile_problems, ddp_static_graph_problems


@dataclass(frozen=True)
class ResolvedRun:
    """What a config means on a given world: everything the set-up path needs, derived once."""

    layout: Layout
    spec: object | None  # the ModelSpec; None only when planning without a world size (no torch there)
    shape: ModelShape | None  # None: a user ModelSpec without known dimensions
    tokenizer: str  # `data.tokenizer` with `auto` resolved; saved with every checkpoint, read by export
    device_type: str
    model_source: str  # the model as the config names it: model.name=debug, model.hf=DIR, model.spec=FILE:fn

    @property
    def model_name(self) -> str:
        """The model's name as the config gives it: the registry name, the Hugging Face directory, or FILE:fn."""
        return self.model_source.partition("=")[2]

    @property
    def family(self) -> str | None:
        """What kind of model (its parameter names, which checkpoints load): the ModelSpec's."""
        return self.spec.family if self.spec is not None else None

    @property
    def param_dtype(self) -> str:
        return self.layout.param_dtype

    @property
    def compute_dtype(self) -> str:
        return self.layout.compute_dtype

    @property
    def reduce_dtype(self) -> str:
        return self.layout.reduce_dtype


@dataclass
class RunContext:
    """What the rules read: the config, the world (None while planning), and what is resolved of the run so far.
    The ModelSpec is resolved on first use (built-in and Hugging Face ones once the cut is known good)."""

    cfg: object
    world_size: int | None
    device_type: str
    shape: ModelShape | None
    layout: Layout
    tokenizer: str
    model_key: str  # model.name, model.hf or model.spec: which resolver applies
    model_source: str
    world: list[Problem] = field(default_factory=list)  # the degrees against the world size
    resolved_spec: object | None = None
    data_planned: bool = False  # a planned layout's dry run: its data, the objective's kind, are the user's to set

    @property
    def spec(self):
        if self.resolved_spec is None:
            self.resolved_spec = registry.model_spec(self.cfg.model)
        return self.resolved_spec


@dataclass(frozen=True)
class Rule:
    check: Callable[[RunContext], list[Problem]]
    needs: tuple[str, ...] = ()  # "shape": the model's dimensions are known; "world": the world size is


RULES = (
    Rule(backend_problems, ("world",)),  # distributed/rules.py
    Rule(shape_problems, ("shape",)),  # models/rules.py
    Rule(lambda ctx: cut_problems(ctx.shape, ctx.layout)),  # layout/rules.py, whatever the world size
    Rule(engine_installed, ("world",)),  # config/checks.py
    Rule(data_problems),  # data/rules.py
    Rule(callback_problems),  # config/checks.py: the loop's user jobs load
    Rule(distill_problems, ("world",)),  # config/checks.py: the teacher against the student and the layout
    Rule(lambda ctx: ctx.world, ("world",)),  # layout/world_rules.py
    Rule(lambda ctx: batch_problems(ctx.layout), ("world",)),  # layout/rules.py
    Rule(spec_problems, ("world",)),  # models/rules.py
    Rule(lora_problems, ("world",)),  # models/rules.py -> models/lora.py
    Rule(compile_problems, ("world",)),  # parallel/rules.py
    Rule(ddp_static_graph_problems, ("world",)),  # parallel/rules.py
)


def resolve_run(cfg, world_size: int | None, device_type: str, data_planned: bool = False) -> ResolvedRun:
    """Resolve and check `cfg` on `world_size` ranks of `device_type` ("cuda" or "cpu"); UserError with the
    first broken rule's message. `data_planned`: the config is a planned layout to dry-run (random tokens), so
    its data stands for what its objective trains on (preference pairs) before the user has set it.

    `world_size` None (the planner reading a config): only the rules that hold whatever the world size run, the
    ModelSpec stays unresolved unless the shape comes from it (model.spec), and `dp_shard=-1` stands as 1."""
    ctx = _context(cfg, world_size, device_type)
    ctx.data_planned = data_planned
    known = {"shape"} if ctx.shape is not None else set()
    known |= {"world"} if world_size is not None else set()
    for rule in RULES:
        if set(rule.needs) <= known:
            problems = rule.check(ctx)
            if problems:
                raise UserError(str(problems[0]))
    return ResolvedRun(layout=ctx.layout, spec=ctx.resolved_spec, shape=ctx.shape, tokenizer=ctx.tokenizer,
                       device_type=device_type, model_source=ctx.model_source)


def _context(cfg, world_size: int | None, device_type: str) -> RunContext:
    resolver = registry.resolver_for(cfg.model)
    spec = registry.model_spec(cfg.model) if resolver.key == "model.spec" else None  # where its shape comes from
    shape = spec.shape if spec is not None else registry.model_shape(cfg.model)
    parallel = cfg.parallel
    world = [] if world_size is None else world_problems(parallel.dp_replicate, parallel.dp_shard, parallel.tp,
                                                         parallel.pp, world_size, parallel.cp)
    layout = Layout.from_config(cfg, None if world else world_size, device_type)  # cut rules first, then the world's
    return RunContext(cfg, world_size, device_type, shape, layout, tokenizer_for(cfg), resolver.key,
                      registry.model_source(cfg.model), world, spec)


