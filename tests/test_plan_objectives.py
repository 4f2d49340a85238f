"""The planner and the dry run under the post-training objectives: preference pairs (twice the rows), DPO's frozen
reference (or its values computed ahead: none), a distillation teacher (its parameters, hidden states, head weight
and the wider chunks of the student's head). The dry run builds the run's own objective and frozen model on fake
tensors (under pipelines, its stages as the run's own pipeline for it); the planner's peak agrees with it within 5%
on each layout here, and the step time counts the pairs and the frozen model's forward."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from chat_tokenizer import records, save_chat_tokenizer
from helpers import DEBUG_CONFIG, run_main
from test_preference import pair_records

BASE = ("model.name=tiny", "model.vocab_size=384", "data.seq_len=256", "train.global_batch_size=8",
        "train.micro_batch_size=2", "precision.compute_dtype=bf16")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("objectives"))


def make_data(root):
    """Prepared pairs and conversations (one tokenizer), and a wider, deeper Hugging Face teacher with weights
    (benchmarks/objective_step_time.py makes its runs' data with it too)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = save_chat_tokenizer(root / "tokenizer")
    for name, rows in (("pairs", pair_records(32)), ("chats", records(32))):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        code, _, err = run_main("prepare-data", str(root / f"{name}.jsonl"), "--out", str(root / name), "--tokenizer",
                                str(tokenizer), "--seq-len", "256")
        assert code == 0, err
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=384, hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=False)).save_pretrained(root / "teacher")
    shutil.copyfile(root / "chats" / "tokenizer.json", root / "teacher" / "tokenizer.json")
    return root


CASES = {  # name -> overrides after BASE ({root}: the fixture's directory)
    "dpo zero3": ("data.source={root}/pairs", "train.objective=dpo", "parallel.zero_stage=3"),
    "dpo ddp": ("data.source={root}/pairs", "train.objective=dpo"),
    # ZeRO-2: the frozen copy's blocks resharded after their forward all the same (no backward to keep them for)
    "dpo zero2": ("data.source={root}/pairs", "train.objective=dpo", "parallel.zero_stage=2"),
    "dpo ddp packed": ("data.source={root}/pairs", "train.objective=dpo", "data.packing=true"),  # its worst case
    "dpo precomputed zero3": ("data.source={root}/pairs", "train.objective=dpo", "dpo.precompute_reference=true",
                              "parallel.zero_stage=3"),
    "simpo tp2 sp": ("data.source={root}/pairs", "train.objective=simpo", "parallel.tp=2",
                     "parallel.sequence_parallel=true"),
    "distill zero3": ("data.source={root}/chats", "train.objective=distill", "distill.teacher={root}/teacher",
                      "parallel.zero_stage=3"),
    "distill tp2": ("data.source={root}/chats", "train.objective=distill", "distill.teacher={root}/teacher",
                    "parallel.tp=2"),
    # LoRA: the reference is the policy with its adapters off (a second forward, no parameters of its own)
    "dpo lora zero3": ("data.source={root}/pairs", "train.objective=dpo", "model.lora.rank=4",
                       "parallel.zero_stage=3"),
    # the frozen model's own pipeline: its receive buffers; a teacher's hidden states of every micro-batch
    "dpo pp2": ("data.source={root}/pairs", "train.objective=dpo", "parallel.pp=2"),
    "distill pp2": ("data.source={root}/chats", "train.objective=distill", "distill.teacher={root}/teacher",
                    "parallel.pp=2"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_planner_follows_the_dry_run(name, data):
    """Rank 0 of 2 (and the last stage of a pipeline): the planner's peak within 5% of the simulated one, and the
    parameters it counts (with the frozen model's, sharded as the trained one's) within 2%."""
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config

    cfg = load_config(str(DEBUG_CONFIG), [*BASE, *(o.format(root=data) for o in CASES[name])])
    result = dry_run(cfg, 2, [0, 1] if "pp2" in name else [0])
    for rank in result["ranks"]:
        assert abs(rank["error"]["peak_bytes"]) <= 0.05, (name, rank["error"], rank["bytes"], rank["planner"])
        assert abs(rank["error"]["parameters"]) <= 0.02, (name, rank["bytes"], rank["planner"])
    rank = result["ranks"][0]
    if not any(word in name for word in ("precomputed", "simpo", "lora")):  # a frozen model beside the trained one
        lm = dry_run(load_config(str(DEBUG_CONFIG), [*BASE, f"data.source={data}/chats",
                                                     *(o for o in CASES[name] if o.startswith("parallel"))]), 2, [0])
        assert rank["bytes"]["parameters"] > 1.5 * lm["ranks"][0]["bytes"]["parameters"]


def test_estimate_counts_the_objective_and_its_step_time(data, tmp_path):
    """`disttrain estimate RUN.yaml` of a DPO run says what it counted (pairs, the frozen reference) and has the dry
    run; with --time the pairs count twice in the tokens and the reference's forward is a line of its own."""
    config = tmp_path / "dpo.yaml"
    config.write_text(DEBUG_CONFIG.read_text())
    overrides = [*BASE, f"data.source={data}/pairs", "train.objective=dpo", "parallel.zero_stage=3"]
    code, out, err = run_main("estimate", str(config), *overrides, "--gpus", "2")
    assert code == 0, err
    assert "counted: train.objective=dpo, pairs: twice the rows, a frozen reference of" in out, out
    code, out, err = run_main("estimate", str(config), *overrides, "--gpus", "2", "--time", "--json")
    assert code == 0, err
    time = json.loads(out)["time"]
    assert json.loads(out)["tokens_per_step"] == 2 * 8 * 256
    assert 0 < time["frozen_compute_s"] < time["frozen_s"] < time["step_s"], time


def test_plan_verify_dry_runs_a_preference_layout(data, tmp_path):
    """`plan --objective dpo --verify 1` dry-runs its winner on random pairs before any data is set: the peak it
    measures is the one `disttrain dryrun` gives that written config once its data is the prepared pairs (the
    frozen reference and the pairs' rows counted), and the planner's is within 5% of it."""
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config

    written = tmp_path / "dpo.yaml"
    code, out, err = run_main("plan", "--hf", str(data / "teacher"), "--gpus", "2", "--seq-len", "256",
                              "--global-batch-size", "8", "--objective", "dpo", "--verify", "1", "--json", "--out",
                              str(written))
    assert code == 0, err
    plan = json.loads(out)
    (checked,) = plan["verified"]
    assert "peak_bytes" in checked and checked["planner_peak_bytes"] == plan["winner"]["bytes_per_rank"]["total"]
    assert abs(checked["planner_error"]) <= 0.05, checked
    direct = dry_run(load_config(str(written), [f"data.source={data}/pairs"]), 2)
    assert checked["peak_bytes"] == max(r["peak_bytes"] for r in direct["ranks"])
