"""Preference objectives under every layout: each equals one process (fp64, 1e-10) with pairs kept together in
every micro-batch, and packed pairs (`data.packing`) equal unpacked ones, on one process and under each layout;
a run saved on two ranks resumes on one."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from helpers import DEBUG_CONFIG, FP64, WHOLE_LOGITS, assert_parity, events, run_main, step_records, train_many
from test_preference import BETA, CHUNK, PRECOMPUTE, SEQ_LEN, _close, make_assets

PACKED = "data.packing=true"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """24 prepared pairs (with validation), the tiny Llama and a tiny Qwen3-MoE."""
    return make_assets(tmp_path_factory.mktemp("pref_layouts"), {"many": (24, "0.125")}, moe=True)


LAYOUT = (f"data.seq_len={SEQ_LEN}", "train.steps=4", "train.global_batch_size=8",
          "train.micro_batch_size=2", "optim.lr=1e-2", "train.eval_every=4", "train.eval_batches=1",
          "checkpoint.save_final=true", "checkpoint.every_steps=2", FP64)
BUILTIN = "model.vocab_size=384"  # the built-in models' vocabulary, for the tokenizer's 320 tokens
REFERENCES = {"dpo": (BUILTIN, "train.objective=dpo"), "lora": (BUILTIN, "train.objective=dpo", "model.lora.rank=4"),
              "simpo": (BUILTIN, "train.objective=simpo"), "orpo": (BUILTIN, "train.objective=orpo"),
              "hf moe": ("train.objective=dpo", "model.hf={qwen3_moe}", "model.moe.aux_loss_coef=0"),
              "moe": (BUILTIN, "train.objective=dpo", "model.name=debug-moe", "model.moe.aux_loss_coef=0")}
# MoE without a balancing loss: debug-moe's is taken over each micro-batch of every rank together, which one
# process at two pairs a micro-batch does not see (tests/test_moe.py compares it with matching micro-batches)
LAYOUTS = {"ddp": ("dpo", ()), "zero3": ("dpo", ("parallel.zero_stage=3",)), "tp2": ("dpo", ("parallel.tp=2",)),
           "zero2": ("dpo", ("parallel.zero_stage=2",)),  # the frozen reference resharded after each block
           "zero3 lora": ("lora", ("parallel.zero_stage=3",)),
           "tp2 sp simpo": ("simpo", ("parallel.tp=2", "parallel.sequence_parallel=true")),
           "ep2 zero3": ("moe", ("parallel.ep=2", "parallel.zero_stage=3")),
           "hf moe ep2": ("hf moe", ("parallel.ep=2", "parallel.zero_stage=0")),
           "cp2": ("dpo", ("parallel.cp=2",)), "cp2 orpo": ("orpo", ("parallel.cp=2", "parallel.cp_method=allgather")),
           "pp2 simpo": ("simpo", ("parallel.pp=2", "parallel.pp_schedule=1f1b")),
           "pp2": ("dpo", ("parallel.pp=2", "parallel.pp_schedule=1f1b")),
           "pp2 lora": ("lora", ("parallel.pp=2", "parallel.pp_schedule=gpipe")),
           # the reference's values computed once by the starting model under the layout (validation pairs too)
           "pp2 precomputed": ("dpo", ("parallel.pp=2", "parallel.pp_schedule=1f1b", PRECOMPUTE)),
           "cp2 precomputed": ("dpo", ("parallel.cp=2", PRECOMPUTE)),
           "zero3 lora precomputed": ("lora", ("parallel.zero_stage=3", PRECOMPUTE))}
# packed pairs under each layout, against the same one-process runs of unpacked pairs
LAYOUTS.update({f"{name} packed": (ref, (*extra, PACKED)) for name, (ref, extra) in {
    "zero3": ("dpo", ("parallel.zero_stage=3",)), "tp2 sp simpo": ("simpo", ("parallel.tp=2",
                                                                             "parallel.sequence_parallel=true")),
    "cp2": ("dpo", ("parallel.cp=2",)), "cp2 precomputed": ("dpo", ("parallel.cp=2", PRECOMPUTE)),
    "ep2 zero3": ("moe", ("parallel.ep=2", "parallel.zero_stage=3")), "zero3 lora": ("lora", ("parallel.zero_stage=3",)),
}.items()})


@pytest.fixture(scope="module")
def references(assets, tmp_path_factory):
    """The layouts' one-process runs (the slow tier)."""
    root = tmp_path_factory.mktemp("refs")
    return train_many({name: (root / name.replace(" ", "_"), (f"data.source={assets['many']}", *LAYOUT, WHOLE_LOGITS,
                                                                *_filled(extra, assets)))
                       for name, extra in REFERENCES.items()}, nproc=1)


def _filled(overrides, assets) -> tuple:
    """Overrides naming a fixture's directory ({qwen3_moe}) with its path."""
    return tuple(o.format(**assets) for o in overrides)


@pytest.fixture(scope="module")
def two_processes(assets, tmp_path_factory):
    """Every layout on the pairs (one 2-rank launch; the slow tier), the output head in chunks (whole logits under
    pipelines), against one process taking whole logits."""
    root = tmp_path_factory.mktemp("two")
    return train_many({name: (root / name.replace(" ", "_"), (f"data.source={assets['many']}", *LAYOUT,
                                                                f"train.loss_chunk_tokens={CHUNK}",
                                                                *_filled(REFERENCES[ref], assets), *extra))
                       for name, (ref, extra) in LAYOUTS.items()}, nproc=2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_one_process_on_pairs(layout, two_processes, references):
    """Pairs stay together in each micro-batch on every layout: losses, gradient norms, parameters and the
    validation loss equal one process at other micro-batches (fp64, 1e-10); the rewards too."""
    ours, theirs = two_processes[layout], references[LAYOUTS[layout][0]]
    assert_parity(ours, theirs, step=4)
    for step, record in step_records(ours).items():
        assert _close(record["rewards/margins"], step_records(theirs)[step]["rewards/margins"])
    (ours_eval,), (their_eval,) = events(ours, "eval"), events(theirs, "eval")
    for key in ("val_loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert _close(ours_eval[key], their_eval[key]), key


def test_a_run_saved_on_two_ranks_resumes_on_one_exactly(assets, two_processes, references, tmp_path):
    """DPO saved under ZeRO-3 on 2 ranks at step 2 continues on one process as if uninterrupted: the policy and
    optimizer reshard, the frozen reference is built again from the same starting weights."""
    run = tmp_path / "resumed"
    shutil.copytree(two_processes["zero3"], run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    (run / "metrics.jsonl").unlink()  # the resumed run logs steps 3 and 4 alone
    train_many({"resumed": (run, (f"data.source={assets['many']}", *LAYOUT, *REFERENCES["dpo"]))}, nproc=1)
    assert_parity(run, references["dpo"], step=4, after=2)




@pytest.fixture(scope="module")
def packed_one_process(assets, tmp_path_factory):
    """One process, pairs packed and not (one launch): DPO on the Hugging Face Llama with the output head in
    chunks (transformers masks the packed sequences apart from their restarting positions), SimPO on the built-in
    model with whole logits, and DPO with the reference's values computed once over packed pairs."""
    root = tmp_path_factory.mktemp("packed")
    hf = ("train.objective=dpo", f"model.hf={assets['base']}", f"train.loss_chunk_tokens={CHUNK}",
          f"dpo.beta={BETA}", "train.micro_batch_size=4")
    simpo = (*REFERENCES["simpo"], WHOLE_LOGITS)
    runs = {"hf dpo": hf, "simpo": simpo, "dpo": (*REFERENCES["dpo"], WHOLE_LOGITS),
            "hf dpo packed": (*hf, PACKED), "simpo packed": (*simpo, PACKED),
            "dpo precomputed packed": (*REFERENCES["dpo"], WHOLE_LOGITS, PRECOMPUTE, PACKED),
            "dpo padding-free": (*REFERENCES["dpo"], WHOLE_LOGITS, "data.padding=none")}  # pairs packed so too
    return train_many({name: (root / name.replace(" ", "_"), (f"data.source={assets['many']}", *LAYOUT, *extra))
                       for name, extra in runs.items()}, nproc=1)


def test_packed_micro_batches_hold_fewer_rows_and_tag_every_target(assets):
    """Packed, a micro-batch's pairs fill fewer rows than unpacked, each sequence ended by its end token; every
    valid target carries its sequence's index, and each sequence's tokens and targets are the unpacked row's."""
    from disttrain.data.source import split_samples
    from disttrain.models.packed_targets import split
    from disttrain.models.spec import IGNORE_INDEX

    plain, packed = (split_samples(str(assets["many"]), "train", SEQ_LEN, packing) for packing in (False, True))
    ids = np.array([3, 0, 7, 5])
    x, y = plain.batch(ids)
    px, py = packed.batch(ids)
    assert x.shape[0] == 8 and px.shape[0] < 8
    labels, sequence = split(py)
    for i in range(8):  # sequence i is unpacked row i
        valid = y[i] != IGNORE_INDEX
        assert torch.equal(labels[(sequence == i) & (labels != IGNORE_INDEX)], y[i][valid])
    assert int((labels != IGNORE_INDEX).sum()) == int((y != IGNORE_INDEX).sum())
    held = packed.packed_batch(ids)[2]  # the loader cuts each row after it: nothing that counts lies beyond
    assert held <= SEQ_LEN and bool((labels[:, held:] == IGNORE_INDEX).all())


@pytest.mark.parametrize("name,reference", [("hf dpo packed", "hf dpo"), ("simpo packed", "simpo"),
                                            ("dpo precomputed packed", "dpo"), ("dpo padding-free", "dpo")])
def test_packed_pairs_train_as_unpacked_ones(name, reference, packed_one_process):
    """Packed pairs give the unpacked pairs' losses, gradient norms, rewards, validation figures and parameters
    (fp64, 1e-10): each sequence's log-probability is summed over its own targets, the step counts the same
    pairs."""
    ours, theirs = packed_one_process[name], packed_one_process[reference]
    assert_parity(ours, theirs, step=4)
    for step, record in step_records(ours).items():
        for key in ("rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
            assert _close(record[key], step_records(theirs)[step][key]), (step, key)
    (ours_eval,), (their_eval,) = events(ours, "eval"), events(theirs, "eval")
    for key in ("val_loss", "rewards/margins", "logps/rejected"):
        assert _close(ours_eval[key], their_eval[key]), key


def test_packing_refuses_pairs_holding_the_end_token_inside(assets, tmp_path):
    """A template that ends turns with the end token puts it inside the sequences: prepare-data counts them and
    packing them is refused in one line."""
    import json

    meta_path = assets["many"] / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["preference"]["eos_inside"] == 0
    copy = tmp_path / "copy"
    shutil.copytree(assets["many"], copy)
    meta["preference"]["eos_inside"] = 3
    (copy / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"data.source={copy}", BUILTIN, f"data.seq_len={SEQ_LEN}",
                            "train.objective=dpo", PACKED, f"run.dir={tmp_path}")
    assert code == 2 and "3 pairs of" in err and len(err.strip().splitlines()) == 1, err
