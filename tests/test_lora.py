"""LoRA adapters (model.lora) on a Hugging Face Llama with pretrained weights: only the adapters train;
every data-parallel, sharded (HSDP included), tensor-parallel and pipeline layout gives one process's losses
and adapters (fp64, 1e-10; the built-in model too under TP + SP); a resumed run continues exactly; the PEFT
export loaded by peft and the merged export loaded by transformers give the same logits; a base whose
weights changed is refused on resume and on merge; bad input is one line."""

from __future__ import annotations

import shutil

import pytest
import torch

from hf_models import save_tiny
from helpers import (DEBUG_CONFIG, EXACT, FP64, SMALL_CHUNKS, WHOLE_LOGITS, assert_losses_close, assert_params_exact,
                     assert_parity, final_params, losses, run_cli, run_main, train_many)

LORA = ("model.lora.rank=4", "model.lora.alpha=8")
COMMON = ("train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=1", "data.seq_len=64",
          "optim.lr=3e-3", "checkpoint.save_final=true", "checkpoint.every_steps=2", FP64, *LORA)
LAYOUTS = {"ddp": (), "zero1": ("parallel.zero_stage=1",), "zero3": ("parallel.zero_stage=3",),
           "pp2": ("parallel.pp=2",), "hsdp": ("parallel.zero_stage=3", "parallel.dp_replicate=2"),
           "zero2-full-ac": ("parallel.zero_stage=2", "parallel.activation_checkpointing=full"),
           "tp2": ("parallel.tp=2", "train.micro_batch_size=2"),  # DTensor costs ~0.1 s per micro-batch here
           "tp2-sp": ("parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2")}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama", weights_seed=7)


@pytest.fixture(scope="module")
def references(base, tmp_path_factory):
    """One process, the whole batch in one micro-batch; a run without LoRA (for --merge-lora's refusal); and
    two steps on a copy of the base whose weights a test then replaces."""
    root = tmp_path_factory.mktemp("ref")
    shutil.copytree(base, root / "base_copy")
    return train_many({"lora": (root / "lora", (*COMMON, f"model.hf={base}", "train.micro_batch_size=4", WHOLE_LOGITS)),
                       "plain": (root / "plain", (*COMMON[:-2], "train.steps=2", f"model.hf={base}")),
                       "builtin": (root / "builtin", (*COMMON, "train.micro_batch_size=4", WHOLE_LOGITS)),
                       "copy": (root / "on_copy", (*COMMON, "train.steps=2", f"model.hf={root / 'base_copy'}"))},
                      nproc=1)


@pytest.fixture(scope="module")
def two_rank_runs(base, references, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    jobs = {name: (root / name, (*COMMON, f"model.hf={base}", *extra, SMALL_CHUNKS)) for name, extra in LAYOUTS.items()}
    # the interrupted run: what the reference had written when step 2 was saved, resumed under ZeRO-3
    step2 = references["lora"] / "checkpoints" / "step_00000002"
    shutil.copytree(step2, root / "resumed" / "checkpoints" / step2.name)
    jobs["resumed"] = (root / "resumed", (*COMMON, f"model.hf={base}", "parallel.zero_stage=3", SMALL_CHUNKS))
    jobs["builtin tp2-sp"] = (root / "builtin_tp2_sp", (*COMMON, *LAYOUTS["tp2-sp"], SMALL_CHUNKS))
    jobs["zero3 bf16"] = (root / "zero3_bf16", (*COMMON[:-3], *LORA, f"model.hf={base}", "parallel.zero_stage=3",
                                                "precision.compute_dtype=bf16"))
    return train_many(jobs, nproc=2)


def test_only_the_adapters_train(base):
    """Through the builder's own pieces on one process: the base gets no gradient and no optimizer state, and
    stays bitwise what it was; the adapters move."""
    from disttrain.config.load import load_config
    from disttrain.models.lora import apply_lora, is_adapter
    from disttrain.models.registry import model_spec
    from disttrain.models.spec import build_model
    from disttrain.train.optim import build_optimizer

    cfg = load_config(DEBUG_CONFIG, [f"model.hf={base}", *LORA])
    spec = model_spec(cfg.model)
    model = build_model(spec, torch.device("cpu"), 0)
    apply_lora(model, spec, cfg.model.lora, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg.optim)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        spec.loss_sum(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()
        spec.loss_sum(model(x), x).backward()
    adapters = {n for n in before if is_adapter(n)}
    assert len(adapters) == 4 * 7 * 2  # 4 layers x (q, k, v, o, gate, up, down) x (lora_A, lora_B)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        if name in adapters:
            assert id(param) in in_optimizer and param.grad is not None and not torch.equal(param, before[name])
        else:
            assert not param.requires_grad and param.grad is None and id(param) not in in_optimizer, name
            assert torch.equal(param, before[name]), f"{name} changed"
    assert {id(p) for p in optimizer.state} <= {id(p) for n, p in model.named_parameters() if n in adapters}


def test_the_start_says_how_many_parameters_train(references, base):
    """The start records (and the start line shows) the adapters' size beside the total, equal to peft's own count
    of the same adapters on the same base."""
    import peft
    from transformers import AutoModelForCausalLM

    from helpers import events

    theirs = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trainable, total = theirs.get_nb_trainable_parameters()
    started = events(references["lora"], "started")[0]
    assert (started["trainable_params"], started["num_params"]) == (trainable, total)
    assert "trainable_params" not in events(references["plain"], "started")[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_one_process_losses_and_adapters(layout, two_rank_runs, references):
    assert_parity(two_rank_runs[layout], references["lora"], step=4)


def test_the_built_in_model_under_tensor_and_sequence_parallel(two_rank_runs, references):
    assert_parity(two_rank_runs["builtin tp2-sp"], references["builtin"], step=4)


def test_a_bf16_base_with_fp32_adapters_tracks_the_full_precision_run(two_rank_runs, references):
    """The frozen base stored in bf16 under ZeRO-3 (the adapters and their optimizer in fp32): within half of
    bf16's unit roundoff (2^-8) of the double-precision losses, as any bf16 run (test_hf.LOW_PRECISION)."""
    assert_losses_close(losses(two_rank_runs["zero3 bf16"]), losses(references["lora"]), rel=2e-3)
    adapters = final_params(two_rank_runs["zero3 bf16"], 4)
    assert adapters.keys() == final_params(references["lora"], 4).keys()
    assert {t.dtype for t in adapters.values()} == {torch.float32}


def test_checkpoint_holds_the_adapters_and_a_fingerprint_of_the_base(references):
    step = references["lora"] / "checkpoints" / "step_00000004"
    assert final_params(references["lora"], 4).keys() == {
        f"model.layers.{i}.{m}.lora_{ab}.default.weight" for i in range(4) for ab in "AB"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj")}
    assert len(torch.load(step / "train_state.pt", weights_only=True)["lora_base"]) == 16


def test_the_base_fingerprint_tells_bases_apart():
    """What resume and --merge-lora check: the same base built again matches; another seed's does not."""
    from disttrain.config.load import load_config
    from disttrain.models.lora import base_fingerprint
    from disttrain.models.registry import model_spec
    from disttrain.models.spec import build_model

    spec = model_spec(load_config(DEBUG_CONFIG, []).model)
    first, again, other = (base_fingerprint(build_model(spec, torch.device("cpu"), seed)) for seed in (0, 0, 1))
    assert first == again != other


def test_a_resumed_run_continues_exactly(two_rank_runs, references):
    resumed, full = losses(two_rank_runs["resumed"]), losses(references["lora"])
    assert sorted(resumed) == [3, 4]
    assert_losses_close(resumed, {s: full[s] for s in (3, 4)}, rel=EXACT)
    assert_params_exact(final_params(two_rank_runs["resumed"], 4), final_params(references["lora"], 4))


def test_resuming_with_other_lora_settings_is_refused(references, base):
    from disttrain.checkpoint.run_identity import check_run_dir
    from disttrain.config.load import load_config
    from disttrain.core.errors import UserError
    from disttrain.config.resolve import resolve_run

    run = references["lora"]
    cfg = load_config(DEBUG_CONFIG, [*COMMON, f"model.hf={base}", f"run.dir={run.parent}", f"run.name={run.name}",
                                     "model.lora.rank=2"])
    with pytest.raises(UserError, match="model.lora.rank=4 when saved, 2 now"):
        check_run_dir(cfg, resolve_run(cfg, 1, "cpu"), "test")
    without = load_config(DEBUG_CONFIG, [*COMMON[:-2], f"model.hf={base}", f"run.dir={run.parent}",
                                         f"run.name={run.name}"])
    with pytest.raises(UserError, match="model.lora=set when saved, absent now"):
        check_run_dir(without, resolve_run(without, 1, "cpu"), "test")


def test_a_changed_base_is_refused_on_resume_and_on_merge(references, tmp_path):
    """The base's weights replaced under the same config (another seed's, same shapes): the run's own
    command run again (which resumes) and --merge-lora each refuse in one line naming both fingerprints,
    exit 2, and write nothing."""
    run = references["copy"]
    source = run.parent / "base_copy"
    other = save_tiny("llama", tmp_path / "other", weights_seed=8)
    shutil.copy(other / "model.safetensors", source / "model.safetensors")

    def written():  # what the run holds; a launch's own log and claim (logs/, lease.json) aside
        return sorted(p.relative_to(run) for p in run.rglob("*") if p.name != "lease.json" and "logs" not in p.parts)

    # as if stopped after its last save, before recording its end: the same command resumes (a finished run would
    # not be trained again at all)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(line for line in lines if '"event": "finished"' not in line))
    before = written()
    metrics = (run / "metrics.jsonl").read_bytes()
    code, _, err = run_main("convert", str(run), "--to", "hf", "--merge-lora", "--out", str(tmp_path / "merged"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "merged").exists(), err
    assert "--merge-lora: the base model rebuilt from the run's config differs from the one its adapters were " \
           "trained on (fingerprint " in err
    proc = run_cli("train", str(DEBUG_CONFIG), *COMMON, "train.steps=2", f"model.hf={source}", f"run.dir={run.parent}",
                   f"run.name={run.name}", "distributed.timeout_s=60", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the frozen base differs from the one its LoRA adapters were trained on (fingerprint" in proc.stderr
    assert written() == before
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_both_exports_load_with_equal_logits(references, base, tmp_path):
    """The adapters through peft's own loading onto transformers' base, against the merged weights through
    transformers' from_pretrained alone (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from disttrain.checkpoint.export import export

    export(references["lora"], "peft", tmp_path / "peft")
    export(references["lora"], "hf", tmp_path / "merged", merge_lora=True)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    pretrained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = pretrained(x).logits
        adapted = PeftModel.from_pretrained(pretrained, tmp_path / "peft").eval()(x).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(x).logits
    assert float((adapted - base_logits).abs().max()) > 1e-2  # the adapters trained, and peft applied them
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


def test_bad_lora_input_is_one_line(references, base, tmp_path):
    """Each refusal is one line on stderr, exit 2, nothing written."""
    from disttrain.config.load import load_config
    from disttrain.core.errors import UserError
    from disttrain.checkpoint.export import export
    from disttrain.config.resolve import resolve_run

    proc = run_cli("train", str(DEBUG_CONFIG), f"model.hf={base}", "model.lora.targets=[q_prj]",
                   f"run.dir={tmp_path}", "run.name=bad", check=False)
    assert proc.returncode == 2 and not (tmp_path / "bad").exists()
    assert proc.stderr.strip().splitlines() == [
        "disttrain: error: model.lora.targets: 'q_prj' matches no linear module of model llama (allowed: its "
        "linear modules' names, down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj, or globs "
        "on their full names, e.g. model.layers.0.self_attn.q_proj)"]
    for rank in ("0", "-2"):  # through the command line in this process: refused before anything starts
        assert run_main("train", str(DEBUG_CONFIG), f"model.hf={base}", f"model.lora.rank={rank}",
                        f"run.dir={tmp_path}", "run.name=bad") == (
            2, "", f"disttrain: error: model.lora.rank={rank}: input should be greater than 0\n")
    assert not (tmp_path / "bad").exists()
    code, _, err = run_main("convert", str(references["plain"]), "--to", "hf", "--merge-lora", "--out",
                            str(tmp_path / "merged"))
    assert code == 2 and err.startswith("disttrain: error: --merge-lora: ") and err.count("\n") == 1, err
    assert "holds a run without LoRA adapters (model.lora unset); allowed for it: convert without --merge-lora" in err
    with pytest.raises(UserError, match="--to hf: .* holds LoRA adapters only"):
        export(references["lora"], "hf", tmp_path / "unmerged")
    assert not (tmp_path / "merged").exists() and not (tmp_path / "unmerged").exists()
    cfg = load_config(DEBUG_CONFIG, [f"model.hf={base}", *LORA, "parallel.tp=2", "model.lora.dropout=0.1"])
    with pytest.raises(UserError, match="model.lora.dropout=0.1 with parallel.tp=2: each tensor-parallel rank"):
        resolve_run(cfg, 2, "cpu")


@pytest.mark.parametrize("layout", [("parallel.zero_stage=3",), ("parallel.pp=2",)])
def test_the_dry_run_trains_the_adapters_alone_and_the_planner_follows(layout):
    """The dry run puts the adapters on the frozen base as the builder does (tests/test_dryrun.py holds it to a real
    run): gradients and optimizer states of the adapters alone, the base stored in bf16. Rank 0 of 2 (both stages
    of a pipeline): the planner's peak within 5% of it, its parameters within 2%."""
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run
    from disttrain.plan.params import lora_layer_params

    overrides = ["model.name=tiny", "data.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=2",
                 "precision.compute_dtype=bf16", *LORA, *layout]
    result = dry_run(load_config(DEBUG_CONFIG, overrides), 2, [0, 1] if "pp" in layout[0] else [0])
    shape = resolve_run(load_config(DEBUG_CONFIG, overrides), 2, "cpu").shape
    for rank in result["ranks"]:
        assert abs(rank["error"]["peak_bytes"]) <= 0.05, (layout, rank["error"], rank["bytes"], rank["planner"])
        assert abs(rank["error"]["parameters"]) <= 0.02, (layout, rank["bytes"], rank["planner"])
        layers = shape.n_layers // (2 if "pp" in layout[0] else 1)
        adapters = layers * lora_layer_params(shape, 4) / (1 if "pp" in layout[0] else 2)  # fp32, ZeRO-3 shards
        assert rank["bytes"]["optimizer"] == pytest.approx(2 * 4 * adapters, rel=0.01), rank["bytes"]


def test_the_planner_counts_the_adapters_and_what_freezing_saves(tmp_path):
    """The adapters `disttrain estimate` counts are the ones peft puts on the model; the frozen base keeps its
    weights but no gradients and no optimizer state."""
    import json

    import yaml
    from peft import LoraConfig, inject_adapter_in_model

    from disttrain.config.load import load_config
    from disttrain.models.lora import apply_lora
    from disttrain.models.registry import model_spec
    from disttrain.models.spec import build_model

    cfg = load_config(DEBUG_CONFIG, [*LORA])
    spec = model_spec(cfg.model)
    with torch.device("meta"):
        model = spec.build()
    n_base = sum(p.numel() for p in model.parameters())
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"]), model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    built = build_model(spec, torch.device("cpu"), 0)  # as the runtime stores it under bf16 compute
    apply_lora(built, spec, cfg.model.lora, 0, base_dtype=torch.bfloat16)
    stored = sum(p.numel() * p.element_size() for p in built.parameters())
    tree = yaml.safe_load(DEBUG_CONFIG.read_text())
    tree["model"] = {**tree.get("model", {}), "lora": {"rank": 4}}
    tree["precision"] = {**tree.get("precision", {}), "compute_dtype": "bf16"}
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump(tree))
    out = {name: json.loads(run_cli("estimate", str(path), "--gpus", "1", "--json").stdout)
           for name, path in (("full", DEBUG_CONFIG), ("lora", config))}
    lora, full = out["lora"], out["full"]
    assert lora["trainable_params_per_rank"] == adapters and lora["params_per_rank"] == n_base + adapters
    assert full["trainable_params_per_rank"] == full["params_per_rank"] == n_base
    assert lora["bytes_per_rank"]["grads"] == 4 * adapters and lora["bytes_per_rank"]["optimizer"] == 8 * adapters
    assert lora["bytes_per_rank"]["params"] == stored  # a bf16 base, fp32 adapters
    assert full["bytes_per_rank"]["optimizer"] == 8 * n_base
