"""Data: the built-in corpus, shard files, prepare-data, and the world-size-independent batch rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disttrain.data.corpus import builtin_splits
from disttrain.data.loader import DistributedBatchLoader, TokenWindows
from disttrain.data.sampling import GlobalBatchSampler
from disttrain.data.shards import open_split, read_meta
from disttrain.data.source import load_splits
from disttrain.data.tokenizer import ByteTokenizer
from helpers import losses, run_cli, train


def test_builtin_corpus_is_english_and_split():
    splits = builtin_splits()
    text = " ".join(splits["train"])
    assert len(text) > 500_000 and len(splits["val"]) > 50
    assert text.count(" the ") > 1000
    assert not set(splits["val"]) & set(splits["train"][:200])


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode_batch(["héllo wörld"])[0]
    assert max(ids) < 256 and tok.eos_id not in ids
    assert tok.decode(ids) == "héllo wörld"


def _rank_batches(windows, seed, global_bs, dp_size, mbs, step):
    rows = []
    for r in range(dp_size):
        loader = DistributedBatchLoader(windows, GlobalBatchSampler(len(windows), global_bs, seed), r, dp_size, mbs)
        rows += [x for x, _ in loader.micro_batches(step)]
    return torch.cat(rows)


@pytest.mark.parametrize("dp_size,mbs", [(2, 1), (2, 4), (4, 2), (8, 1)])
def test_step_sequences_do_not_depend_on_world_size(dp_size, mbs):
    windows = TokenWindows(np.arange(10_000, dtype=np.uint16) % 256, seq_len=16)
    for step in (1, 2, 77):
        single = _rank_batches(windows, 5, 8, 1, 8, step)
        assert torch.equal(_rank_batches(windows, 5, 8, dp_size, mbs, step), single)


def test_sampler_covers_each_epoch_once_and_depends_on_seed():
    sampler = GlobalBatchSampler(num_samples=40, global_batch_size=8, seed=1)
    epoch = np.concatenate([sampler.indices(k) for k in range(1, 6)])
    assert sorted(epoch) == list(range(40))
    assert not np.array_equal(sampler.indices(6), sampler.indices(1))  # next epoch reshuffles
    assert not np.array_equal(GlobalBatchSampler(40, 8, seed=2).indices(1), sampler.indices(1))


def test_targets_are_inputs_shifted():
    windows = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=10)
    loader = DistributedBatchLoader(windows, GlobalBatchSampler(len(windows), 4, 0), 0, 1, 2)
    for x, y in next(loader):
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert loader.state_dict()["next_step"] == 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = builtin_splits()["train"][:300]
    (root / "a.txt").write_text("\n\n".join(docs[:150]))
    with open(root / "b.jsonl", "w") as f:
        for d in docs[150:]:
            f.write(json.dumps({"text": d}) + "\n")
    return root


def test_prepare_data_byte_shards(corpus, tmp_path):
    out = tmp_path / "shards"
    proc = run_cli("prepare-data", str(corpus / "a.txt"), str(corpus / "b.jsonl"), "--out", str(out))
    assert "wrote" in proc.stdout
    meta = read_meta(out)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "byte"
    train_tokens, val_tokens = open_split(out, "train"), open_split(out, "val")
    assert len(train_tokens) == meta["splits"]["train"] and len(val_tokens) > 0
    text = ByteTokenizer().decode(train_tokens[:2000].tolist())
    assert text.replace("\x00", "")[:40] in (corpus / "a.txt").read_text()


def test_prepare_data_bpe_then_train(corpus, tmp_path):
    out = tmp_path / "bpe"
    run_cli("prepare-data", str(corpus / "a.txt"), str(corpus / "b.jsonl"), "--out", str(out),
            "--tokenizer", "bpe", "--vocab-size", "512")
    meta = read_meta(out)
    assert meta["vocab_size"] == 512 and (out / "tokenizer.json").is_file()
    tok, splits = load_splits(str(out), "byte")
    assert tok.eos_id is not None and int(splits["train"].max()) < 512
    sample = "The quick brown fox"
    assert tok.decode(tok.encode_batch([sample])[0]) == sample
    # The model vocabulary must cover the tokenizer's: refused at 256, trains at 512.
    refused = run_cli("train", "configs/debug.yaml", f"data.source={out}", check=False)
    assert refused.returncode == 2 and "set model.vocab_size>=512" in refused.stderr
    run = train(tmp_path / "run", f"data.source={out}", "model.vocab_size=512", "train.steps=8")
    curve = losses(run)
    assert curve[8] < curve[1]


def test_prepare_data_mistakes(tmp_path):
    proc = run_cli("prepare-data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "no such file" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_prefetch_reads_the_same_batches_even_when_the_split_or_position_changes():
    """The background reader hands out exactly what a synchronous read gives, also after a re-split
    (uneven shares) and a resume to another position, which discard what it read ahead."""
    windows = TokenWindows(np.arange(20_000, dtype=np.uint16) % 256, seq_len=16)
    plain, ahead = (DistributedBatchLoader(windows, GlobalBatchSampler(len(windows), 8, 3), 1, 2, 1, [4, 4],
                                           prefetch=p) for p in (False, True))
    try:
        for step in range(1, 9):
            if step == 4:
                for loader in (plain, ahead):
                    loader.set_shares([6, 2])
            if step == 6:
                for loader in (plain, ahead):
                    loader.load_state_dict({"next_step": 40})
            a, b = next(plain), next(ahead)
            assert len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))
        assert ahead.state_dict() == plain.state_dict()  # the step consumed next, not the one read ahead
    finally:
        ahead.close()
