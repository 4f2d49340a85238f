"""The constant-memory sample order and weighted mixtures of shard directories."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from disttrain.data.loader import DistributedBatchLoader, MixtureSamples, TokenWindows
from disttrain.data.sampling import FeistelPermutation, GlobalBatchSampler, MixtureSampler, SourceSchedule
from disttrain.data.shards import ShardWriter
from disttrain.data.source import describe_source, load_samples
from disttrain.core.errors import UserError
from helpers import DEBUG_CONFIG, events, losses, run_cli, train_many


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection_and_depends_on_the_key(n):
    order = FeistelPermutation(n, key=11)(np.arange(n))
    assert sorted(order) == list(range(n))
    if n > 3:
        assert not np.array_equal(order, FeistelPermutation(n, key=12)(np.arange(n)))


def test_order_is_shuffled():
    """Neighbouring windows of the corpus land far apart, and no position stays near its place."""
    n = 100_000
    order = FeistelPermutation(n, key=3)(np.arange(n))
    assert np.median(np.abs(np.diff(order))) > n / 10
    assert np.mean(np.abs(order - np.arange(n)) < 100) < 0.01


def _sampler_bytes(n: int) -> int:
    """Peak bytes allocated to build a sampler and read one step of 1024 samples from it."""
    tracemalloc.start()
    sampler = GlobalBatchSampler(n, 1024, seed=0)
    sampler.indices(123)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_sampler_memory_does_not_grow_with_the_dataset():
    small, huge = _sampler_bytes(10_000), _sampler_bytes(500_000_000_000)  # ~1T tokens at seq 2048
    assert huge < 1.2 * small + 4096 and huge < 200_000  # an explicit permutation would be 4 TB


def test_mixture_composition_follows_the_weights_every_step():
    weights, g = [0.5, 0.3, 0.2], 20
    schedule = SourceSchedule(weights)
    total = np.zeros(3)
    for k in range(1, 201):
        source, _ = schedule.assign(np.arange((k - 1) * g, k * g))
        counts = np.bincount(source, minlength=3)
        assert np.all(np.abs(counts - np.array(weights) * g) <= 2), (k, counts)
        total += counts
    assert list(total) == [2000, 1200, 800]
    assert schedule.consumed(200 * g) == [2000, 1200, 800]


def _mixture(sizes, seq_len=8):
    parts = [TokenWindows(np.arange(n * seq_len + 1, dtype=np.int64) + 10_000 * i, seq_len) for i, n in enumerate(sizes)]
    return MixtureSamples([f"s{i}" for i in range(len(sizes))], parts)


def _global_batch(samples, weights, dp, mbs, step, g=8, seed=4):
    rows = []
    for r in range(dp):
        loader = DistributedBatchLoader(samples, MixtureSampler([len(p) for p in samples.parts], weights, g, seed),
                                        r, dp, mbs)
        rows += [x for x, _ in loader.micro_batches(step)]
    return torch.cat(rows)


def test_mixture_batches_do_not_depend_on_world_size():
    samples = _mixture([50, 30, 7])
    for step in (1, 2, 40):
        single = _global_batch(samples, [0.6, 0.3, 0.1], 1, 8, step)
        for dp, mbs in ((2, 2), (4, 1)):
            assert torch.equal(_global_batch(samples, [0.6, 0.3, 0.1], dp, mbs, step), single)
        assert set((single[:, 0] // 10_000).tolist()) <= {0, 1, 2}


def test_each_source_reads_its_own_stream_once_per_epoch():
    samples, g = _mixture([40, 24]), 8
    sampler = MixtureSampler([40, 24], [0.5, 0.5], g, seed=1)
    rows = np.concatenate([sampler.indices(k) for k in range(1, 11)])  # 80 slots: 40 of each source
    for i, n in enumerate((40, 24)):
        ids = rows[rows[:, 0] == i, 1]
        assert sorted(ids[:n]) == list(range(n))  # one full epoch before any repeat
    x, _ = samples.batch(sampler.indices(3))
    assert torch.equal(x[:, 0] // 10_000, torch.from_numpy(sampler.indices(3)[:, 0]))


def test_resume_continues_every_source_even_when_the_weights_change():
    sizes, g = [1000, 1000], 8
    run = MixtureSampler(sizes, [0.5, 0.5], g, seed=2)
    state = run.state_dict(next_step=11)
    assert state["consumed"] == [40, 40]
    same = MixtureSampler(sizes, [0.5, 0.5], g, seed=2)
    same.load_state_dict(state, next_step=11)
    assert np.array_equal(same.indices(11), run.indices(11))

    reweighted = MixtureSampler(sizes, [0.75, 0.25], g, seed=2)
    reweighted.load_state_dict(state, next_step=11)
    before = np.concatenate([run.indices(k) for k in range(1, 11)])
    after = np.concatenate([reweighted.indices(k) for k in range(11, 21)])
    assert reweighted.consumed(21) == [40 + 60, 40 + 20]
    for i in range(2):  # each source carries on with the next samples of its stream, none repeated
        stream = GlobalBatchSampler(1000, g, 2, stream=i).ids(np.arange(reweighted.consumed(21)[i]))
        assert np.array_equal(np.concatenate([before[before[:, 0] == i, 1], after[after[:, 0] == i, 1]]), stream)
    again = MixtureSampler(sizes, [0.75, 0.25], g, seed=2)  # a second resume keeps the re-based stream
    again.load_state_dict(reweighted.state_dict(next_step=15), next_step=15)
    assert np.array_equal(again.indices(15), reweighted.indices(15))


def _shards(directory, text: bytes, val: bytes = b""):
    writer = ShardWriter(directory, 256, "byte", 0)
    writer.append("train", np.frombuffer(text, dtype=np.uint8))
    writer.append("val", np.frombuffer(val, dtype=np.uint8))
    writer.close()
    return directory


def test_mixture_mistakes_are_one_line(tmp_path):
    a = _shards(tmp_path / "a", b"abcdefgh" * 400)
    bpe = tmp_path / "b"
    writer = ShardWriter(bpe, 500, "tokenizer.json", 0)
    writer.append("train", np.arange(400))
    writer.close()
    (bpe / "tokenizer.json").write_text("{}")
    for source, expected in (({a: 1, "builtin": 1}, "builtin cannot be part of a mixture"),
                             ({a: 1, tmp_path / "nope": 1}, "no such directory"),
                             ({a: 1, bpe: 1}, "tokenised differently")):
        with pytest.raises(UserError, match=expected):
            describe_source({str(k): v for k, v in source.items()}, "byte")
    tiny = _shards(tmp_path / "tiny", b"abc")
    with pytest.raises(UserError, match=f"{tiny} holds fewer than data.seq_len\\+1=65 training tokens"):
        load_samples({str(a): 1, str(tiny): 1}, "byte", 64)
    proc = run_cli("train", str(DEBUG_CONFIG), f"data.source={{{a}: 0}}", f"run.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(f"the weight of {a} is 0 (allowed: a number > 0)")
    assert len(proc.stderr.strip().splitlines()) == 1 and not list(tmp_path.glob("*/config.yaml"))


def test_mixture_trains_evaluates_per_source_and_resumes_in_the_stream(tmp_path):
    """Two ranks; eval reports each source; resuming from step 4 gives the uninterrupted losses, bitwise."""
    corpus = " ".join(f"line {i} of the first source." for i in range(3000)).encode()
    a = _shards(tmp_path / "prose", corpus, corpus[:4000])
    b = _shards(tmp_path / "digits", bytes(str(list(range(4000))), "ascii"), b"0123456789" * 400)
    short = _shards(tmp_path / "short", corpus[:2000], corpus[:40])  # validation under one sequence (65 tokens)
    mix = f"data.source={{{a}: 0.7, {b}: 0.3, {short}: 0.1}}"
    common = (mix, "train.steps=8", "train.eval_every=4", "train.eval_batches=1", "checkpoint.every_steps=4")
    step4 = tmp_path / "full" / "checkpoints" / "step_00000004"
    runs = train_many({"full": (tmp_path / "full", common),
                       "resumed": (tmp_path / "resumed", (*common, f"checkpoint.resume={step4}"))}, nproc=2)
    full, resumed = losses(runs["full"]), losses(runs["resumed"])
    assert resumed == {k: full[k] for k in range(5, 9)}
    evals = events(runs["full"], "eval")
    by_source = evals[-1]["val_loss_by_source"]
    assert set(by_source) == {"prose", "digits"}
    assert evals[-1]["val_loss"] == pytest.approx(0.7 * by_source["prose"] + 0.3 * by_source["digits"])
    # the source validation cannot read is named at the start, not just missing from val_loss_by_source
    assert [e["message"] for e in events(runs["full"], "warning")] == [
        f"data.source: {short}'s validation split holds 40 tokens, fewer than data.seq_len+1=65: it is left out "
        "of validation (val_loss_by_source)"]
