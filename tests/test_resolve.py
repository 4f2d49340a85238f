"""A run is resolved once: one Layout and one ModelSpec per process, typed layout problems, the same error texts."""

from __future__ import annotations

import json
import textwrap

import pytest

from disttrain.config.load import load_config
from disttrain.core.errors import ConfigError
from disttrain.layout.layout import Layout
from disttrain.layout.problem import Problem
from disttrain.layout.rules import layout_problems
from disttrain.models.registry import MODEL_SHAPES
from disttrain.plan.search import MICRO_BATCH_KEYS
from disttrain.config.resolve import resolve_run
from helpers import DEBUG_CONFIG, train

# Loaded through PYTHONPATH into every process of a launch: counts Layout.from_config and
# model_spec calls per process (rewritten on each call: the CLI leaves through os._exit). A worker
# forked from its launcher starts from zero: calls are counted per process id.
COUNTING_HOOK = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path

    import disttrain.layout.layout as layout
    import disttrain.models.registry as registry

    counts = {"layouts": 0, "specs": 0, "pid": os.getpid()}

    def _record(kind):
        if counts["pid"] != os.getpid():
            counts.update(layouts=0, specs=0, pid=os.getpid())
        counts[kind] += 1
        out = Path(os.environ["DISTTRAIN_COUNT_DIR"]) / f"{os.getpid()}.json"
        out.write_text(json.dumps({**counts, "rank": os.environ.get("RANK"), "argv": sys.argv}))

    _from_config = layout.Layout.from_config.__func__
    _model_spec = registry.model_spec

    def from_config(cls, *args, **kwargs):
        _record("layouts")
        return _from_config(cls, *args, **kwargs)

    def model_spec(*args, **kwargs):
        _record("specs")
        return _model_spec(*args, **kwargs)

    layout.Layout.from_config = classmethod(from_config)
    registry.model_spec = model_spec
""")


def test_a_two_rank_launch_resolves_once_per_process(tmp_path):
    hook_dir, count_dir = tmp_path / "hook", tmp_path / "counts"
    hook_dir.mkdir()
    count_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(COUNTING_HOOK)
    run_dir = train(tmp_path / "runs" / "once", "train.steps=2", "checkpoint.resume=none", nproc=2,
                    env={"PYTHONPATH": str(hook_dir), "DISTTRAIN_COUNT_DIR": str(count_dir)})
    seen = [json.loads(f.read_text()) for f in count_dir.glob("*.json")]
    workers = sorted((p for p in seen if p["rank"] is not None), key=lambda p: p["rank"])
    launchers = [p for p in seen if p["rank"] is None]
    assert [p["rank"] for p in workers] == ["0", "1"], seen
    assert len(launchers) == 1 and "--nproc-per-node" in launchers[0]["argv"], seen
    for process in [*launchers, *workers]:
        assert (process["layouts"], process["specs"]) == (1, 1), process
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank_{rank:05d}.log").read_text()
        assert log.count("resolved run: world 2 (pp 1, dp_replicate 1, dp_shard 2, tp 1), model llama") == 1, log
        assert "(restart 0, forked from the launcher)" in log, log  # the suite's DISTTRAIN_WORKER_START=fork


def test_resolved_run_holds_what_the_set_up_path_reads():
    cfg = load_config(DEBUG_CONFIG, ["parallel.zero_stage=3", "precision.param_dtype=auto"])
    on_cpu = resolve_run(cfg, 2, "cpu")
    assert on_cpu.layout == Layout.from_config(cfg, 2, "cpu") and on_cpu.layout.dp_shard == 2
    assert on_cpu.spec.name == "llama" and on_cpu.shape == on_cpu.spec.shape
    assert on_cpu.tokenizer == "byte" and on_cpu.device_type == "cpu"
    assert (on_cpu.param_dtype, on_cpu.reduce_dtype) == ("fp32", "fp32")
    assert resolve_run(cfg, 2, "cuda").param_dtype == "bf16"
    with pytest.raises(AttributeError):
        on_cpu.layout = None  # frozen: nothing downstream re-derives or edits it
    planning = resolve_run(cfg, None, "cuda")  # the planner: no world, no torch side of the model
    assert planning.spec is None and planning.shape == on_cpu.shape


def test_resolve_run_calls_the_model_spec_once(monkeypatch):
    import disttrain.models.registry as registry

    calls = []
    real = registry.model_spec
    monkeypatch.setattr(registry, "model_spec", lambda model: calls.append(model) or real(model))
    cfg = load_config(DEBUG_CONFIG, ["parallel.tp=2", "parallel.zero_stage=2", "parallel.sequence_parallel=true",
                                     "data.document_masking=true", "train.micro_batch_size=1",
                                     "parallel.balance=auto"])
    resolve_run(cfg, 4, "cpu")  # every rule that reads the spec runs: tensor parallel, balance, masking
    assert len(calls) == 1


# (overrides, world size, the exact message of today's validation)
REFUSED = {
    "degrees miss the world": (["parallel.dp_replicate=2", "parallel.dp_shard=2"], 2,
                               "parallel.dp_replicate=2 x parallel.dp_shard=2 x parallel.tp=1 x parallel.pp=1 = 4 "
                               "does not equal the world size 2"),
    "rest does not divide": (["parallel.tp=2", "parallel.dp_shard=-1"], 3,
                             "parallel.dp_replicate=1 x parallel.tp=2 x parallel.pp=1 = 2 does not divide the world "
                             "size 3"),
    "cut before the world": (["parallel.pp=4"], 1,
                             "parallel.pp=4 x 1 stage(s) per rank = 4 stages exceeds model.n_layers=2"),
    "batch over ranks": (["train.global_batch_size=3"], 2,
                         "train.global_batch_size=3 is not divisible by the data-parallel size 2 (world size 2)"),
    "DDP under tensor parallel": (["parallel.tp=2", "model.n_layers=2"], 4,
                                  "parallel.tp=2 with 2 data-parallel ranks needs parallel.zero_stage 2 or 3, not 0 "
                                  "(FSDP2 composes with tensor and pipeline parallelism on the mesh; DDP and ZeRO-1 "
                                  "take neither DTensor parameters nor a schedule's many backward passes)"),
    "masking under a pipeline": (["data.document_masking=true", "parallel.pp=2", "train.micro_batch_size=1"], 2,
                                 "data.document_masking=true with parallel.pp=2: a later pipeline stage sees hidden "
                                 "states, not the token ids the document boundaries come from (allowed: "
                                 "parallel.pp=1, or document_masking=false)"),
    "compiled tensor parallel on CPU": (["parallel.compile=true", "parallel.tp=2"], 2,
                                        "parallel.compile=true with parallel.tp=2 does not run on CPU with this torch "
                                        "(compiled DTensor backward fails); allowed on CPU: parallel.compile=false "
                                        "with tp > 1, or compile with tp=1"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refusals_keep_their_text(name):
    overrides, world, message = REFUSED[name]
    with pytest.raises(ConfigError) as exc:
        resolve_run(load_config(DEBUG_CONFIG, overrides), world, "cpu")
    assert str(exc.value) == message


def test_layout_problems_are_typed_and_the_planner_reads_keys():
    shape = MODEL_SHAPES["tiny"]  # 8 heads, 4 kv heads, 4 layers
    problems = layout_problems(shape, Layout(tp=3, global_batch_size=3, micro_batch_size=1))
    assert all(isinstance(p, Problem) for p in problems)
    assert [(p.key, p.value, p.allowed) for p in problems] == [
        ("parallel.tp", 3, "a divisor of model.n_heads=8"), ("parallel.tp", 3, "a divisor of model.n_kv_heads=4"),
        ("parallel.tp", 3, "a divisor of model.vocab_size=256")]
    assert str(problems[0]) == "parallel.tp=3 does not divide model.n_heads=8"
    # a micro-batch size that does not divide the per-rank batch: the planner tries other sizes
    uneven = layout_problems(shape, Layout(dp_shard=2, global_batch_size=4, micro_batch_size=3))
    assert [p.key for p in uneven] == ["train.micro_batch_size"] and uneven[0].key in MICRO_BATCH_KEYS
    assert str(uneven[0]) == ("train.micro_batch_size=3 does not divide the per-rank batch 2 "
                              "(train.global_batch_size=4 over 2 data-parallel ranks)")
    # a batch that does not split over the ranks: no micro-batch size helps
    unsplit = layout_problems(shape, Layout(dp_shard=2, global_batch_size=3, micro_batch_size=1))
    assert [p.key for p in unsplit] == ["train.global_batch_size"] and unsplit[0].value == 3


# Every module that holds a validity rule or resolves the model (config/resolve.py's RULES and the registry).
RULE_MODULES = ("config/checks.py", "models/registry.py", "models/rules.py", "data/rules.py", "parallel/rules.py",
                "distributed/rules.py", "layout/rules.py", "layout/world_rules.py", "layout/expert_rules.py",
                "layout/context_rules.py", "layout/balance_rules.py")


def test_training_never_returns_to_validation_or_the_registry(tmp_path):
    """From the resolved run to the last optimizer step, nothing re-derives a rule or re-resolves the model."""
    import logging
    import sys

    from disttrain.cli import main

    after, resolved = [], []

    def watch(frame, event, arg):
        code = frame.f_code
        if event == "return" and code.co_name == "resolve_run" and code.co_filename.endswith("resolve.py"):
            resolved.append(True)
        elif event == "call" and resolved and code.co_filename.endswith(RULE_MODULES):
            after.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}")

    handlers = logging.getLogger("disttrain").handlers[:]
    sys.setprofile(watch)
    try:
        main(["train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "train.steps=2", "checkpoint.resume=none"])
    finally:
        sys.setprofile(None)
        for handler in logging.getLogger("disttrain").handlers:
            handler.close()
        logging.getLogger("disttrain").handlers[:] = handlers
    assert resolved == [True] and after == []
    assert [r["step"] for r in map(json.loads, (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r and "event" not in r] == [1, 2]


@pytest.mark.parametrize("overrides,world,device", [
    ([], 2, "cpu"),
    (["parallel.zero_stage=3", "precision.param_dtype=bf16", "precision.reduce_dtype=fp32"], 4, "cuda"),
    (["parallel.zero_stage=2"], 2, "cuda"),  # param_dtype auto: bf16 on a GPU
    (["parallel.dp_replicate=2", "parallel.zero_stage=3", "parallel.cpu_offload=true"], 4, "cpu"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=2"], 4, "cpu"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_microbatches=4", "parallel.pp_layers=[1,1,1,1]",
      "model.n_layers=4", "train.global_batch_size=8", "parallel.activation_checkpointing=full"], 2, "cpu"),
    (["model.name=debug-moe", "parallel.ep=2", "parallel.zero_stage=1"], 2, "cpu"),
    (["parallel.cp=2", "parallel.cp_method=ulysses", "data.seq_len=64"], 2, "cpu"),
    (["parallel.balance_weights=[1,3]", "train.micro_batch_size=1"], 2, "cpu"),
    (["precision.compute_dtype=fp64"], 1, "cpu"),
    (["precision.compute_dtype=bf16"], 2, "cuda"),
    (["engine=deepspeed", "parallel.zero_stage=3", "precision.compute_dtype=fp16"], 2, "cuda"),
])
def test_to_config_gives_the_layout_back(overrides, world, device, monkeypatch):
    """Layout.to_config is the one inverse of Layout.from_config: its sections alone (every other key at its
    default) resolve to the same Layout on the same world."""
    from disttrain.config.schema import RunConfig

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # engine=deepspeed: installed or not
    layout = resolve_run(load_config(DEBUG_CONFIG, overrides), world, device).layout
    assert Layout.from_config(RunConfig.model_validate(layout.to_config()), world, device) == layout
