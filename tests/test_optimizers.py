"""AdamW and Muon against plain PyTorch loops (torch.optim.AdamW, torch.optim.Muon, LambdaLR, clip_grad_norm_) on
the same starting weights and batches, for every schedule; Muon on several layouts against one process; the
bad settings refused in one line."""

from __future__ import annotations

import pytest
import torch

from helpers import FP64, DEBUG_CONFIG, assert_parity, final_params, records, run_cli, step_records, train_many

STEPS = 8
COMMON = (FP64, f"train.steps={STEPS}", "train.micro_batch_size=4", "checkpoint.save_final=true", "optim.min_lr=3e-4",
          "optim.grad_clip=0.5")  # a clip that triggers (checked below)
CASES = {
    "adamw cosine": ("optim.schedule=cosine",),
    "adamw linear": ("optim.schedule=linear",),
    "adamw constant": ("optim.schedule=constant",),
    "adamw wsd": ("optim.schedule=wsd", "optim.decay_steps=3", "optim.decay_shape=sqrt"),
    "muon": ("optim.name=muon", "optim.schedule=wsd", "optim.decay_fraction=0.5", "optim.weight_decay=0.05"),
    "muon original": ("optim.name=muon", "optim.muon.adjust_lr=original", "optim.muon.nesterov=false",
                      "optim.muon.lr=0.02", "optim.muon.momentum=0.9", "optim.muon.ns_steps=3"),
    "adamw bf16 states": ("optim.state_dtype=bf16", "checkpoint.every_steps=4"),
    "muon bf16 states": ("optim.name=muon", "optim.state_dtype=bf16", "checkpoint.every_steps=4"),
}


@pytest.fixture(scope="module")
def against_plain_loops(tmp_path_factory):
    """Each case trained by disttrain and by tests/workers/optim_reference.py, in one launch of one process."""
    root = tmp_path_factory.mktemp("optim")
    jobs = {}
    for name, extra in CASES.items():
        run = root / name.replace(" ", "_")
        overrides = [f"run.dir={root}", f"run.name={run.name}", *COMMON, *extra]
        jobs[name] = (run, (*COMMON, *extra))
        jobs[f"{name} reference"] = {"call": "optim_reference:train",
                                     "args": [str(DEBUG_CONFIG), overrides, str(root / f"{run.name}.pt")]}
    for name in ("adamw bf16 states", "muon bf16 states"):  # resumed halfway: the loaded moments stay bf16
        run, extra = jobs[name]
        saved = run / "checkpoints" / "step_00000004"
        jobs[f"{name} resumed"] = (root / f"{run.name}_resumed", (*extra, f"checkpoint.resume={saved}"))
    train_many({k: v for k, v in jobs.items() if "resumed" not in k}, nproc=1)
    train_many({k: v for k, v in jobs.items() if "resumed" in k}, nproc=1)
    return {name: (root / name.replace(" ", "_"), torch.load(root / f"{name.replace(' ', '_')}.pt"))
            for name in CASES}


def _close(ours: list[float], theirs: list[float], rel: float, what: str) -> None:
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    assert worst <= rel, f"{what}: largest relative difference {worst:.2e} > {rel:.0e}\n{ours}\n{theirs}"


@pytest.mark.parametrize("case", list(CASES))
def test_equals_a_plain_pytorch_loop(case, against_plain_loops):
    """Losses, learning rates and gradient norms per step, and every final parameter, equal a hand-written loop
    of torch's optimizers in fp64. Muon to 1e-8 (its Newton-Schulz runs in bf16 in both, so a last-bit
    difference of the forward can round one element the other way, which Adam's normalisation then carries),
    AdamW to 1e-10."""
    run, ref = against_plain_loops[case]
    rel = 1e-8 if case.startswith("muon") else 1e-10
    records = step_records(run)
    assert sorted(records) == list(range(1, STEPS + 1))
    _close([records[s]["loss"] for s in sorted(records)], ref["loss"], rel, "loss")
    _close([records[s]["grad_norm"] for s in sorted(records)], ref["grad_norm"], rel, "gradient norm")
    _close([records[s]["lr"] for s in sorted(records)], ref["lr"], 1e-12, "learning rate")
    assert max(ref["grad_norm"]) > 0.5, "the clip never triggered: raise the gradient norm or lower the clip"
    ours = final_params(run, STEPS)
    assert ours.keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        scale = float(expected.abs().max()) or 1.0
        worst = float((ours[name] - expected).abs().max()) / scale
        assert worst <= rel, f"{name}: worst element {worst:.2e} of its largest > {rel:.0e}"
    if case.startswith("muon"):  # the split the reference made by hand: every block matrix, nothing else
        assert len(ref["muon"]) == 2 * 7


@pytest.mark.parametrize("case", ["adamw bf16 states", "muon bf16 states"])
def test_bf16_states_are_saved_in_bf16_and_resume_exactly(case, against_plain_loops):
    """The checkpoint holds every moment in bf16 (half of fp32's bytes), and a run resumed from it at step 4 ends
    where the uninterrupted one does (fp64, 1e-10): its loaded moments were kept in bf16, not widened."""
    from torch.distributed.checkpoint import FileSystemReader

    run, _ = against_plain_loops[case]
    meta = FileSystemReader(str(run / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    moments = {k: v.properties.dtype for k, v in meta.items() if k.rsplit(".", 1)[-1] in
               ("exp_avg", "exp_avg_sq", "momentum_buffer")}
    kinds = {k.rsplit(".", 1)[-1] for k in moments}
    assert kinds == ({"exp_avg", "exp_avg_sq", "momentum_buffer"} if case.startswith("muon") else
                     {"exp_avg", "exp_avg_sq"})
    assert set(moments.values()) == {torch.bfloat16}, moments
    assert_parity(run.parent / f"{run.name}_resumed", run, step=STEPS, after=4)


def test_wsd_holds_the_peak_then_decays_to_min_lr(against_plain_loops):
    run, _ = against_plain_loops["adamw wsd"]
    lrs = [step_records(run)[s]["lr"] for s in range(1, STEPS + 1)]
    assert lrs[:2] == [1.5e-3, 3e-3] and lrs[2:6] == [3e-3] * 4  # warmup 2, then the peak until the decay
    assert 3e-3 > lrs[6] > lrs[7] > 3e-4  # the last 3 steps decay towards min_lr (reached after the last step)


PARITY_STEPS = 10
MUON_PARITY = (FP64, f"train.steps={PARITY_STEPS}", "train.global_batch_size=4", "model.n_layers=4", "optim.lr=3e-3",
               "optim.name=muon", "checkpoint.save_final=true", "metrics.sync_check_every=5")
MUON_LAYOUTS = {  # 2 ranks; micro-batches of 1 (accumulating) unless a layout needs more per rank
    "ddp": ("train.micro_batch_size=1",),
    "zero1": ("parallel.zero_stage=1", "train.micro_batch_size=1", "checkpoint.every_steps=5"),
    "zero3": ("parallel.zero_stage=3", "train.micro_batch_size=1"),
    "zero2 + selective recompute": ("parallel.zero_stage=2", "parallel.activation_checkpointing=selective",
                                    "train.micro_batch_size=1"),
    "hsdp 2x1": ("parallel.zero_stage=3", "parallel.dp_replicate=2", "parallel.dp_shard=1",
                 "train.micro_batch_size=1"),  # a 2-D mesh
    "zero3 + cpu offload": ("parallel.zero_stage=3", "parallel.cpu_offload=true", "train.micro_batch_size=1"),
    "tp2": ("parallel.tp=2", "train.micro_batch_size=2"),
    "pp2 1f1b": ("parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=1"),
    "pp2 gpipe": ("parallel.pp=2", "parallel.pp_schedule=gpipe", "train.micro_batch_size=1"),
    "pp2 interleaved 1f1b": ("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "train.micro_batch_size=1"),
    "pp2 zero bubble": ("parallel.pp=2", "parallel.pp_schedule=zero_bubble", "train.micro_batch_size=1"),
    "tp2 + sp": ("parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2"),
    "ddp uneven 3:1": ("parallel.balance_weights=[3,1]", "train.micro_batch_size=1"),
    "ddp + full recompute": ("parallel.activation_checkpointing=full", "train.micro_batch_size=1"),
    "zero3 + compile": ("parallel.zero_stage=3", "parallel.compile=true", "train.micro_batch_size=1"),
    "zero3 uneven 1:3": ("parallel.zero_stage=3", "parallel.balance_weights=[1,3]", "train.micro_batch_size=1"),
    "cp2": ("parallel.cp=2", "train.micro_batch_size=2"),
    # MoE: the balancing loss is over each forward's tokens, so no accumulation (as in test_moe)
    "ep2 + zero3 (moe)": ("model.name=debug-moe", "parallel.ep=2", "parallel.zero_stage=3"),
}
MUON_FP32 = tuple(o for o in MUON_PARITY if o != FP64)  # fp32: what users run, held to 1e-5
FP32_LAYOUTS = ("zero3", "zero3 + cpu offload", "tp2", "pp2 1f1b", "cp2", "ep2 + zero3 (moe)")
HSDP_2X2 = ("parallel.zero_stage=3", "parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch_size=1")
FP32_SAVE = (f"train.steps={PARITY_STEPS}", "train.global_batch_size=4", "model.n_layers=4", "optim.name=muon",
             "checkpoint.every_steps=5", "checkpoint.save_final=true")  # fp32: what users run


@pytest.fixture(scope="module")
def muon_layouts(tmp_path_factory):
    """One process (dense and MoE) in one launch, then every 2-rank layout in another."""
    from hf_models import save_tiny

    root = tmp_path_factory.mktemp("muon")
    hf = (f"model.hf={save_tiny('qwen3_moe', root / 'qwen3_moe')}", *(o for o in MUON_PARITY if "n_layers" not in o))
    refs = train_many({"dense": (root / "one_dense", (*MUON_PARITY, "train.micro_batch_size=4")),
                       "moe": (root / "one_moe", (*MUON_PARITY, "train.micro_batch_size=4", "model.name=debug-moe")),
                       "hf": (root / "one_hf", hf),
                       "dense fp32": (root / "one_dense_fp32", (*MUON_FP32, "train.micro_batch_size=4")),
                       "moe fp32": (root / "one_moe_fp32", (*MUON_FP32, "train.micro_batch_size=4",
                                                            "model.name=debug-moe")),
                       # the same one process summing its gradient in another order: fp32 Muon's noise floor
                       "dense fp32 mb1": (root / "one_dense_fp32_mb1", (*MUON_FP32, "train.micro_batch_size=1")),
                       "dense fp32 mb2": (root / "one_dense_fp32_mb2", (*MUON_FP32, "train.micro_batch_size=2")),
                       "moe fp32 mb2": (root / "one_moe_fp32_mb2", (*MUON_FP32, "train.micro_batch_size=2",
                                                                "model.name=debug-moe"))}, nproc=1)
    jobs = {name: (root / name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "and"),
                   (*MUON_PARITY, *extra)) for name, extra in MUON_LAYOUTS.items()}
    saved = root / "zero3_fp32" / "checkpoints" / "step_00000005"  # Muon's momentum and AdamW's moments, sharded
    jobs["hf qwen3-moe ep2"] = (root / "hf_ep2", (*hf, "parallel.ep=2"))  # fused gate_up_proj, split in two
    jobs["zero3 fp32"] = (root / "zero3_fp32", (*FP32_SAVE, "parallel.zero_stage=3", "train.micro_batch_size=1"))
    jobs["tp2 resumed"] = (root / "tp2_resumed", (*FP32_SAVE, "parallel.tp=2", f"checkpoint.resume={saved}"))
    for layout in ("parallel.zero_stage=0", "parallel.zero_stage=3"):  # who orthogonalises what, counted
        overrides = [f"run.dir={root}", f"run.name=count_{layout[-1]}", "train.steps=3", "optim.name=muon",
                     "model.n_layers=4", layout]
        jobs[f"count {layout}"] = {"call": "muon_split:count",
                                   "args": [str(DEBUG_CONFIG), overrides, str(root / f"calls_{layout[-1]}")]}
    for name in FP32_LAYOUTS:
        jobs[f"{name} in fp32"] = (root / f"fp32_{len(jobs)}", (*MUON_FP32, *MUON_LAYOUTS[name]))
    runs = train_many(jobs, nproc=2)
    runs |= train_many({"hsdp 2x2": (root / "hsdp_2x2", (*MUON_PARITY, *HSDP_2X2)),
                        "hsdp 2x2 in fp32": (root / "hsdp_2x2_fp32", (*MUON_FP32, *HSDP_2X2))}, nproc=4)
    zero1_saved = runs["zero1"] / "checkpoints" / "step_00000005"  # each matrix's momentum on its owner only
    runs |= train_many({"one resumed": (root / "one_resumed", (*FP32_SAVE, f"checkpoint.resume={saved}")),
                        "zero1 resumed": (root / "zero1_resumed", (*MUON_PARITY, "train.micro_batch_size=4",
                                                                   f"checkpoint.resume={zero1_saved}"))}, nproc=1)
    return refs, runs


@pytest.mark.parametrize("layout", list(MUON_LAYOUTS))
def test_muon_layouts_match_one_process(layout, muon_layouts):
    """fp64, 1e-10: losses, gradient norms and learning rates per step, and every parameter at the end."""
    refs, runs = muon_layouts
    if "compile" in layout:  # dynamo captured the blocks' graphs in this job (train_many counts per job)
        import json

        assert json.loads((runs[layout] / "dynamo_stats.json").read_text()).get("unique_graphs", 0) >= 1
    assert_parity(runs[layout], refs["moe" if "moe" in layout else "dense"], step=PARITY_STEPS)


def test_a_zero1_muon_checkpoint_resumes_exactly_on_one_process(muon_layouts):
    """Under ZeRO-1 each matrix's momentum lives on its owner only: the checkpoint still holds all of them, and
    one process resumed from it at step 5 ends where one process trained throughout does (fp64, 1e-10)."""
    refs, runs = muon_layouts
    assert_parity(runs["zero1 resumed"], refs["dense"], step=PARITY_STEPS, after=5)


def test_muon_on_hsdp_2x2_matches_one_process(muon_layouts):
    """4 ranks, 2 replicas of 2 shards: each matrix's iteration on one of the 4, fp64, 1e-10."""
    refs, runs = muon_layouts
    assert_parity(runs["hsdp 2x2"], refs["dense"], step=PARITY_STEPS)


def _deviations(run, ref) -> dict:
    """Largest relative difference of the losses and of the gradient norms (all steps, and steps 1-2), and of the
    final parameters (per tensor in norm; the worst element in units of the learning rate)."""
    mine, theirs = step_records(run), step_records(ref)
    assert sorted(mine) == sorted(theirs) == list(range(1, PARITY_STEPS + 1))
    out = {}
    for key in ("loss", "grad_norm"):
        rel = {s: abs(mine[s][key] - theirs[s][key]) / abs(theirs[s][key]) for s in mine}
        out[key], out[f"{key} steps 1-2"] = max(rel.values()), max(rel[1], rel[2])
    a, b = final_params(run, PARITY_STEPS), final_params(ref, PARITY_STEPS)
    assert a.keys() == b.keys()
    out["params"] = max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in b)
    out["element / lr"] = max(float((a[k].double() - b[k].double()).abs().max()) for k in b) / 3e-3
    return out


@pytest.mark.parametrize("layout", [*FP32_LAYOUTS, "hsdp 2x2"])
def test_muon_layouts_match_one_process_in_fp32(layout, muon_layouts):
    """fp32 (what users run). Muon's Newton-Schulz runs in bf16 (torch.optim.Muon's) and gives every direction of
    a matrix a unit singular value, however small its share of the update, so a last-bit change of a gradient from
    another summation order is amplified: one process with micro-batches of 1 or 2 instead of 4 (nothing
    distributed) already ends 1.1e-2 apart in the norm of the smallest matrices (attention outputs) and 1.4e-5 in
    loss after 10 steps (measured 2026-11-29). No layout can be closer than that floor, so each is held to 1e-5 in
    the first two steps (the floor there: ~2e-7; a lost or doubled gradient is ~1e-2) and, over all ten, to within
    2x of the largest of those one-process differences, measured in the same fixture; fp64 parity at 1e-10 above
    is the exact test."""
    refs, runs = muon_layouts
    moe = "moe" in layout
    ours = _deviations(runs[f"{layout} in fp32"], refs["moe fp32" if moe else "dense fp32"])
    floors = [_deviations(refs[other], refs["moe fp32" if moe else "dense fp32"])
              for other in (("moe fp32 mb2",) if moe else ("dense fp32 mb1", "dense fp32 mb2"))]
    assert ours["loss steps 1-2"] <= 1e-5 and ours["grad_norm steps 1-2"] <= 1e-5, ours
    for key in ("loss", "grad_norm", "params", "element / lr"):
        floor = max(f[key] for f in floors)
        assert ours[key] <= 2 * floor, f"{key}: {ours[key]:.2e} against one process's floor {floor:.2e}"


def test_muon_on_a_hugging_face_moe_matches_one_process(muon_layouts):
    """transformers' Qwen3-MoE (3-D experts with a fused gate_up_proj) at ep=2 on 2 ranks, fp64, 1e-10."""
    refs, runs = muon_layouts
    assert_parity(runs["hf qwen3-moe ep2"], refs["hf"], step=PARITY_STEPS)


def test_a_fused_gate_up_projection_is_two_matrices():
    """Each expert's gate and up halves of a fused [experts, 2 x width, dim] tensor are orthogonalised apart, by
    torch's own iteration, exactly as two separate matrices would be."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from disttrain.train.muon import MuonWithAdamW

    torch.manual_seed(0)
    fused = torch.randn(3, 2 * 8, 12, dtype=torch.float64)
    group = {"ns_coefficients": (3.4445, -4.7750, 2.0315), "ns_steps": 5, "eps": 1e-7}
    shell = MuonWithAdamW.__new__(MuonWithAdamW)
    param = torch.nn.Parameter(fused.clone())
    shell.names = {param: "model.layers.0.mlp.experts.gate_up_proj"}
    ours = shell._orthogonalise(param, fused, group)
    for e in range(3):
        for half in (slice(0, 8), slice(8, 16)):
            expected = _zeropower_via_newtonschulz(fused[e, half], group["ns_coefficients"], 5, 1e-7)
            assert torch.equal(ours[e, half], expected)
    # GPT-2's Conv1D c_attn: [dim, 3 x dim], q, k and v side by side
    qkv = torch.randn(12, 3 * 12, dtype=torch.float64)
    param = torch.nn.Parameter(qkv.clone())
    shell.names = {param: "transformer.h.0.attn.c_attn.weight"}
    ours = shell._orthogonalise(param, qkv, group)
    for third in (slice(0, 12), slice(12, 24), slice(24, 36)):
        assert torch.equal(ours[:, third], _zeropower_via_newtonschulz(qkv[:, third], group["ns_coefficients"], 5, 1e-7))


def test_gpt2s_blocks_take_muon():
    """GPT-2's repeated blocks are `transformer.h.N`: their projections take Muon, its embeddings and norms AdamW."""
    from hf_models import tiny_config
    from transformers import AutoModelForCausalLM

    from disttrain.train.muon import logical_matrices, split_parameters

    with torch.device("meta"):
        muon, matrices, vectors, names = split_parameters(AutoModelForCausalLM.from_config(tiny_config("gpt2")))
    assert sorted({names[p].split(".h.0.")[-1] for p in muon if ".h.0." in names[p]}) == \
        ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]
    assert len(muon) == 4 * 4 and {names[p] for p in matrices} == {"transformer.wte.weight", "transformer.wpe.weight"}
    c_attn = next(p for p in muon if names[p].endswith("h.0.attn.c_attn.weight"))
    assert logical_matrices(names[c_attn], tuple(c_attn.shape)) == [(64, 64)] * 3


@pytest.mark.parametrize("resumed", ["one resumed", "tp2 resumed"])
def test_muon_states_reshard_on_resume(resumed, muon_layouts):
    """A Muon run saved under ZeRO-3 on 2 ranks continues on one process and at tp=2 with the uninterrupted
    run's losses (fp32, 1e-5)."""
    _, runs = muon_layouts
    whole, ours = step_records(runs["zero3 fp32"]), step_records(runs[resumed])
    assert sorted(ours) == list(range(6, PARITY_STEPS + 1))
    _close([ours[s]["loss"] for s in sorted(ours)], [whole[s]["loss"] for s in sorted(ours)], 1e-5, "loss")


def test_resume_with_another_optimizer_is_refused(muon_layouts, tmp_path):
    _, runs = muon_layouts
    saved = runs["zero3 fp32"] / "checkpoints" / "step_00000005"
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=other", *FP32_SAVE[:3],
                   "optim.name=adamw", f"checkpoint.resume={saved}", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "was trained with optim.name=muon, this run has optim.name=adamw" in lines[0]


REFUSED = {
    "unknown optimizer": (["optim.name=lion"], "optim.name=lion"),
    "no Newton-Schulz step": (["optim.name=muon", "optim.muon.ns_steps=0"], "optim.muon.ns_steps=0"),
    "decay longer than the run": (["optim.schedule=wsd", "optim.decay_fraction=1.5"], "optim.decay_fraction=1.5"),
    "decay steps past the warmup": (["optim.schedule=wsd", "optim.decay_steps=19"], "optim.decay_steps=19 exceeds"),
    "muon with lora": (["optim.name=muon", "model.lora.rank=4"], "optim.name=muon with model.lora"),
    "muon with deepspeed": (["optim.name=muon", "engine=deepspeed"], "optim.name=muon needs engine=torch"),
    "4-bit states": (["optim.state_dtype=int4"], "optim.state_dtype=int4"),
    "bf16 states with deepspeed": (["optim.state_dtype=bf16", "engine=deepspeed"],
                                   "optim.state_dtype=bf16 needs engine=torch"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_optimizer_settings_are_one_line_exit_2(case, tmp_path, monkeypatch):
    from helpers import run_main

    monkeypatch.chdir(tmp_path)
    overrides, expected = REFUSED[case]
    code, out, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", *overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "debug").exists()  # nothing half-written


def test_the_split_is_announced_and_recorded(muon_layouts):
    """The start says which algorithm trains what, and metrics.jsonl lists every parameter by name."""
    from helpers import records

    refs, runs = muon_layouts
    for run, experts in ((refs["dense"], 0), (runs["ep2 + zero3 (moe)"], 3)):
        split = next(r for r in records(run) if r.get("event") == "optimizer_split")
        blocks = 4 * (7 if not experts else 4 + 3 + experts)  # attention 4, MLP 3 (shared experts 3 + routed 3)
        assert len(split["muon"]["names"]) == blocks and all(".layers." in "." + n for n in split["muon"]["names"])
        assert not any("router" in n for n in split["muon"]["names"])
        assert "tok_embeddings.weight" in split["adamw"]["names"] and "output.weight" in split["adamw"]["names"]
        assert split["muon"]["params"] + split["adamw"]["params"] == \
            next(r for r in records(run) if r.get("event") == "started")["num_params"]


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Newton-Schulz FLOPs written here, not taken from the code under test: per iteration torch's quintic forms
    the Gram matrix of the short side, squares it and multiplies back."""
    short, long = sorted((rows, cols))
    return steps * (4 * short * short * long + 2 * short ** 3)


@pytest.mark.parametrize("stage", [0, 3])
def test_each_matrix_is_orthogonalised_on_one_rank(stage, muon_layouts):
    """DDP (stage 0) and ZeRO-3 on 2 ranks: every Muon matrix's Newton-Schulz ran on exactly one rank, once per
    step, and each rank ran about half of the iteration's FLOPs."""
    import json

    refs, _ = muon_layouts
    root = refs["dense"].parent
    calls = [json.loads((root / f"calls_{stage}" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    split = next(r for r in records(refs["dense"]) if r.get("event") == "optimizer_split")
    assert sorted(calls[0].keys() | calls[1].keys()) == sorted(split["muon"]["names"])
    assert not calls[0].keys() & calls[1].keys() and all(n == 3 for c in calls for n in c.values())
    shapes = {n: tuple(p.shape) for n, p in final_params(refs["dense"], PARITY_STEPS).items()}
    flops = [sum(ns_flops(*shapes[n], 5) for n in c) for c in calls]
    assert abs(flops[0] - flops[1]) <= 0.1 * max(flops), flops


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_owners_balance_the_iteration_on_125m(ranks):
    """The owners chosen for `125m`'s matrices (all shared by every rank, as under FSDP or DDP) give each rank
    the same Newton-Schulz FLOPs within 10%."""
    from disttrain.config.load import load_config
    from disttrain.models.registry import model_spec
    from disttrain.train.muon import assign_owners, logical_matrices, split_parameters

    with torch.device("meta"):  # shapes only
        model = model_spec(load_config(DEBUG_CONFIG, ["model.name=125m"]).model).build()
    muon, _, _, names = split_parameters(model)
    costs = [sum(ns_flops(r, c, 5) for r, c in logical_matrices(names[p], p.shape)) for p in muon]
    owners = assign_owners([(cost, tuple(range(ranks))) for cost in costs])
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(ranks)]
    assert len(muon) == 12 * 7 and max(load) <= 1.1 * min(load), load


def test_the_planner_counts_muons_one_moment():
    """estimate's optimizer bytes for `125m` on one GPU: AdamW's two fp32 moments per parameter, but one for each
    block matrix under Muon, counted here from the model itself (no planner code)."""
    from disttrain.config.load import load_config
    from disttrain.models.registry import model_spec
    from disttrain.plan.estimate import estimate
    from disttrain.train.muon import split_parameters
    from disttrain.config.resolve import resolve_run

    cfg = load_config(DEBUG_CONFIG, ["model.name=125m", "precision.compute_dtype=fp32"])
    with torch.device("meta"):
        muon, matrices, vectors, _ = split_parameters(model_spec(cfg.model).build())
    n_muon, n_rest = sum(p.numel() for p in muon), sum(p.numel() for p in matrices + vectors)
    resolved = resolve_run(cfg, 1, "cuda")
    adamw = estimate(resolved.shape, resolved.layout).memory.states.optimizer
    with_muon = estimate(resolved.shape, resolved.layout, muon=True).memory.states.optimizer
    assert adamw == 8 * (n_muon + n_rest)
    assert with_muon == 8 * n_rest + 4 * n_muon
    halved = estimate(resolved.shape, resolved.layout, muon=True, state_dtype="bf16").memory.states.optimizer
    assert halved == 4 * n_rest + 2 * n_muon  # optim.state_dtype=bf16: two bytes a moment
    from disttrain.plan import optimizer as planned
    from disttrain.train import muon as runtime

    assert planned.BUCKET_ELEMENTS == runtime.BUCKET_ELEMENTS  # the step's temporaries are counted per bucket


@pytest.mark.parametrize("layout", [("parallel.zero_stage=3",), ("parallel.zero_stage=0",), ("parallel.zero_stage=1",),
                                    ("parallel.zero_stage=3", "optim.state_dtype=bf16"),
                                    ("parallel.zero_stage=1", "optim.name=adamw", "optim.state_dtype=bf16")])
def test_dry_run_and_planner_agree_on_muons_states(layout):
    """The dry run of a Muon run (and of bf16 states) measures the optimizer states the planner counts (4
    ranks)."""
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config

    cfg = load_config(DEBUG_CONFIG, ["optim.name=muon", "train.global_batch_size=8", *layout])
    rank = dry_run(cfg, 4, ranks=[0])["ranks"][0]  # the second step holds the states
    assert abs(rank["error"]["optimizer"]) < 0.01, rank["error"]


def test_the_planner_times_every_newton_schulz_iteration():
    """On one GPU, Muon's step adds its iterations' FLOPs at the matmul rate: 5 iterations on each block matrix of
    `125m`, counted here from the model's own parameters."""
    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run
    from disttrain.models.registry import model_spec
    from disttrain.plan.optimizer import muon_step_s
    from disttrain.train.muon import split_parameters

    cfg = load_config(DEBUG_CONFIG, ["model.name=125m"])
    with torch.device("meta"):
        muon, _, _, _ = split_parameters(model_spec(cfg.model).build())
    flops = 0
    for p in muon:
        short, long = sorted(p.shape)
        flops += 5 * (4 * short * short * long + 2 * short ** 3)
    resolved = resolve_run(cfg, 1, "cuda")
    seconds = muon_step_s(resolved.shape, resolved.layout, resolved.shape.n_layers, 1e12, None, None)
    assert seconds == pytest.approx(flops / 1e12, rel=1e-12)


def test_logging_steps_carry_muons_update_and_share(muon_layouts):
    """Each step record of a Muon run has the orthogonalised update's RMS (at most the peak adjusted rate times
    one, the RMS of an orthogonal matrix's entries being at most 1), AdamW's update RMS and Muon's share of the
    optimizer step."""
    refs, _ = muon_layouts
    for record in step_records(refs["dense"]).values():
        assert 0 < record["muon_update_rms"] < 0.2 * 64 ** 0.5 * 3e-3
        assert 0 < record["muon_optimizer_share"] < 1
        # Adam's step is at most the rate per element when 1 - beta1 < sqrt(1 - beta2) (0.1 < 0.22 here)
        assert 0 < record["adamw_update_rms"] <= record["lr"] * (1 + 1e-9)


def test_a_wsd_run_extended_on_resume_decays_at_the_new_end():
    """warmup-stable-decay over 100 steps (decay over the last 20%), resumed at step 50 with train.steps=200: the
    peak holds until step 160 and the decay ends at the new end; resumed inside its decay, the rate goes on from
    where it was, never jumping."""
    from types import SimpleNamespace

    from disttrain.train.optim import build_scheduler

    cfg = SimpleNamespace(warmup_steps=10, schedule="wsd", min_lr=1e-4, lr=1e-3, decay_steps=None,
                          decay_fraction=0.2, decay_shape="linear")

    def run(total, resume_from=None, steps=0):
        weights = torch.nn.Parameter(torch.zeros(2, 2))
        optimizer = torch.optim.AdamW([weights], lr=cfg.lr)
        scheduler = build_scheduler(optimizer, cfg, total)
        if resume_from is not None:
            optimizer.load_state_dict(resume_from[0].state_dict())
            scheduler.load_state_dict(resume_from[1].state_dict())
        rates = []
        for _ in range(steps):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return (optimizer, scheduler), rates

    first, before = run(100, steps=50)
    _, after = run(200, first, steps=150)
    assert before[10:] == [1e-3] * 40 and after[:110] == [1e-3] * 110  # steps 50..159 at the peak
    assert after[110] == 1e-3 and all(a > b for a, b in zip(after[110:], after[111:]))
    assert after[-1] == pytest.approx(1e-4 + 9e-4 / 40, rel=1e-12)  # one step short of min_lr at step 200
    late, in_decay = run(100, steps=90)  # inside the decay (started at step 80)
    _, resumed = run(120, late, steps=30)
    assert resumed[0] == pytest.approx(in_decay[-1] - 9e-4 / 20, rel=1e-12)  # where it was, one step on
    assert resumed[1] < resumed[0]  # and decaying on, now towards step 120
    assert all(a > b for a, b in zip(resumed, resumed[1:])) and resumed[-1] > 1e-4


def test_the_start_line_says_when_muon_steps_nothing():
    from disttrain.observe.console import optimizer_line

    only_adamw = {"adamw": {"names": ["w"], "params": 4, "bytes": 16}}
    assert optimizer_line(only_adamw).endswith("Muon on nothing: no parameter is in a repeated block named layers.N "
                                                "or h.N")
    both = {"adamw": {"names": ["a"], "params": 2_000_000, "bytes": 8_000_000},
            "muon": {"names": ["b", "c"], "params": 3_000_000, "bytes": 12_000_000}}
    assert optimizer_line(both) == ("optimizer: AdamW on 1 tensors (2.00M parameters, 7.6 MiB), Muon on 2 tensors "
                                    "(3.00M parameters, 11.4 MiB)")


def test_plan_and_estimate_take_the_optimizer_and_its_state_dtype(tmp_path):
    """`plan --optimizer muon --state-dtype bf16 --out` writes both keys into a config the runtime validates, and
    `estimate --state-dtype bf16` halves the moments' bytes of the fp32 count."""
    import json

    import yaml

    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run
    from helpers import run_main

    out = tmp_path / "winner.yaml"
    code, _, err = run_main("plan", "--model", "1b", "--gpus", "8", "--gpu", "a100-80g", "--seq-len", "2048",
                            "--global-batch-tokens", "1M", "--optimizer", "muon", "--state-dtype", "bf16",
                            "--out", str(out))
    assert code == 0, err
    written = yaml.safe_load(out.read_text())["optim"]
    assert (written["name"], written["state_dtype"]) == ("muon", "bf16")
    resolve_run(load_config(out), 8, "cuda")
    optimizer = {}
    for dtype in ("fp32", "bf16"):
        code, stdout, err = run_main("estimate", "--model", "125m", "--state-dtype", dtype, "--json")
        assert code == 0, err
        optimizer[dtype] = json.loads(stdout)["bytes_per_rank"]["optimizer"]
    assert optimizer["bf16"] == optimizer["fp32"] / 2
