"""Training on chat data: the loss over the answers only, checked against transformers' masked
CrossEntropyLoss of the same HF model on the same conversations (with packing and without); every layout
gives one process's numbers on that data, packed or not, and on a mixture of chat directories (fp64,
1e-10); the export keeps the chat template; and examples/sft runs, shortened."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from chat_tokenizer import (EXAMPLE, as_messages, example, example_module, naive_first_fit, prepare, records,
                            reference_masks, save_tokenizers, template)
from helpers import EXACT, FP64, assert_parity, events, final_params, losses, run_main, train_many

SEQ_LEN = 128  # every record fits: no truncation in the reference comparisons
VAL_EVERY = 4  # --val-fraction 0.25: records 4, 8, 12, ... (counting from 1) go to validation


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return save_tokenizers(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("chat")
    code, _, err = prepare(root, records(), tokenizers["markers"], "--seq-len", str(SEQ_LEN), "--val-fraction",
                           str(1 / VAL_EVERY))
    assert code == 0, err
    return root / "out"


def _conversations(tokenizer_dir):
    """(train, val) of transformers' (ids, assistant mask) per record, split as prepare-data splits."""
    ref = reference_masks(tokenizer_dir, records())
    return ([r for i, r in enumerate(ref) if i % VAL_EVERY != VAL_EVERY - 1],
            [r for i, r in enumerate(ref) if i % VAL_EVERY == VAL_EVERY - 1])


def _rows(convs, packing: bool):
    """Which conversations each sequence holds: one each, or packed first-fit (each with its end token)."""
    return naive_first_fit([len(ids) + 1 for ids, _ in convs], SEQ_LEN + 1) if packing else \
        [[i] for i in range(len(convs))]


@pytest.mark.parametrize("packing", [False, True], ids=["one per sequence", "packed"])
def test_sequences_hold_whole_conversations_with_targets_only_on_answers(packing, chat_dir, tokenizers):
    """The training rows, read at a data.seq_len some conversations exceed: each holds transformers'
    rendering of its conversations (cut to the sequence), end tokens between them and as padding, and
    targets -100 except on assistant tokens."""
    from disttrain.data.source import load_samples, truncation_warnings

    seq_len = 48
    tok, samples, _ = load_samples(str(chat_dir), "auto", seq_len, packing)
    eos = tok.eos_id
    train, _ = _conversations(tokenizers["markers"])
    convs = [(np.append(ids, eos)[:seq_len + 1], np.append(mask, 0)[:seq_len + 1]) for ids, mask in train]
    rows = naive_first_fit([len(ids) for ids, _ in convs], seq_len + 1) if packing else \
        [[i] for i in range(len(convs))]
    x, y = samples.batch(np.arange(len(samples)))
    assert len(samples) == len(rows) and x.shape == y.shape == (len(rows), seq_len)
    for r, row in enumerate(rows):
        ids = np.concatenate([convs[i][0] for i in row])
        mask = np.concatenate([np.concatenate([[0], convs[i][1][1:]]) for i in row])
        full = np.concatenate([ids, np.full(seq_len + 1 - len(ids), eos)])
        targets = np.where(np.concatenate([mask, np.zeros(seq_len + 1 - len(ids))]) == 1, full, -100)
        assert np.array_equal(x[r].numpy(), full[:-1]) and np.array_equal(y[r].numpy(), targets[1:])
    cut = sum(len(ids) + 1 > seq_len + 1 for ids, _ in train)
    assert cut > 0 and truncation_warnings("D", samples, seq_len) == [
        f"data.source=D: {cut} training conversations are longer than data.seq_len+1={seq_len + 1} tokens and are "
        "cut to it (the cut part carries no loss)"]


@pytest.mark.parametrize("multiple", [8, 12])
def test_each_micro_batch_is_cut_after_its_longest_conversation(multiple, chat_dir, tokenizers):
    """data.padding=longest: a micro-batch of unpacked conversations is its padded rows up to the end token of
    its longest conversation (transformers' rendering, plus that token), rounded up to the multiple (at most
    data.seq_len); what is cut is padding without loss."""
    from disttrain.data.loader import DistributedBatchLoader
    from disttrain.data.source import load_samples, make_sampler

    _, samples, _ = load_samples(str(chat_dir), "auto", SEQ_LEN, False)
    train, _ = _conversations(tokenizers["markers"])  # row i of the unpacked samples is conversation i
    full = DistributedBatchLoader(samples, make_sampler(samples, str(chat_dir), 8, 0), 0, 1, 2)
    cut = DistributedBatchLoader(samples, make_sampler(samples, str(chat_dir), 8, 0), 0, 1, 2, pad_multiple=multiple)
    widths = []
    for step in (1, 2, 3):
        ids = full.sampler.indices(step)
        for m, ((x, y), (cx, cy)) in enumerate(zip(full.micro_batches(step), cut.micro_batches(step))):
            longest = max(min(SEQ_LEN, len(train[int(i)][0]) + 1) for i in ids[2 * m:2 * m + 2])
            width = min(SEQ_LEN, -(-longest // multiple) * multiple)
            assert cx.shape == cy.shape == (2, width)
            assert cx.equal(x[:, :width]) and cy.equal(y[:, :width]) and (y[:, width:] == -100).all()
            widths.append(width)
    assert min(widths) < SEQ_LEN and len(set(widths)) > 1, widths  # cut, and by what each micro-batch holds


def test_padding_free_micro_batches_hold_the_same_conversations_in_fewer_rows(chat_dir):
    """data.padding=none: each micro-batch's conversations (end token included) are laid into rows of
    data.seq_len + 1, each row cut after its fullest; every conversation's inputs and targets are its padded
    row's, nothing else carries a target, and the micro-batch fills fewer positions."""
    from disttrain.data.loader import DistributedBatchLoader
    from disttrain.data.source import load_samples, make_sampler

    _, padded, _ = load_samples(str(chat_dir), "auto", SEQ_LEN, False)
    _, free, _ = load_samples(str(chat_dir), "auto", SEQ_LEN, False, padding_free=True)
    eos = int(padded.pad_id)
    loaders = [DistributedBatchLoader(s, make_sampler(s, str(chat_dir), 8, 0), 0, 1, 4, pad_multiple=8)
               for s in (padded, free)]
    positions = [0, 0]
    for step in (1, 2, 3):
        for (x, y), (fx, fy) in zip(*(loader.micro_batches(step) for loader in loaders)):
            positions[0] += x.numel()
            positions[1] += fx.numel()
            found = []
            for row, targets in zip(fx.tolist(), fy.tolist()):  # split at the end tokens, as document masking does
                at = 0
                while at < len(row) and row[at] != eos:
                    end = row.index(eos, at) + 1 if eos in row[at:] else len(row)
                    found.append((row[at:end], targets[at:end]))
                    at = end
                assert all(t == -100 for t in targets[at:])  # only padding after the last conversation
            expected = []  # each padded row up to its conversation's end token
            for padded_row, padded_targets in zip(x.tolist(), y.tolist()):
                n = padded_row.index(eos) + 1 if eos in padded_row else len(padded_row)
                assert all(t == -100 for t in padded_targets[n:])
                expected.append((padded_row[:n], padded_targets[:n]))
            assert sorted(found) == sorted(expected)  # first-fit may change their order, nothing else
    assert positions[1] < positions[0], positions


def test_padding_free_ranks_are_dealt_equal_tokens(chat_dir):
    """On several data-parallel ranks, padding-free micro-batches are dealt the step's conversations longest
    first to the lightest micro-batch with room: the ranks read the step's samples between them, the same number
    each, and their token counts differ less than in the sampler's order (padded micro-batches keep it)."""
    from disttrain.data.loader import DistributedBatchLoader
    from disttrain.data.source import load_samples, make_sampler

    spreads = {}
    for free in (False, True):
        _, samples, _ = load_samples(str(chat_dir), "auto", SEQ_LEN, False, padding_free=free)
        loaders = [DistributedBatchLoader(samples, make_sampler(samples, str(chat_dir), 8, 0), r, 2, 2)
                   for r in (0, 1)]
        spread = []
        for step in range(1, 9):
            step_ids = loaders[0].sampler.indices(step)
            ranks = [loader.sample_ids(step) for loader in loaders]
            assert sorted(np.concatenate(ranks).tolist()) == sorted(step_ids.tolist())
            assert [len(r) for r in ranks] == [4, 4]
            if not free:
                assert np.concatenate(ranks).tolist() == step_ids.tolist()
            tokens = [int(samples.held_tokens(r).sum()) for r in ranks]
            spread.append(abs(tokens[0] - tokens[1]))
        spreads[free] = sum(spread)
    assert spreads[True] < spreads[False], spreads


@pytest.mark.parametrize("overrides,world,multiple", [
    ((), 1, 8), (("data.pad_to_multiple_of=64",), 1, 64), (("parallel.tp=2",), 2, 8),
    (("parallel.tp=2", "parallel.sequence_parallel=true", "data.pad_to_multiple_of=3"), 2, 6),
    (("parallel.cp=2", "data.pad_to_multiple_of=6"), 2, 12), (("parallel.pp=2", "train.micro_batch_size=2"), 2, 0),
    (("data.padding=seq_len",), 1, 0)])
def test_the_cut_keeps_what_the_layout_splits(overrides, world, multiple):
    """Sequence parallelism splits a sequence over the tensor-parallel ranks and context parallelism into 2 x cp
    chunks: the width multiple is a multiple of those too; pipeline stages keep data.seq_len (one shape)."""
    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run
    from disttrain.data.padding import padding_multiple

    cfg = load_config(None, ["model.name=debug", "data.seq_len=96", "train.global_batch_size=4", *overrides])
    assert padding_multiple(cfg.data, resolve_run(cfg, world, "cpu").layout) == multiple


def test_the_sample_prompt_is_a_user_turn_through_the_chat_template(chat_dir, tokenizers):
    from transformers import AutoTokenizer

    from disttrain.data.source import source_tokenizer

    tok = source_tokenizer(str(chat_dir), "auto")
    hf = AutoTokenizer.from_pretrained(tokenizers["markers"])
    expected = hf.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    assert tok.chat_prompt("Name a colour.") == list(expected)
    assert hf.decode(expected).endswith("<|im_start|>assistant\n") and tok.stop_id == hf.eos_token_id


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_models import SIZES

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("hf") / "llama"
    AutoModelForCausalLM.from_config(LlamaConfig(**{**SIZES, "vocab_size": 384}, tie_word_embeddings=False)) \
        .save_pretrained(directory)
    return directory


COMMON = ("model.vocab_size=384", f"data.seq_len={SEQ_LEN}", "train.steps=4", "train.global_batch_size=8",
          "train.micro_batch_size=2", "optim.lr=3e-3", "checkpoint.save_final=true", "train.eval_every=4",
          "train.eval_batches=1", FP64)
PACKED = "data.packing=true"
FREE = "data.padding=none"  # each micro-batch's conversations laid end to end: the same numbers as padded
# Unpacked, each micro-batch is cut to its longest conversation (data.padding=longest, the default); pp2 keeps
# data.seq_len. Every one of them equals the one-process run, itself equal to padding every row to data.seq_len.
LAYOUTS = {"ddp": (), "zero3": ("parallel.zero_stage=3",), "tp2": ("parallel.tp=2",),
           "tp2 sp": ("parallel.tp=2", "parallel.sequence_parallel=true"), "cp2": ("parallel.cp=2",),
           "pp2": ("parallel.pp=2", "parallel.pp_schedule=gpipe"), "ddp packed": (PACKED,),
           "zero3 packed": ("parallel.zero_stage=3", PACKED), "tp2 packed": ("parallel.tp=2", PACKED),
           "ddp mixture": (), "ddp mixture padding-free": (FREE,), "tp2 sp padding-free": (
               "parallel.tp=2", "parallel.sequence_parallel=true", FREE), "cp2 padding-free": ("parallel.cp=2", FREE)}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, tokenizers):
    """data.source={A: 0.6, B: 0.4}: the records split over two chat directories (one tokenizer)."""
    root = tmp_path_factory.mktemp("mix")
    halves = {"a": records()[:12], "b": records()[12:]}
    for name, data in halves.items():
        (root / name).mkdir()
        code, _, err = prepare(root / name, data, tokenizers["markers"], "--seq-len", str(SEQ_LEN),
                               "--val-fraction", str(1 / VAL_EVERY))
        assert code == 0, err
    return f"data.source={{{root / 'a' / 'out'}: 0.6, {root / 'b' / 'out'}: 0.4}}"


def _source(layout: str, chat_dir, mixture) -> str:
    return mixture if "mixture" in layout else f"data.source={chat_dir}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, chat_dir, hf_dir, tokenizers, mixture):
    """One launch of one process: the HF model for one step on the whole training split (one sequence per
    row, so step 1 reads every row once), packed and not; and the fp64 references of the layouts."""
    root = tmp_path_factory.mktemp("one")
    train, _ = _conversations(tokenizers["markers"])
    jobs = {}
    for packing in (False, True):
        rows = len(_rows(train, packing))
        jobs[f"hf {packing}"] = (root / f"hf_{packing}", (
            f"data.source={chat_dir}", f"model.hf={hf_dir}", f"data.seq_len={SEQ_LEN}", "train.steps=1",
            f"train.global_batch_size={rows}", "train.eval_every=1", "train.eval_batches=1", "optim.lr=1e-2",
            "optim.warmup_steps=0",
            "checkpoint.save_final=true", f"data.packing={str(packing).lower()}", FP64))
        jobs[f"ref {packing}"] = (root / f"ref_{packing}", (
            f"data.source={chat_dir}", *COMMON, "train.micro_batch_size=8", f"data.packing={str(packing).lower()}"))
    jobs["ref mixture"] = (root / "ref_mixture", (mixture, *COMMON, "train.micro_batch_size=8"))
    jobs["ref padded"] = (root / "ref_padded", (f"data.source={chat_dir}", *COMMON, "train.micro_batch_size=8",
                                                "data.padding=seq_len"))
    jobs["ref padding-free"] = (root / "ref_free", (f"data.source={chat_dir}", *COMMON, "train.micro_batch_size=8",
                                                    "data.padding=none"))
    return train_many(jobs, nproc=1)


@pytest.mark.parametrize("padding", ["padded", "padding-free"])
def test_micro_batches_cut_to_their_longest_conversation_train_as_padded_ones(padding, one_process):
    """data.padding=longest (the default) against every row padded to data.seq_len, and against each
    micro-batch's conversations laid end to end (data.padding=none): the same losses, gradient norms,
    parameters and validation loss in fp64."""
    assert_parity(one_process["ref False"], one_process[f"ref {padding}"], step=4)
    ours, theirs = events(one_process[f"ref {padding}"], "eval"), events(one_process["ref False"], "eval")
    assert abs(ours[0]["val_loss"] - theirs[0]["val_loss"]) <= EXACT * theirs[0]["val_loss"]


def _hf_loss(model, convs, rows, counts):
    """transformers' masked CrossEntropyLoss(ignore_index=-100), each conversation on its own, summed over
    the rows a batch reads (`counts[j]` times row j) and divided by the valid targets."""
    total, targets = 0.0, 0
    ce = torch.nn.CrossEntropyLoss(ignore_index=-100, reduction="sum")
    for row, count in zip(rows, counts):
        for i in row:
            ids, mask = convs[i]
            labels = torch.where(torch.as_tensor(mask) == 1, torch.as_tensor(ids), -100)
            with torch.no_grad():
                logits = model(torch.as_tensor(ids)[None]).logits[0]
            total += count * float(ce(logits[:-1], labels[1:]))
            targets += count * int((labels[1:] != -100).sum())
    return total / targets


@pytest.mark.parametrize("packing", [False, True], ids=["one per sequence", "packed"])
def test_loss_equals_transformers_masked_cross_entropy(packing, one_process, hf_dir, tokenizers):
    """Step 1's loss (initial weights, every training row once) and the validation loss after it (weights
    from the final checkpoint) equal transformers' on the same conversations."""
    from transformers import AutoModelForCausalLM

    run = one_process[f"hf {packing}"]
    train, val = _conversations(tokenizers["markers"])
    from hf_models import fp64_norms

    model = fp64_norms(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64))
    rows = _rows(train, packing)
    expected = _hf_loss(model, train, rows, [1] * len(rows))
    assert abs(losses(run)[1] - expected) <= EXACT * expected

    model.load_state_dict(final_params(run, step=1))
    rows, g = _rows(val, packing), len(rows)  # validation reads g rows in order, round the split
    counts = [g // len(rows) + (j < g % len(rows)) for j in range(len(rows))]
    expected = _hf_loss(model, val, rows, counts)
    (record,) = events(run, "eval")
    assert abs(record["val_loss"] - expected) <= EXACT * expected


def test_the_hf_export_keeps_the_chat_template(one_process, tokenizers, tmp_path):
    """A model trained on chat data leaves with the tokenizer it was rendered with, chat template included,
    so `apply_chat_template` on the export gives the ids training saw."""
    from transformers import AutoTokenizer

    code, _, err = run_main("convert", str(one_process["hf False"]), "--to", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0, err
    exported, source = (AutoTokenizer.from_pretrained(d) for d in (tmp_path / "hf", tokenizers["markers"]))
    assert exported.chat_template == source.chat_template == template(True)
    for record in records(6):
        assert exported.apply_chat_template(as_messages(record)) == source.apply_chat_template(as_messages(record))


@pytest.fixture(scope="module")
def example_work(tmp_path_factory):
    """examples/sft/run.sh's first two steps, in this process: its assets, then prepare-data with its flags."""
    work = tmp_path_factory.mktemp("sft_example")
    example.main(work)
    code, out, err = run_main("prepare-data", str(work / "chats.jsonl"), "--out", str(work / "data"), "--tokenizer",
                              str(work / "tokenizer"), "--seq-len", "128", "--val-fraction", "0.05", "--force")
    assert code == 0, err
    return work, out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, chat_dir, mixture, example_work):
    """Every layout on the test's chat data, and the example's training (examples/sft/sft.yaml, 4 steps)."""
    root = tmp_path_factory.mktemp("two")
    jobs = {name: (root / name.replace(" ", "_"), (_source(name, chat_dir, mixture), *COMMON, *extra))
            for name, extra in LAYOUTS.items()}
    work = example_work[0]
    shortened = (f"model.hf={work / 'base'}", f"data.source={work / 'data'}", "train.steps=4", "optim.warmup_steps=2")
    jobs["example"] = (work / "run", shortened, EXAMPLE / "sft.yaml")
    return train_many(jobs, nproc=2)


def test_the_sft_example_end_to_end_shortened(two_processes, example_work, capsys):
    """examples/sft/run.sh with 4 training steps, its processes joined to this module's launches: the mask
    comes from the template's generation markers and is neither all nor nothing; both exports answer the
    example's questions alike through transformers' generate (greedy); the adapter names its base."""
    work, prepared = example_work
    assert "mask from the chat template's generation markers" in prepared
    meta = json.loads((work / "data" / "meta.json").read_text())["chat"]
    assert 0.1 < meta["loss_share"] < 0.4 and meta["skipped"] == meta["truncated"] == 0
    for args in (("--to", "peft", "--out", str(work / "adapter")),
                 ("--to", "hf", "--merge-lora", "--out", str(work / "merged"))):
        code, _, err = run_main("convert", str(two_processes["example"]), *args)
        assert code == 0, err
    assert json.loads((work / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(work / "base")
    generate = example_module("generate")
    capsys.readouterr()
    generate.main(work, ["What is two plus three?", "Spell 42:"])  # exits if the two exports answer differently
    shown = capsys.readouterr().out
    assert shown.count("base + adapter:") == shown.count("merged weights:") == 2



@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_one_process_on_masked_chat_data(layout, two_processes, one_process):
    """Packed conversations under DDP, ZeRO-3 and TP too; a weighted mixture of two chat directories; and
    padding-free micro-batches (data.padding=none) equal to padded ones under DDP, TP with SP, and CP."""
    reference = one_process["ref mixture" if "mixture" in layout else f"ref {'packed' in layout}"]
    assert_parity(two_processes[layout], reference, step=4)
    ours, theirs = events(two_processes[layout], "eval"), events(reference, "eval")
    assert len(ours) == len(theirs) == 1
    assert abs(ours[0]["val_loss"] - theirs[0]["val_loss"]) <= EXACT * theirs[0]["val_loss"]
    if "mixture" in layout:  # both directories were read, and evaluated on their own
        assert len(ours[0]["val_loss_by_source"]) == 2
