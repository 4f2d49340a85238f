"""Preference optimisation: pairs prepared as TRL tokenizes them; DPO's loss and rewards equal TRL's DPOTrainer on
the same pairs and weights (fp64), with and without LoRA, for each loss type; SimPO and ORPO equal their
published formulas computed here from transformers' logits; every layout equals one process (fp64, 1e-10); bad
records and layouts not supported get one line and exit 2."""

from __future__ import annotations

import json
import math
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from chat_tokenizer import WORDS, save_chat_tokenizer
from hf_models import fp64_norms
from helpers import DEBUG_CONFIG, EXACT, FP64, assert_parity, events, final_params, run_main, step_records, train_many

SEQ_LEN = 64
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dpo"
BETA = 0.2


def pair_records(n: int) -> list[dict]:
    """Conversational pairs, with an explicit prompt (messages) and implicit (whole conversations sharing
    it); rejected answers of other lengths than the chosen ones."""
    out = []
    for i in range(n):
        a, b = i % 10, (3 * i + 1) % 10
        question = [{"role": "user", "content": f"What is {WORDS[a]} plus {WORDS[b]}?"}]
        good = [{"role": "assistant", "content": f"{WORDS[a]} plus {WORDS[b]} is {a + b}."}]
        bad = [{"role": "assistant", "content": f"It is {a + b + 1}, I think." * (1 + i % 3)}]
        if i % 2:
            out.append({"chosen": question + good, "rejected": question + bad})
        else:
            out.append({"prompt": question, "chosen": good, "rejected": bad})
    return out


def _prepare(root, data, tokenizer, *extra):
    src = root / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in data))
    return run_main("prepare-data", str(src), "--out", str(root / "out"), "--tokenizer", str(tokenizer),
                    "--seq-len", str(SEQ_LEN), *extra)


def make_assets(root: Path, pair_sets: dict[str, tuple[int, str]], moe: bool = False) -> dict:
    """A chat tokenizer, a tiny Llama saved by transformers (with `moe`, a tiny Qwen3-MoE too), and the pair sets
    prepared (name -> (pairs, validation fraction))."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_models import SIZES, tiny_config

    tokenizer = save_chat_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**SIZES, "vocab_size": 384}, tie_word_embeddings=False)) \
        .save_pretrained(root / "base")
    found = {"root": root, "tokenizer": tokenizer, "base": root / "base"}
    if moe:
        config = tiny_config("qwen3_moe")
        config.vocab_size = 384
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / "qwen3_moe")
        found["qwen3_moe"] = root / "qwen3_moe"
    for name, (n, val) in pair_sets.items():
        (root / name).mkdir()
        code, out, err = _prepare(root / name, pair_records(n), tokenizer, "--val-fraction", val)
        assert code == 0, err
        found[name], found["prepared"] = root / name / "out", out
    return found


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """8 pairs (all in training: a global batch of 8 reads each once per step) and 24 (with validation)."""
    return make_assets(tmp_path_factory.mktemp("pref"), {"eight": (8, "0"), "many": (24, "0.125")})


CHUNK = 24  # the output head's chunks of tokens: they cut rows, and no row length is a multiple
HF = (f"data.seq_len={SEQ_LEN}", "train.global_batch_size=8", "train.micro_batch_size=4",
      "optim.lr=2e-2", "optim.warmup_steps=0", "optim.schedule=constant", "metrics.log_every=1", f"dpo.beta={BETA}",
      FP64, f"train.loss_chunk_tokens={CHUNK}")
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
PRECOMPUTE = "dpo.precompute_reference=true"


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    """The HF model on the 8 pairs: DPO (each loss type; sigmoid also with LoRA) for 3 steps with the checkpoint
    of step 2; SimPO and ORPO for one step."""
    root = tmp_path_factory.mktemp("one")
    hf = (f"model.hf={assets['base']}", f"data.source={assets['eight']}", *HF)
    dpo = ("train.objective=dpo", "train.steps=3", "checkpoint.every_steps=2", "checkpoint.save_final=false")
    jobs = {f"dpo {t}": (root / f"dpo_{t}", (*hf, *dpo, f"dpo.loss_type={t}")) for t in LOSS_TYPES}
    jobs["dpo lora"] = (root / "dpo_lora", (*hf, *dpo, "model.lora.rank=4", "model.lora.alpha=8"))
    for name in ("dpo sigmoid", "dpo lora"):  # the reference's values computed once, before the first step
        jobs[f"{name} precomputed"] = (root / f"{name.replace(' ', '_')}_precomputed", (*jobs[name][1], PRECOMPUTE))
    jobs["simpo"] = (root / "simpo", (*hf, "train.objective=simpo", "train.steps=1", "dpo.gamma=0.3"))
    jobs["orpo"] = (root / "orpo", (*hf, "train.objective=orpo", "train.steps=1", "dpo.lambda=0.4"))
    return train_many(jobs, nproc=1)


def _trl_dataset(records):
    """The records as TRL reads them: implicit prompts extracted by TRL's own `maybe_extract_prompt`."""
    from datasets import Dataset
    from trl.data_utils import maybe_extract_prompt

    return Dataset.from_list([maybe_extract_prompt(r) for r in records])


def _trl(assets, records, policy, reference, loss_type: str, tmp_path, lora=None, adapters=None):
    """TRL's DPOTrainer on `records` as one batch: (loss, its metrics, its collated batch). `lora`: the trainer
    puts these adapters on `policy` (its reference: the adapters disabled), then they take the values
    `adapters` holds (by disttrain's parameter names)."""
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=[loss_type], report_to="none",
                     use_cpu=True, max_length=None, per_device_train_batch_size=len(records))
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=_trl_dataset(records),
                         processing_class=AutoTokenizer.from_pretrained(assets["tokenizer"]), peft_config=lora)
    if adapters is not None:
        held = [(n, p) for n, p in trainer.model.named_parameters() if ".lora_" in n]
        assert len(held) == len(adapters) > 0
        with torch.no_grad():
            for name, param in held:
                param.data = adapters[name.removeprefix("base_model.model.")].clone()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    metrics = {k: v[-1] for mode in trainer._metrics.values() for k, v in mode.items()}
    return float(loss), metrics, batch


def _close(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= EXACT * max(1.0, abs(theirs))


def test_prepared_pairs_are_what_trl_tokenizes(assets, tmp_path):
    """Each pair's rows hold TRL's prompt + completion ids, and exactly TRL's completion tokens carry loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from disttrain.data.source import split_samples

    assert "8 pairs written" in assets["prepared"] or "24 pairs written" in assets["prepared"]
    records = pair_records(8)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, max_length=None)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(assets["base"]), args=args,
                         train_dataset=_trl_dataset(records),
                         processing_class=AutoTokenizer.from_pretrained(assets["tokenizer"]))
    samples = split_samples(str(assets["eight"]), "train", SEQ_LEN)
    assert len(samples) == 8
    x, y = samples.batch(np.arange(8))
    for i in range(8):
        example = trainer.train_dataset[i]
        for side, row in (("chosen", 2 * i), ("rejected", 2 * i + 1)):
            ids = example["prompt_ids"] + example[f"{side}_ids"]
            mask = [0] * len(example["prompt_ids"]) + [1] * len(example[f"{side}_ids"])
            assert x[row, :len(ids)].tolist() == ids
            carried = (y[row] != -100).tolist()
            assert carried[:len(ids) - 1] == [bool(m) for m in mask[1:]] and not any(carried[len(ids) - 1:])


def test_implicit_prompts_are_taken_as_trl_takes_them():
    """Whole conversations, and whole texts (the space at the cut goes to the completions)."""
    from trl.data_utils import maybe_extract_prompt

    from disttrain.data.preference import split_record

    for record in (pair_records(2)[1], {"chosen": "The sky is blue.", "rejected": "The sky is green."}):
        assert split_record(record) == tuple(maybe_extract_prompt(record)[k] for k in ("prompt", "chosen", "rejected"))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dpo_equals_trl_after_two_steps(loss_type, one_process, assets, tmp_path):
    """disttrain's loss and rewards at step 3 (the weights after two updates, all 8 pairs) equal TRL's
    DPOTrainer on the fp64 weights of the step-2 checkpoint (a model.hf run keeps transformers' parameter names)
    against the base as reference."""
    from transformers import AutoModelForCausalLM

    run = one_process[f"dpo {loss_type}"]
    policy = fp64_norms(AutoModelForCausalLM.from_pretrained(assets["base"], dtype=torch.float64))
    policy.load_state_dict(final_params(run, step=2))
    reference = fp64_norms(AutoModelForCausalLM.from_pretrained(assets["base"], dtype=torch.float64))
    loss, metrics, _ = _trl(assets, pair_records(8), policy, reference, loss_type, tmp_path)
    first, third = step_records(run)[1], step_records(run)[3]
    assert first["loss"] == pytest.approx({"sigmoid": math.log(2), "ipo": (1 / (2 * BETA)) ** 2, "hinge": 1.0}
                                          [loss_type], rel=1e-12)  # the policy starts as its reference
    assert _close(third["loss"], loss), (third["loss"], loss)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert _close(third[key], metrics[key]), (key, third[key], metrics[key])
    assert third["rewards/margins"] > 0.1  # two updates moved the policy: not a comparison of zeros
    # the head computed each row's log-probability in chunks of tokens (the loss never held the whole logits)
    assert events(run, "started")[0]["logits"] == f"chunks of {CHUNK} tokens"


def test_dpo_with_lora_equals_trl_with_peft_adapters_off_as_reference(one_process, assets, tmp_path):
    """With LoRA the reference is the base with the adapters switched off: TRL does the same when it puts the
    adapters on (peft_config: the config of the adapter disttrain exported in PEFT's format), here with the fp64
    adapter values of the step-2 checkpoint."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    run = one_process["dpo lora"]
    code, _, err = run_main("convert", str(run), "--to", "peft", "--out", str(tmp_path / "adapter"))
    assert code == 0, err
    base = fp64_norms(AutoModelForCausalLM.from_pretrained(assets["base"], dtype=torch.float64))
    saved = {n: p for n, p in final_params(run, step=2).items() if ".lora_" in n}
    loss, metrics, _ = _trl(assets, pair_records(8), base, None, "sigmoid", tmp_path,
                            LoraConfig.from_pretrained(tmp_path / "adapter"), saved)
    third = step_records(run)[3]
    assert _close(third["loss"], loss) and _close(third["rewards/margins"], metrics["rewards/margins"])
    assert abs(third["rewards/margins"]) > 1e-3


def _completion_logps(assets, tmp_path, mean: bool = True):
    """(chosen, rejected) mean log-probabilities per completion token (`mean`; else their sums) of the base model
    on TRL's batch of the 8 pairs, computed here from transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = fp64_norms(AutoModelForCausalLM.from_pretrained(assets["base"], dtype=torch.float64))
    _, _, batch = _trl(assets, pair_records(8), model, None, "sigmoid", tmp_path)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets, mask = batch["input_ids"][:, 1:], batch["completion_mask"][:, 1:].double()
    token = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    values = (token * mask).sum(1) / (mask.sum(1) if mean else 1)
    return values[:8], values[8:]


@pytest.mark.parametrize("name", ["dpo sigmoid", "dpo lora"])
def test_a_reference_computed_once_trains_as_the_reference_model(name, one_process, assets, tmp_path):
    """dpo.precompute_reference: the values kept beside the checkpoints are the base model's completion
    log-probabilities as transformers computes them (each pair's chosen and rejected row), and training with them
    equals training beside the reference model (the frozen copy; under LoRA the adapters switched off): losses,
    rewards, gradient norms and parameters, fp64, 1e-10."""
    run, reference = one_process[f"{name} precomputed"], one_process[name]
    table = torch.load(run / "checkpoints" / "reference_logps.pt", weights_only=True)
    chosen, rejected = _completion_logps(assets, tmp_path, mean=False)
    assert table["train"].shape == (16,) and table["val"].shape == (0,)
    for ours, theirs in ((table["train"][0::2], chosen), (table["train"][1::2], rejected)):
        assert all(_close(float(a), float(b)) for a, b in zip(ours, theirs)), (ours, theirs)
    assert_parity(run, reference, step=2)  # every step's loss and gradient norm, the parameters of step 2
    for step, record in step_records(run).items():
        for key in ("rewards/margins", "rewards/accuracies", "logps/rejected"):
            assert _close(record[key], step_records(reference)[step][key]), (step, key)


def test_a_reference_computed_once_is_read_again_on_resume(one_process, assets, tmp_path):
    """Resumed at step 2, the run reads the kept values (the starting model is gone) and ends where the
    uninterrupted run does; without them a resume is refused in one line."""
    source = one_process["dpo sigmoid precomputed"]
    overrides = tuple(o for o in _one_process_overrides(assets) if "loss_type" not in o)
    runs = {}
    for name in ("resumed", "lost"):
        runs[name] = tmp_path / name
        shutil.copytree(source, runs[name])
        (runs[name] / "metrics.jsonl").unlink()
    (runs["lost"] / "checkpoints" / "reference_logps.pt").unlink()
    train_many({"resumed": (runs["resumed"], overrides)}, nproc=1)
    assert_parity(runs["resumed"], source, step=2, after=2)  # step 3's loss and gradient norm
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=lost", *overrides)
    assert code == 2 and "reference_logps.pt is gone" in err and len(err.strip().splitlines()) == 1, err
    # the refusal came from a job's start, after the watchdog had started: its thread is stopped too (left running,
    # it would end this process when its limit passed)
    assert not [t for t in threading.enumerate() if t.name == "disttrain-watchdog" and t.is_alive()]


def _one_process_overrides(assets) -> tuple:
    """The overrides of one_process's "dpo sigmoid precomputed" run."""
    return (f"model.hf={assets['base']}", f"data.source={assets['eight']}", *HF, "train.objective=dpo",
            "train.steps=3", "checkpoint.every_steps=2", "checkpoint.save_final=false", "dpo.loss_type=sigmoid",
            PRECOMPUTE)


def test_simpo_and_orpo_equal_their_published_formulas(one_process, assets, tmp_path):
    """SimPO: -log σ(β (mean chosen - mean rejected) - γ); ORPO: the chosen completion's mean negative
    log-likelihood + λ (-log σ(log odds(chosen) - log odds(rejected))); each averaged over the pairs."""
    chosen, rejected = _completion_logps(assets, tmp_path)
    simpo = -torch.nn.functional.logsigmoid(BETA * (chosen - rejected) - 0.3)
    odds = lambda p: p - torch.log1p(-torch.exp(p))  # noqa: E731 (log odds of a mean log-probability)
    orpo = -chosen - 0.4 * torch.nn.functional.logsigmoid(odds(chosen) - odds(rejected))
    for name, expected in (("simpo", simpo), ("orpo", orpo)):
        assert _close(step_records(one_process[name])[1]["loss"], float(expected.mean())), name


def example_script(name: str):
    """A script of examples/dpo, imported by path (the example is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"dpo_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """examples/dpo/run.sh's inputs, made in this process: the fine-tuning example's assets, the pairs and the
    student (make_pairs.py), both prepared with the script's flags."""
    from chat_tokenizer import example as sft_assets

    work = tmp_path_factory.mktemp("dpo_example")
    sft_assets.main(work)
    example_script("make_pairs").main(work)
    for records, out in (("chats.jsonl", "chat-data"), ("pairs.jsonl", "pair-data")):
        code, _, err = run_main("prepare-data", str(work / records), "--out", str(work / out), "--tokenizer",
                                str(work / "tokenizer"), "--seq-len", "128", "--val-fraction", "0.05", "--force")
        assert code == 0, err
    return work


@pytest.fixture(scope="module")
def example_runs(example):
    """The example's DPO and distillation on 2 ranks (its configs, 4 steps each; DPO from the base model, where
    the script starts from the fine-tuned one)."""
    jobs = {}
    short = ("train.steps=4", "optim.warmup_steps=2", "train.eval_every=4", "checkpoint.every_steps=0")
    jobs["example dpo"] = (example / "dpo", (f"model.hf={example / 'base'}", f"data.source={example / 'pair-data'}",
                                             *short), EXAMPLE / "dpo.yaml")
    jobs["example distill"] = (example / "distill", (f"model.hf={example / 'student'}", f"distill.teacher="
                                                     f"{example / 'base'}", f"data.source={example / 'chat-data'}",
                                                     *short), EXAMPLE / "distill.yaml")
    return train_many(jobs, nproc=2)


def test_the_example_end_to_end_shortened(example, example_runs, capsys):
    """examples/dpo/run.sh with 4 steps of each training: the pairs' completions carry loss, DPO logs its rewards,
    both exports of its adapters answer alike through transformers' generate, the distilled student exports."""
    meta = json.loads((example / "pair-data" / "meta.json").read_text())["preference"]
    assert meta["written"] > 500 and meta["skipped"] == meta["truncated"] == 0
    assert "rewards/accuracies" in step_records(example_runs["example dpo"])[4]
    shutil.copytree(example / "base", example / "sft-merged")  # the script's DPO starts from its fine-tuned model
    for run, args in (("dpo", ("--to", "peft", "--out", "dpo-adapter")), ("dpo", ("--to", "hf", "--merge-lora",
                      "--out", "dpo-merged")), ("distill", ("--to", "hf", "--out", "distilled"))):
        code, _, err = run_main("convert", str(example / run), *args[:-1], str(example / args[-1]))
        assert code == 0, err
    capsys.readouterr()
    example_script("generate").main(example, ["What is two plus three?"])  # exits if the exports differ
    assert "distilled student:" in capsys.readouterr().out


def test_the_report_plots_margins_and_accuracy(one_process, tmp_path):
    """`disttrain report` draws each logged step's margin and accuracy (the figure's own data), and writes it."""
    from disttrain.observe.run_report import figures, load_records, make_report

    run = one_process["dpo sigmoid"]
    records, run_events = load_records(run)
    figure = figures(records, run_events)["rewards.png"]
    margin, accuracy = (ax.get_lines()[0] for ax in figure.axes)
    logged = step_records(run)
    assert list(margin.get_xdata()) == list(accuracy.get_xdata()) == sorted(logged)
    assert list(margin.get_ydata()) == [logged[s]["rewards/margins"] for s in sorted(logged)]
    assert list(accuracy.get_ydata()) == [logged[s]["rewards/accuracies"] for s in sorted(logged)]
    _, files, _ = make_report(run, tmp_path)
    assert "rewards.png" in {f.name for f in files}


@pytest.mark.parametrize("record,message", [
    ({"prompt": "Hi", "chosen": "Hello."}, "records.jsonl:1: has 'chosen' but no 'rejected'"),
    ({"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello."}, "'chosen' and 'rejected' are identical"),
    ({"prompt": "Hi", "chosen": " ", "rejected": "Hello."}, "'chosen' is empty"),
    ({"chosen": "A cat.", "rejected": "The dog."}, "share no leading part"),
])
def test_a_bad_record_gets_one_line_and_nothing_written(record, message, assets, tmp_path):
    src = tmp_path / "records.jsonl"
    src.write_text(json.dumps(record) + "\n")
    code, out, err = run_main("prepare-data", str(src), "--out", str(tmp_path / "out"), "--tokenizer",
                              str(assets["tokenizer"]))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


@pytest.mark.parametrize("overrides,message", [
    (("train.objective=lm",), "holds preference pairs: train.objective=lm"),
    (("train.objective=dpo", "engine=deepspeed"), "engine=deepspeed with train.objective=dpo"),
    (("train.objective=dpo", "dpo.loss_type=robust"), "dpo.loss_type"),
    (("train.objective=dpo", "dpo.label_smoothing=0.5"), "dpo.label_smoothing"),
    (("train.objective=simpo", PRECOMPUTE), "dpo.precompute_reference=true with train.objective=simpo"),
])
def test_bad_settings_get_one_line(overrides, message, assets, tmp_path):
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"data.source={assets['many']}", "model.vocab_size=384",
                            f"data.seq_len={SEQ_LEN}", f"run.dir={tmp_path}", *overrides)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_preference_objective_needs_pairs(tmp_path):
    code, _, err = run_main("train", str(DEBUG_CONFIG), "train.objective=simpo", f"run.dir={tmp_path}")
    assert code == 2 and "train.objective=simpo needs preference pairs" in err, err
