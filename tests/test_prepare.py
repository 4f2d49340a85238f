"""`disttrain prepare-data` at scale: every input format gives the tokens of tokenising the text directly,
worker processes change nothing, mistakes are one line, and an interrupted run leaves nothing behind."""

from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from disttrain.data.corpus import builtin_splits
from disttrain.data.prepare import prepare
from disttrain.data.shards import open_split, read_meta
from disttrain.data.tokenizer import ByteTokenizer, HFTokenizer
from helpers import REPO, cli_env

VAL_EVERY = 20  # --val-fraction 0.05: documents 20, 40, 60, ... (counting from 1) go to validation


@pytest.fixture(scope="module")
def docs():
    # .txt separates documents by an empty line: these documents contain none, and no edge whitespace
    return [re.sub(r"\n+", "\n", d).strip() for d in builtin_splits()["train"][:120]]


def expected_splits(docs, tok) -> dict[str, np.ndarray]:
    """The shards written by hand: each document's tokens and the end-of-document id, split by index."""
    out = {"train": [], "val": []}
    for i, ids in enumerate(tok.encode_batch(docs)):
        out["val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"].extend([*ids, tok.eos_id])
    return {k: np.array(v) for k, v in out.items()}


def write_formats(docs, root):
    """The same documents as .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, a save_to_disk directory and
    a folder of Parquet parts."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    (root / "c.txt").write_text("\n\n".join(docs), encoding="utf-8")
    (root / "c.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines)
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode("utf-8")))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, root / "c.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "saved"))
    (root / "parts").mkdir()
    half = len(docs) // 2
    pq.write_table(table.slice(0, half), root / "parts" / "part-0.parquet")
    pq.write_table(table.slice(half), root / "parts" / "part-1.parquet")
    return {"txt": root / "c.txt", "jsonl": root / "c.jsonl", "jsonl.gz": root / "c.jsonl.gz",
            "jsonl.zst": root / "c.jsonl.zst", "parquet": root / "c.parquet", "save_to_disk": root / "saved",
            "folder of parquet": root / "parts"}


@pytest.fixture(scope="module")
def formats(docs, tmp_path_factory):
    return write_formats(docs, tmp_path_factory.mktemp("formats"))


def shards(directory) -> dict[str, np.ndarray]:
    return {s: np.asarray(open_split(directory, s)) for s in ("train", "val")}


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "save_to_disk", "folder of parquet"])
def test_every_format_gives_the_tokens_of_the_text(fmt, formats, docs, tmp_path):
    prepare([formats[fmt]], tmp_path / "out", val_fraction=1 / VAL_EVERY, progress=False, workers=1)
    got, want = shards(tmp_path / "out"), expected_splits(docs, ByteTokenizer())
    assert all(np.array_equal(got[s], want[s]) for s in got)
    assert read_meta(tmp_path / "out")["splits"] == {s: len(v) for s, v in want.items()}


def test_worker_processes_and_a_model_directory_tokenizer(formats, docs, tmp_path):
    """Two tokenising processes write the same bytes as one; `--tokenizer DIR` takes DIR/tokenizer.json (as
    `model.hf=DIR` does), so the data matches that model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(model_dir / "tokenizer.json"))
    one, two = tmp_path / "one", tmp_path / "two"
    prepare([formats["parquet"]], one, str(model_dir), val_fraction=1 / VAL_EVERY, progress=False, workers=1)
    prepare([formats["parquet"]], two, str(model_dir), val_fraction=1 / VAL_EVERY, progress=False, workers=2)
    for split in ("train", "val"):
        assert (one / f"{split}.bin").read_bytes() == (two / f"{split}.bin").read_bytes()
    want = expected_splits(docs, HFTokenizer(model_dir / "tokenizer.json"))
    assert all(np.array_equal(shards(one)[s], want[s]) for s in want)
    assert read_meta(one)["tokenizer"] == "tokenizer.json" and read_meta(one)["vocab_size"] == 400


def _bad_inputs(root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    pq.write_table(pa.table({"body": ["a", "b"]}), root / "no_text.parquet")
    (root / "garbage.parquet").write_bytes(b"not parquet at all")
    (root / "empty.jsonl").write_text("")
    (root / "notes.md").write_text("# hello")
    return root


@pytest.mark.parametrize("name,expected", [
    ("no_text.parquet", "has no column 'text' (columns: body; use --text-key)"),
    ("garbage.parquet", "not a readable Parquet file"),
    ("empty.jsonl", "no documents (empty corpus)"),
    ("notes.md", "not a corpus this reads (allowed: .txt, .jsonl"),
])
def test_prepare_data_mistakes_are_one_line(name, expected, tmp_path, capsys):
    from disttrain.cli import main

    root = _bad_inputs(tmp_path / "in")
    with pytest.raises(SystemExit) as exc:
        main(["prepare-data", str(root / name), "--out", str(tmp_path / "out"), "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and expected in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output, no partial directory


def test_ctrl_c_leaves_no_shard_directory(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(("lorem ipsum dolor sit amet " * 40 + "\n\n") * 80_000)  # ~86 MB: ~2 s of byte tokenising
    cmd = [sys.executable, "-m", "disttrain", "prepare-data", str(big), "--out", str(tmp_path / "out"),
           "--workers", "1"]
    # As from a shell: Ctrl-C's SIGINT at its default disposition (a test run may have inherited it ignored).
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def writing() -> bool:  # inside the tokenising loop: the first tokens are in the partial directory
        return any(f.stat().st_size > 0 for f in tmp_path.glob(".out.partial-*/train.bin.tmp"))

    deadline = time.monotonic() + 60
    while not writing() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    assert proc.poll() is None, "prepare-data finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == ["disttrain: interrupted"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]


def test_validation_keeps_whole_sequences_of_a_few_long_documents(tmp_path, capsys):
    """Five documents of ~220 KB whose first is a title: the every-20th-document rule alone gave validation a
    49-token title, under one sequence. Now validation holds at least 4 sequences of --seq-len, taken from the
    end of the training text, and every token of the corpus is in exactly one split, in order."""
    from disttrain.cli import main
    from disttrain.data.loader import TokenWindows

    title = "A short title of forty-eight characters, alone."
    body = builtin_splits()["train"]
    long_docs = [re.sub(r"\n+", "\n", " ".join(body[i * 300:(i + 1) * 300]))[:55_000].strip() for i in range(4)]
    (tmp_path / "c.txt").write_text("\n\n".join([title, *long_docs]), encoding="utf-8")
    main(["prepare-data", str(tmp_path / "c.txt"), "--out", str(tmp_path / "out"), "--workers", "1"])
    got = shards(tmp_path / "out")
    assert len(TokenWindows(got["val"], 2048)) == 4 and len(got["train"]) > 200_000  # 4 x 2048 + 1 tokens
    stream = np.concatenate([np.frombuffer(d.encode("utf-8") + b"\0", dtype=np.uint8) for d in [title, *long_docs]])
    assert np.array_equal(np.concatenate([got["train"], got["val"]]), stream)
    assert "warning" not in capsys.readouterr().err

    # A corpus too small to spare 4 sequences keeps its document split and says so, in one line.
    (tmp_path / "small.txt").write_text("\n\n".join(long_docs[0][i:i + 500] for i in range(0, 10_000, 500)))
    main(["prepare-data", str(tmp_path / "small.txt"), "--out", str(tmp_path / "small"), "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {tmp_path / 'small'}: validation holds 501 tokens, "
                                               "fewer than 4 sequences of --seq-len 2048"), err
    assert "data.seq_len up to 500 can validate on it" in err[0]
