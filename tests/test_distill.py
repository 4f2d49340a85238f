"""Knowledge distillation: the loss equals a hand-written reference (softened softmaxes, KL over the valid targets,
T² scaling, mixed with the cross-entropy) computed from transformers' logits of teacher and student in fp64; every
layout equals one process (fp64, 1e-10); a teacher that cannot teach this student is refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from chat_tokenizer import records, save_chat_tokenizer
from helpers import (DEBUG_CONFIG, EXACT, FP64, WHOLE_LOGITS, assert_parity, events, run_main, step_records,
                     train_many)
from hf_models import SIZES, fp64_norms

SEQ_LEN = 64
CHUNKS = "train.loss_chunk_tokens=24"  # chunks that cut conversations (no length is a multiple of 24)


def _llama(directory, seed: int, **sizes):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**{**SIZES, "vocab_size": 384, **sizes}, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Chat data (24 conversations, one in 8 for validation), a tiny student and a wider, deeper teacher that
    carries the data's tokenizer."""
    root = tmp_path_factory.mktemp("distill")
    tokenizer = save_chat_tokenizer(root / "tokenizer")
    src = root / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records(24)))
    code, _, err = run_main("prepare-data", str(src), "--out", str(root / "data"), "--tokenizer", str(tokenizer),
                            "--seq-len", str(SEQ_LEN), "--val-fraction", "0.125")
    assert code == 0, err
    teacher = _llama(root / "teacher", seed=1, hidden_size=96, intermediate_size=256, num_hidden_layers=5)
    shutil.copyfile(root / "data" / "tokenizer.json", teacher / "tokenizer.json")
    return {"root": root, "data": root / "data", "student": _llama(root / "student", seed=0), "teacher": teacher}


def _run_args(assets, *extra):
    return (f"model.hf={assets['student']}", f"data.source={assets['data']}", f"data.seq_len={SEQ_LEN}",
            "train.objective=distill", f"distill.teacher={assets['teacher']}", FP64, *extra)


LAYOUT = ("train.steps=3", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.lr=1e-2",
          "checkpoint.save_final=true", "checkpoint.every_steps=2", "distill.temperature=2", "distill.alpha=0.7")
LAYOUTS = {"zero3": ("parallel.zero_stage=3",), "tp2": ("parallel.tp=2",), "cp2": ("parallel.cp=2",),
           "pp2": ("parallel.pp=2", "parallel.pp_schedule=1f1b")}


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    """Step 1 over every training conversation (forward KL at T=2, alpha=0.7; reverse KL alone at T=1); and the
    layouts' reference."""
    from disttrain.data.source import split_samples

    root = tmp_path_factory.mktemp("one")
    rows = len(split_samples(str(assets["data"]), "train", SEQ_LEN))
    first = ("train.steps=1", f"train.global_batch_size={rows}", "train.micro_batch_size=0",
             "optim.warmup_steps=0", "checkpoint.save_final=true")
    jobs = {"forward": (root / "forward", _run_args(assets, *first, "distill.temperature=2", "distill.alpha=0.7",
                                                    CHUNKS)),
            "forward whole": (root / "forward_whole", _run_args(assets, *first, "distill.temperature=2",
                                                                "distill.alpha=0.7", WHOLE_LOGITS)),
            "reverse": (root / "reverse", _run_args(assets, *first, "distill.kl=reverse", "distill.alpha=1", CHUNKS)),
            "ref": (root / "ref", _run_args(assets, *LAYOUT, WHOLE_LOGITS))}
    return train_many(jobs, nproc=1)


@pytest.fixture(scope="module")
def two_processes(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    return train_many({name: (root / name, _run_args(assets, *LAYOUT, CHUNKS, *extra))
                       for name, extra in LAYOUTS.items()}, nproc=2)


def _by_hand(assets, temperature: float, alpha: float, kl: str) -> float:
    """The mean over every valid target of the training split of alpha·T²·KL + (1-alpha)·cross-entropy, each
    conversation alone through transformers' teacher and student (fp64 throughout)."""
    from transformers import AutoModelForCausalLM

    from disttrain.data.source import split_samples

    models = [fp64_norms(AutoModelForCausalLM.from_pretrained(assets[k], dtype=torch.float64))
              for k in ("student", "teacher")]
    samples = split_samples(str(assets["data"]), "train", SEQ_LEN)
    x, y = samples.batch(np.arange(len(samples)))
    total, count = 0.0, 0
    for row in range(len(x)):
        held = int(samples.held_tokens(np.array([row]))[0])
        with torch.no_grad():
            student, teacher = (m(x[row:row + 1, :held]).logits[0] for m in models)
        targets = y[row, :held]
        valid = targets != -100
        p_s = torch.softmax(student / temperature, -1)
        p_t = torch.softmax(teacher / temperature, -1)
        a, b = (p_t, p_s) if kl == "forward" else (p_s, p_t)
        divergence = (a * (a.log() - b.log())).sum(-1)[valid].sum() * temperature ** 2
        nll = -torch.log_softmax(student, -1)[valid].gather(-1, targets[valid][:, None]).sum()
        total += float(alpha * divergence + (1 - alpha) * nll)
        count += int(valid.sum())
    return total / count


@pytest.mark.parametrize("name,temperature,alpha,kl", [("forward", 2.0, 0.7, "forward"), ("reverse", 1.0, 1.0,
                                                                                          "reverse")])
def test_the_loss_equals_the_hand_written_reference(name, temperature, alpha, kl, one_process, assets):
    """The student's head computing the objective in chunks of tokens that cut conversations, from the teacher's
    hidden states and head weight (neither model's whole logits exist)."""
    expected = _by_hand(assets, temperature, alpha, kl)
    assert abs(step_records(one_process[name])[1]["loss"] - expected) <= EXACT * expected
    assert events(one_process[name], "started")[0]["logits"] == "chunks of 24 tokens"


def test_in_chunks_the_step_equals_whole_logits(one_process):
    """The gradient too: after the step, every parameter equals the run taking both models' whole logits."""
    assert_parity(one_process["forward"], one_process["forward whole"], step=1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_one_process(layout, two_processes, one_process):
    """The teacher sharded like the student (ZeRO-3, tensor parallel with the vocabulary split, context
    parallel, a pipeline of its own), the objective in chunks of tokens (whole logits under the pipeline):
    losses, gradient norms and parameters equal one process taking whole logits at other micro-batches."""
    assert_parity(two_processes[layout], one_process["ref"], step=3)


def test_a_run_saved_on_two_ranks_resumes_on_one_exactly(assets, two_processes, one_process, tmp_path):
    """Saved under ZeRO-3 on 2 ranks at step 2, continued on one process: the teacher is built again from its
    directory, the student and its optimizer reshard; step 3 and the parameters equal the uninterrupted run."""
    run = tmp_path / "resumed"
    shutil.copytree(two_processes["zero3"], run)
    shutil.rmtree(run / "checkpoints" / "step_00000003")
    (run / "metrics.jsonl").unlink()  # the resumed run logs step 3 alone
    train_many({"resumed": (run, _run_args(assets, *LAYOUT))}, nproc=1)
    assert_parity(run, one_process["ref"], step=3, after=2)


def test_a_disttrain_run_teaches_as_its_exported_model(assets, tmp_path):
    """distill.teacher=RUN (a disttrain run directory): the teacher is the run's model with its newest checkpoint's
    weights, so a step equals, parameter for parameter, the same step taught by that checkpoint exported to
    transformers (`disttrain convert --to hf`); the run's training changed the teacher (its weights differ from
    the directory it started from). A run without a committed checkpoint is refused in one line."""
    from safetensors.torch import load_file

    teacher_run = tmp_path / "teacher_run"
    train_many({"teacher": (teacher_run, (f"model.hf={assets['teacher']}", f"data.source={assets['data']}",
                                          f"data.seq_len={SEQ_LEN}", "train.steps=2", "train.global_batch_size=8",
                                          "optim.lr=1e-2", "checkpoint.save_final=true"))}, nproc=1)
    exported = tmp_path / "exported"
    code, _, err = run_main("convert", str(teacher_run), "--to", "hf", "--out", str(exported))
    assert code == 0, err
    shutil.copyfile(assets["data"] / "tokenizer.json", exported / "tokenizer.json")  # the same tokenizer, as bytes
    before, after = load_file(str(assets["teacher"] / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in after)
    first = ("train.steps=1", "train.global_batch_size=8", "optim.warmup_steps=0", "distill.temperature=2", CHUNKS,
             "checkpoint.save_final=true")
    runs = train_many({name: (tmp_path / name, _run_args(assets, *first, f"distill.teacher={teacher}"))
                       for name, teacher in (("run", teacher_run), ("hf", exported))}, nproc=1)
    assert_parity(runs["run"], runs["hf"], step=1)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text((teacher_run / "config.yaml").read_text())
    code, _, err = run_main("train", str(DEBUG_CONFIG), *_run_args(assets, f"run.dir={tmp_path / 'refused'}",
                                                                   f"distill.teacher={empty}"))
    assert code == 2 and "holds no committed checkpoint" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "refused").exists(), err


def test_a_teacher_that_cannot_teach_is_refused(assets, tmp_path):
    other = _llama(tmp_path / "other", seed=2, vocab_size=448)
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    shutil.copyfile(assets["teacher"] / "config.json", no_weights / "config.json")
    foreign = tmp_path / "foreign"
    shutil.copytree(assets["teacher"], foreign)
    (foreign / "tokenizer.json").write_text(
        (foreign / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|eot|>"'))
    cases = [(("distill.teacher=",), "train.objective=distill needs distill.teacher=DIR"),
             (("engine=deepspeed", "precision.compute_dtype=fp32"), "engine=deepspeed with train.objective=distill"),
             ((f"distill.teacher={other}",), "its vocabulary has 448 tokens, the student's 384"),
             ((f"distill.teacher={no_weights}",), "holds no weights"),
             ((f"distill.teacher={foreign}",), "its tokenizer.json differs from the run's")]
    for extra, message in cases:
        code, _, err = run_main("train", str(DEBUG_CONFIG), *_run_args(assets, f"run.dir={tmp_path}", *extra))
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (extra, err)
