"""The model families of 2026 through `model.hf=DIR`, from tiny random configs: initialised by each architecture's
own rules (compared with transformers' freshly built model), attending through the kernel each needs, trained under
each layout it takes with the losses and parameters of one process (fp64, to EXACT) and refused in one line under
the others (the support table in docs/models.md), and exported back to transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from hf_models import family_config, save_tiny
from helpers import (DEBUG_CONFIG, EXACT, FP64, REPO, assert_parity, events, final_params, losses, run_main,
                     train_many)

FAMILIES = ("gpt_oss", "deepseek_v3", "qwen3_next", "gemma3_text", "glm4_moe", "qwen3_5_text", "gemma4_text")
# No micro-batching but the pipeline's: an MoE model's balancing loss is over each micro-batch of the global batch,
# so a layout equals one process whose micro-batches hold the same sequences (data parallel: one each).
COMMON = ("train.steps=4", "train.global_batch_size=4", "data.seq_len=32", "optim.lr=3e-3",
          "checkpoint.save_final=true", "metrics.sync_check_every=2", FP64)
PP_MB = "train.micro_batch_size=2"  # two micro-batches through the two stages; its reference micro-batches alike
LAYOUTS = {"ddp": (), "zero3": ("parallel.zero_stage=3",), "pp2": ("parallel.pp=2", PP_MB), "tp2": ("parallel.tp=2",),
           "tp2-sp": ("parallel.tp=2", "parallel.sequence_parallel=true"),
           "cp2": ("parallel.cp=2", "parallel.cp_method=allgather"),
           "cp2-ulysses": ("parallel.cp=2", "parallel.cp_method=ulysses"),
           "cp2-ring": ("parallel.cp=2", "parallel.cp_method=ring"),
           "ep2-zero3": ("parallel.ep=2", "parallel.zero_stage=3"),
           "cp2-ep2-zero3": ("parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=3")}  # experts over the cp ranks
# What is proven exact (fp64, 1e-10, against one process); every other pair of TABLE_FAMILIES x LAYOUTS must be
# refused in one line (test_the_support_table_is_current, which also writes the table in docs/models.md).
MOE = ("ddp", "zero3", "pp2", "ep2-zero3", "tp2", "tp2-sp")  # TP: heads split, fused experts whole on each rank
# gpt-oss: sinks and windows; DeepSeek-V3: latent attention (the ring pads values to the keys' head dim inside);
# Gemma 3 and 4: windows (Gemma 4: per-layer inputs)
CP = ("cp2", "cp2-ulysses", "cp2-ring")
CP_EP = ("cp2-ep2-zero3",)  # the ring, the experts split over the two context ranks
# Qwen3-Next and Qwen3.5: their Gated DeltaNet layers' convolution and recurrent state passed between the shards
EXACT_PAIRS = {"gpt_oss": (*MOE, *CP, *CP_EP), "deepseek_v3": (*MOE, *CP, *CP_EP), "qwen3_next": (*MOE, *CP, *CP_EP),
               "glm4_moe": (*MOE, *CP, *CP_EP),
               "gemma3_text": ("ddp", "zero3", "pp2", "tp2", "tp2-sp", *CP),
               "qwen3_5_text": ("ddp", "zero3", "pp2", "tp2", "tp2-sp", *CP),
               "gemma4_text": ("ddp", "zero3", "pp2", "tp2", "tp2-sp", *CP),
               "gemma4_moe": (*MOE, *CP, *CP_EP),  # its MoE branch on the decoder layer, beside the dense MLP
               "qwen3": ("tp2", "tp2-sp")}  # Qwen3: the query/key norms replicated over tensor-parallel ranks
TABLE_FAMILIES = (*FAMILIES, "gemma4_moe")
TABLE_NAMES = {"gemma4_moe": "gemma4_text (MoE)"}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {kind: save_tiny(kind, root / kind) for kind in (*TABLE_FAMILIES, "llama", "qwen3")}


def _build(directory, seed: int = 0, attention: str = "auto"):
    from disttrain.models.hf.spec import hf_spec
    from disttrain.models.spec import build_model

    spec = hf_spec(str(directory), attention=attention)
    return spec, build_model(spec, torch.device("cpu"), seed)


def _batch():
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(7))
    return ids[:, :-1], ids[:, 1:]


def _loss(model, inputs, targets) -> torch.Tensor:
    return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("kind", FAMILIES)
def test_initialisation_follows_the_architecture(kind, family_dirs):
    """Every buffer is transformers' own (Gemma's embedding scale, each rotary table); a parameter transformers
    fills with a constant (Gemma's zero-centred norms, expert and router biases, sinks' absence of one) holds that
    constant, a drawn one has transformers' spread; the first loss is within 1% of transformers' freshly built
    model's on the same batch, and it falls over three steps on that batch."""
    from transformers import AutoModelForCausalLM

    _, ours = _build(family_dirs[kind])
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(family_config(kind), attn_implementation=ours.config._attn_implementation,
                                              dtype=torch.float32)
    our_buffers = dict(ours.named_buffers())
    for name, buffer in theirs.named_buffers():
        assert torch.equal(our_buffers[name], buffer), name
    our_params = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        mine = our_params[name]
        if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
            assert torch.equal(mine, param), f"{name}: transformers fills it with {float(param.flatten()[0])}"
        elif param.numel() >= 4096:
            assert abs(float(mine.std() / param.std()) - 1) < 0.1, name
    inputs, targets = _batch()
    first = _loss(ours, inputs, targets)
    assert abs(float(first / _loss(theirs, inputs, targets)) - 1) < 0.01
    optimizer = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    for _ in range(3):
        optimizer.zero_grad()
        _loss(ours, inputs, targets).backward()
        optimizer.step()
    assert float(_loss(ours, inputs, targets)) < float(first) - 0.01


def test_a_module_starts_the_same_whatever_else_the_model_holds(family_dirs, tmp_path):
    """Seeded by module name: the first layers of a 2-layer Gemma 3 equal those of the 4-layer one, as a pipeline
    stage's equal the whole model's; another seed gives other weights."""
    config = family_config("gemma3_text")
    config.num_hidden_layers, config.layer_types = 2, config.layer_types[:2]
    config.save_pretrained(tmp_path / "short")
    whole, short = _build(family_dirs["gemma3_text"])[1], _build(tmp_path / "short")[1]
    whole_params = dict(whole.named_parameters())
    for name, param in short.named_parameters():
        assert torch.equal(param, whole_params[name]), name
    other = _build(family_dirs["gemma3_text"], seed=1)[1]
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, whole.model.layers[0].self_attn.q_proj.weight)


def test_attention_follows_the_model(family_dirs):
    """sdpa where the model supports it; eager for gpt-oss's sinks, said why; a user's choice taken."""
    spec, model = _build(family_dirs["gpt_oss"])
    assert model.config._attn_implementation == "eager" and "attention sinks" in spec.attention
    assert _build(family_dirs["gemma3_text"])[0].attention == "sdpa"
    spec, model = _build(family_dirs["llama"], attention="eager")
    assert model.config._attn_implementation == "eager" and spec.attention == "eager (model.attn_implementation)"


@pytest.fixture(scope="module")
def weight_dirs(tmp_path_factory):
    """Each family with transformers' own random weights saved: the base LoRA adapters are exported against."""
    root = tmp_path_factory.mktemp("weights")
    return {kind: save_tiny(kind, root / kind, weights_seed=1) for kind in FAMILIES}


@pytest.fixture(scope="module")
def references(family_dirs, weight_dirs, tmp_path_factory):
    """One process per family, fp64; Llama through eager attention beside it; LoRA on each family's weights
    (fp32, as adapters are exported)."""
    root = tmp_path_factory.mktemp("ref")
    jobs = {kind: (root / kind, (*COMMON, f"model.hf={family_dirs[kind]}")) for kind in EXACT_PAIRS}
    jobs.update({f"{kind} {PP_MB}": (root / f"{kind}_mb2", (*COMMON, f"model.hf={family_dirs[kind]}", PP_MB))
                 for kind, names in EXACT_PAIRS.items() if "pp2" in names})
    jobs.update({f"{kind} lora": (root / f"{kind}_lora", ("train.steps=3", "train.global_batch_size=4",
                                                           "data.seq_len=32", "optim.lr=1e-2", "model.lora.rank=4", "checkpoint.save_final=true",
                                                           f"model.hf={weight_dirs[kind]}"))
                 for kind in FAMILIES})
    jobs["llama eager"] = (root / "llama_eager", (*COMMON, f"model.hf={family_dirs['llama']}",
                                                  "model.attn_implementation=eager"))
    jobs["llama"] = (root / "llama", (*COMMON, f"model.hf={family_dirs['llama']}"))
    jobs["gpt_oss lora64"] = (root / "gpt_oss_lora64", (*COMMON, f"model.hf={family_dirs['gpt_oss']}", *LORA64))
    return train_many(jobs, nproc=1)


@pytest.fixture(scope="module")
def family_runs(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    jobs = {f"{kind} {name}": (root / f"{kind}_{name}", (*COMMON, f"model.hf={family_dirs[kind]}", *LAYOUTS[name]))
            for kind, names in EXACT_PAIRS.items() for name in names}
    jobs.update({name: (root / name.replace(" ", "_"), (*COMMON, f"model.hf={family_dirs[kind]}", *extra))
                 for name, (kind, _, extra) in COMPOSED.items()})
    return train_many(jobs, nproc=2)


LORA64 = ("model.lora.rank=4", "model.lora.dropout=0")
FULL_AC = "parallel.activation_checkpointing=full"
# beyond the table: what tensor parallelism's own hooks must survive (gpt-oss's sinks and Qwen3.5's rows of its
# heads taken again in the recomputation; adapters beside the split heads): run -> (family, reference, overrides)
COMPOSED = {"gpt_oss lora tp2-sp ac": ("gpt_oss", "gpt_oss lora64", (*LORA64, *LAYOUTS["tp2-sp"], FULL_AC)),
            "qwen3_5_text tp2 ac": ("qwen3_5_text", "qwen3_5_text", (*LAYOUTS["tp2"], FULL_AC))}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_tensor_parallel_hooks_compose_with_lora_and_checkpointing(name, family_runs, references):
    assert_parity(family_runs[name], references[COMPOSED[name][1]], rel=EXACT, step=4)


@pytest.mark.parametrize("kind,layout", [(kind, name) for kind, names in EXACT_PAIRS.items() for name in names])
def test_family_trains_like_one_process(kind, layout, family_runs, references):
    reference = references[f"{kind} {PP_MB}" if PP_MB in LAYOUTS[layout] else kind]
    assert_parity(family_runs[f"{kind} {layout}"], reference, rel=EXACT, step=4)


def test_the_chosen_attention_is_recorded_and_the_losses_fall(references):
    started = events(references["gpt_oss"], "started")[0]
    assert started["attention"].startswith("eager (sdpa cannot take GptOssForCausalLM's attention sinks")
    assert events(references["llama"], "started")[0]["attention"] == "sdpa"
    for kind in FAMILIES:
        steps = losses(references[kind])
        assert steps[4] < steps[1] - 0.1, (kind, steps)
    # transformers' eager attention takes its softmax in float32 even in a float64 model (sdpa's stays float64):
    # the two kernels agree to float32's rounding of the attention weights (measured 1.3e-10 at step 1), not to EXACT
    eager, sdpa = losses(references["llama eager"]), losses(references["llama"])
    assert eager != sdpa and all(abs(eager[s] - sdpa[s]) <= 1e-8 * sdpa[s] for s in sdpa), (eager, sdpa)


def test_the_support_table_is_current(family_dirs, tmp_path):
    """Each family x layout is exact (a test above) or refused by the launcher in one line, exit 2; the table in
    docs/models.md is this matrix (`DISTTRAIN_WRITE_DOCS=1` rewrites it)."""
    rows, notes = [], []
    for kind in TABLE_FAMILIES:
        cells = []
        for name, extra in LAYOUTS.items():
            if name in EXACT_PAIRS[kind]:
                cells.append("exact")
                continue
            code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path / 'runs'}", *extra,
                                    f"model.hf={family_dirs[kind]}", "--nproc-per-node", "2")
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1, (kind, name, err)
            note = lines[0].removeprefix("disttrain: error: ").replace(str(family_dirs[kind]), "DIR")
            notes += [note] if note not in notes else []
            cells.append(f"refused ({notes.index(note) + 1})")
        rows.append(f"| {TABLE_NAMES.get(kind, kind)} | " + " | ".join(cells) + " |")
    table = "\n".join([f"| model type | {' | '.join(LAYOUTS)} |", "|---" * (len(LAYOUTS) + 1) + "|", *rows, "",
                       *(f"{i}. {note}" for i, note in enumerate(notes, 1))])
    assert not (tmp_path / "runs").exists()
    docs = REPO / "docs" / "models.md"
    text = docs.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    if os.environ.get("DISTTRAIN_WRITE_DOCS") == "1":
        docs.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    else:
        assert text[start:end].strip() == table, "docs/models.md's support table is stale: rerun this test with " \
                                                 "DISTTRAIN_WRITE_DOCS=1"


TABLE_START, TABLE_END = "<!-- support table: tests/test_hf_families.py -->", "<!-- end of the support table -->"


# ZeRO-3 shards for every family; tensor-parallel shards (gpt-oss's sinks split with their heads, DeepSeek's
# latent attention, Qwen3.5's Gated DeltaNet with its whole convolution and A_log/dt_bias split) for three
CONVERTED = [(kind, "zero3") for kind in FAMILIES] + [("gpt_oss", "tp2-sp"), ("deepseek_v3", "tp2"),
                                                       ("qwen3_5_text", "tp2")]


@pytest.mark.parametrize("kind,layout", CONVERTED)
def test_convert_to_hf_gives_transformers_the_same_model(kind, layout, family_runs, family_dirs, tmp_path):
    """The run's weights, gathered from ZeRO-3 or tensor-parallel shards, load with `from_pretrained` under their
    own names and the config (layer kinds, windows, experts) comes back whole: transformers' logits equal those of
    the model disttrain trained, given the checkpoint's weights (float32, as the export writes them)."""
    from transformers import AutoModelForCausalLM

    from disttrain.models.spec import copy_weights

    run, out = family_runs[f"{kind} {layout}"], tmp_path / "hf"
    code, _, err = run_main("convert", str(run), "--to", "hf", "--out", str(out))
    assert code == 0, err
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    saved = {name: t.float() for name, t in final_params(run, 4).items()}
    for name, param in theirs.named_parameters():
        assert param.detach().equal(saved[name]), name
    _, ours = _build(family_dirs[kind])
    copy_weights(ours, saved)
    inputs, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=inputs).logits, ours(input_ids=inputs).logits, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("kind", TABLE_FAMILIES)
def test_estimate_counts_each_family_as_transformers_does(kind, family_dirs):
    """`estimate --hf DIR`: the parameter count of transformers' own model (sinks, biases, query/key norms, Gemma's
    four norms, Gemma 4's per-layer inputs, shared keys and values and MoE branch, linear-attention layers, gated
    attention and shared-expert gates included)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(family_dirs[kind]))
    code, stdout, err = run_main("estimate", "--hf", str(family_dirs[kind]), "--gpus", "2", "--json")
    assert code == 0, err
    assert json.loads(stdout)["params"] == sum(p.numel() for p in model.parameters())


PUBLISHED = {  # model card figures: total and active parameters (billions, as rounded there); active excludes the
    # input embedding, a lookup (the output projection is a matmul every token runs through)
    "gpt-oss-120b": ("gpt_oss", {}, 116.8, 5.1),
    "gpt-oss-20b": ("gpt_oss", {"num_hidden_layers": 24, "num_local_experts": 32}, 20.9, 3.6),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_full_size_counts_match_transformers_and_the_model_card(name, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from disttrain.models.hf.shape import hf_shape

    kind, changes, total, active = PUBLISHED[name]
    config = AutoConfig.for_model(kind, **changes)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = hf_shape(str(tmp_path))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    assert round(shape.num_params() / 1e9, 1) == total
    assert round(shape.num_params(include_embedding=False, active=True) / 1e9, 1) == active


@pytest.mark.parametrize("kind", FAMILIES)
def test_lora_exports_load_in_peft_and_merged(kind, references, weight_dirs, tmp_path):
    """Each family's adapters through peft's own loading onto transformers' base equal the merged weights
    through transformers alone (fp32), and they moved the logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = references[f"{kind} lora"]
    for target, extra in (("peft", ()), ("hf", ("--merge-lora",))):
        code, _, err = run_main("convert", str(run), "--to", target, *extra, "--out", str(tmp_path / target))
        assert code == 0, err
    inputs, _ = _batch()
    base = AutoModelForCausalLM.from_pretrained(weight_dirs[kind], dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=inputs).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(input_ids=inputs).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(
            input_ids=inputs).logits
    assert float((adapted - base_logits).abs().max()) > 1e-3
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
