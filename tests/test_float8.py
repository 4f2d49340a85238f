"""float8 matmuls (`precision.float8=rowwise`): which layers convert, the numerics against torchao's own emulation in
a plain loop, checkpoints and resumes unchanged, and the refusals. The layouts are in test_float8_layouts.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import WHOLE_LOGITS, DEBUG_CONFIG, final_params, load_checkpoint_state, losses, run_cli, step_records, train_many

STEPS = 6
COMMON = (f"train.steps={STEPS}", "train.micro_batch_size=2", "checkpoint.save_final=true", "optim.grad_clip=0.5",
          WHOLE_LOGITS)  # as the plain loop computes the loss
FLOAT8 = "precision.float8=rowwise"


def _model(name: str, *overrides: str):
    from disttrain.config.load import load_config
    from disttrain.models.registry import model_spec

    cfg = load_config(DEBUG_CONFIG, [f"model.name={name}", *overrides])
    spec = model_spec(cfg.model)
    with torch.device("meta"):
        return spec.build(), spec


def test_the_rule_takes_the_blocks_linear_layers_and_nothing_else():
    """Every Linear of the blocks (attention and MLP projections), not the output head or the embeddings; in an
    MoE model not the routers; the converted modules are torchao's Float8Linear with the same parameter names."""
    from torchao.float8.float8_linear import Float8Linear

    from disttrain.parallel.float8 import apply_float8, choose_layers

    model, spec = _model("debug")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    before = {n: p.shape for n, p in model.named_parameters()}
    choice = apply_float8(model, spec, torch.device("cpu"))
    assert choice.converted == [n for n in names if n.startswith("layers.")] and len(choice.converted) == 2 * 7
    assert not choice.skipped
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == set(choice.converted)
    assert type(model.output) is not Float8Linear  # the head: outside the blocks
    assert {n: p.shape for n, p in model.named_parameters()} == before

    moe, spec = _model("debug-moe")
    choice = choose_layers(moe, spec)
    routers = [n for n in choice.skipped if ".router." in n]
    assert routers and all(choice.skipped[n] == "router" for n in routers)
    assert not any(".router." in n for n in choice.converted)
    assert "router" in choice.describe()


def test_the_rule_skips_dimensions_float8_kernels_cannot_take_and_lora_factors():
    from disttrain.parallel.float8 import choose_layers

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.odd, self.down = nn.Linear(32, 64), nn.Linear(64, 40), nn.Linear(40, 32)

    class Spec:
        blocks = staticmethod(lambda m: m.layers)

    model = nn.Module()
    model.layers = nn.ModuleList([Block()])
    choice = choose_layers(model, Spec)
    assert choice.converted == ["layers.0.up"]
    assert choice.skipped == {"layers.0.odd": "dimension not a multiple of 16",
                              "layers.0.down": "dimension not a multiple of 16"}

    from disttrain.config.load import load_config
    from disttrain.models.lora import apply_lora
    from disttrain.models.spec import build_model

    spec = _model("debug")[1]
    lora = build_model(spec, torch.device("cpu"), 0)

    apply_lora(lora, spec, load_config(DEBUG_CONFIG, ["model.lora.rank=16"]).model.lora, 0)
    choice = choose_layers(lora, spec)
    factors = [n for n in choice.skipped if ".lora_" in n]
    assert factors and all(choice.skipped[n] == "LoRA factor" for n in factors)
    assert all(".lora_" not in n for n in choice.converted) and choice.converted


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """disttrain with float8, the same without, torchao's emulation in a plain loop (tests/workers/
    optim_reference.py), and the float8 run resumed from its step-3 checkpoint: one launch of one process."""
    root = tmp_path_factory.mktemp("float8")
    plain = [f"run.dir={root}", "run.name=reference", *COMMON]
    jobs = {"float8": (root / "float8", (*COMMON, FLOAT8, "checkpoint.every_steps=3")),
            "plain": (root / "plain", COMMON),
            "reference": {"call": "optim_reference:train", "args": [str(DEBUG_CONFIG), plain, str(root / "ref.pt"),
                                                                   True]}}
    train_many(jobs, nproc=1)
    saved = root / "float8" / "checkpoints" / "step_00000003"
    train_many({"resumed": (root / "resumed", (*COMMON, FLOAT8, f"checkpoint.resume={saved}"))}, nproc=1)
    return root, torch.load(root / "ref.pt")


def test_one_process_equals_torchaos_emulation_in_a_plain_loop(one_process):
    """Losses and gradient norms per step and every final parameter: disttrain's float8 against the plain loop's,
    which converted the layers itself with torchao's emulation (what a CPU runs: the float8-rounded values
    multiplied in fp32): equal, the same operations in the same order (the loss from whole logits, as the loop
    takes it). Without float8 the losses move by far more (asserted): the layers really changed."""
    root, ref = one_process
    ours = step_records(root / "float8")
    for key in ("loss", "grad_norm"):
        got = [ours[s][key] for s in sorted(ours)]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref[key], strict=True))
        assert worst <= 1e-12, f"{key}: {worst:.2e}\n{got}\n{ref[key]}"
    params = final_params(root / "float8", STEPS)
    assert params.keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        worst = float((params[name] - expected).abs().max()) / (float(expected.abs().max()) or 1.0)
        assert worst <= 1e-12, f"{name}: {worst:.2e}"
    off, on = losses(root / "plain"), losses(root / "float8")
    assert off[1] != on[1] and max(abs(off[s] - on[s]) for s in on) > 1e-4


def test_checkpoints_hold_the_same_parameters_and_resume_exactly(one_process):
    """A float8 run saves what a run without float8 saves (the same names, shapes and fp32 dtype), and resumed
    from step 3 it ends where the uninterrupted run does."""
    root, _ = one_process
    on = load_checkpoint_state(root / "float8" / "checkpoints" / f"step_{STEPS:08d}")
    off = load_checkpoint_state(root / "plain" / "checkpoints" / f"step_{STEPS:08d}")
    assert on["model"].keys() == off["model"].keys()
    for name, tensor in off["model"].items():
        assert on["model"][name].shape == tensor.shape and on["model"][name].dtype == tensor.dtype == torch.float32
    whole, resumed = losses(root / "float8"), losses(root / "resumed")
    assert sorted(resumed) == list(range(4, STEPS + 1))
    assert all(resumed[s] == whole[s] for s in resumed), (resumed, whole)


@pytest.mark.parametrize("overrides, fragment", [
    (("precision.compute_dtype=fp16",), "precision.float8=rowwise with precision.compute_dtype=fp16"),
    (("precision.compute_dtype=fp64",), "precision.float8=rowwise with precision.compute_dtype=fp64"),
    (("engine=deepspeed",), "precision.float8=rowwise needs engine=torch"),
    (("precision.float8=fp4",), "precision.float8"),
])
def test_refused_in_one_line(tmp_path, overrides, fragment):
    result = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", FLOAT8, *overrides, check=False)
    assert result.returncode == 2 and fragment in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_refused_without_torchao_or_a_float8_gpu(monkeypatch):
    """Neither can be met on this machine: the checks are called with what such a machine would answer."""
    import importlib.util

    from disttrain.config import checks
    from disttrain.config.load import load_config
    from disttrain.parallel import float8

    cfg = load_config(DEBUG_CONFIG, [FLOAT8])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    (problem,) = checks.float8_problems(cfg)
    assert "needs torchao" in problem.message and "disttrain[float8]" in problem.message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    message = float8.float8_device_problem(torch.device("cuda", 0))
    assert "A100" in message and "8.0" in message and "allowed here: off" in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8.float8_device_problem(torch.device("cuda", 0)) is None
    assert float8.float8_device_problem(torch.device("cpu")) is None


LAYOUTS = {
    "ddp": ("parallel.zero_stage=0",),
    "pp2": ("parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=2"),
    "zero3 selective": ("parallel.zero_stage=3", "parallel.activation_checkpointing=selective"),
    "tp2 sp": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"),
    "cp2": ("parallel.cp=2", "parallel.dp_shard=1"),
    "zero3 compile": ("parallel.zero_stage=3", "parallel.compile=true"),
}
LAYOUT_COMMON = (f"train.steps={STEPS}", "train.micro_batch_size=2")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Each layout on 2 processes; one process with float8 and without."""
    root = tmp_path_factory.mktemp("float8_layouts")
    train_many({name: (root / name.replace(" ", "_"), (*LAYOUT_COMMON, FLOAT8, *extra))
                for name, extra in LAYOUTS.items()}, nproc=2)
    train_many({"one": (root / "one", (*LAYOUT_COMMON, FLOAT8)), "one plain": (root / "one_plain", LAYOUT_COMMON)},
               nproc=1)
    return root


def _gap(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    return max(abs(a[s] - b[s]) for s in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_trains_float8_as_one_process_does(layout, two_processes):
    """DDP and the pipeline compute exactly what one process does: equal losses. The others differ from it in
    fp32 rounding (ZeRO-3's reduction order) and in float8 scales (a rowwise scale is taken over the rank's shard:
    a column of a weight split by TP, the tokens of a CP shard; the compiled cast rounds on its own), which float8
    rounding then carries into later steps: the first step's forward agrees to 1e-5 and every loss stays within
    5% of float8's own effect (float8 against no float8 on one process). A lost gradient or a wrong scale moves
    the losses by the size of training's own progress, a hundred times more."""
    root = two_processes
    one, ours = losses(root / "one"), losses(root / layout.replace(" ", "_"))
    effect = _gap(losses(root / "one_plain"), one)
    assert effect > 1e-3 and one[1] - one[STEPS] > 100 * 0.05 * effect, "too little training or too little float8"
    if layout in ("ddp", "pp2"):
        assert ours == one
    else:
        assert abs(ours[1] - one[1]) <= 1e-5 * one[1]
        assert _gap(ours, one) <= 0.05 * effect, (_gap(ours, one), effect)
