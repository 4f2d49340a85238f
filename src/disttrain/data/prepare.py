"""`disttrain prepare-data`: documents (data/readers.py) -> token shards (+ tokenizer.json when BPE).

Streams the input (memory bounded by a few batches of documents), tokenises batches in worker
processes (`workers`; results are taken in input order, so the shards are the same for any number
of workers), shows documents/s and tokens/s, and builds the shard directory under a temporary name
that becomes `out` only when everything is written: an error or Ctrl-C leaves nothing behind.

Validation: every k-th document (k = round(1 / val_fraction), 20 by default) and at least
VAL_SEQUENCES whole sequences of `seq_len` tokens, taken from the end of the training stream when
those documents hold fewer; a corpus too small to spare them (validation would exceed half of it)
keeps its document split and `split_warning` says so.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

from disttrain.data.readers import iter_documents
from disttrain.data.shards import ShardWriter
from disttrain.data.shards import is_val_document as _is_val
from disttrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

BATCH_DOCS = 256
VAL_FRACTION = 0.05  # the default: every 20th document
VAL_SEQ_LEN = 2048  # the default sequence length the validation minimum counts in
VAL_SEQUENCES = 4  # validation holds at least this many sequences (one is too noisy to compare runs by)
_worker_tok: Tokenizer | None = None


def train_bpe(paths: list[Path], text_key: str, vocab_size: int, out: Path) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter_documents(paths, text_key), trainer=trainer)
    tok.save(str(out))
    return HFTokenizer(out)


def _init_worker(tokenizer: str) -> None:
    global _worker_tok
    _worker_tok = load_tokenizer(tokenizer)


def _encode(batch: list[str]) -> tuple[list[np.ndarray], int]:
    """(token arrays, input bytes) of one batch, in a worker."""
    return [np.asarray(ids, dtype=np.int64) for ids in _worker_tok.encode_batch(batch)], \
        sum(len(d.encode("utf-8")) for d in batch)


def _batches(paths: list[Path], text_key: str) -> Iterator[list[str]]:
    docs = iter_documents(paths, text_key)
    while batch := list(itertools.islice(docs, BATCH_DOCS)):
        yield batch


def _encoded(paths: list[Path], text_key: str, tokenizer: str, workers: int) -> Iterator[tuple[list[np.ndarray], int]]:
    if workers <= 1:
        _init_worker(tokenizer)
        yield from map(_encode, _batches(paths, text_key))
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        # imap keeps input order; `chunksize` 1 bounds what is in flight to a few batches per worker
        yield from pool.imap(_encode, _batches(paths, text_key), chunksize=1)


def resolve_tokenizer(spec: str) -> str:
    """byte, bpe, a tokenizer.json, or a Hugging Face model directory holding one."""
    if spec not in ("byte", "bpe") and Path(spec).is_dir():
        return str(Path(spec) / "tokenizer.json")
    return spec


def val_tokens_wanted(seq_len: int) -> int:
    """Tokens that make VAL_SEQUENCES non-overlapping windows of seq_len inputs plus their shifted targets."""
    return VAL_SEQUENCES * seq_len + 1


def split_warning(meta: dict, seq_len: int, val_fraction: float) -> str | None:
    """One line when validation holds fewer than VAL_SEQUENCES sequences of `seq_len` (None: it does, or
    validation was switched off with val_fraction 0)."""
    val, train = meta["splits"]["val"], meta["splits"]["train"]
    if val_fraction == 0 or val >= val_tokens_wanted(seq_len):
        return None
    usable = f"data.seq_len up to {val - 1}" if val > 1 else "no data.seq_len"
    return (f"validation holds {val:,} tokens, fewer than {VAL_SEQUENCES} sequences of --seq-len {seq_len} "
            f"({val_tokens_wanted(seq_len):,} tokens): the corpus ({val + train:,} tokens) cannot spare them; "
            f"{usable} can validate on it (give more text, or a smaller --seq-len)")


def prepare(paths: list[Path], out: Path, tokenizer: str = "byte", vocab_size: int = 8192,
            val_fraction: float = VAL_FRACTION, text_key: str = "text", progress: bool = True,
            workers: int | None = None, seq_len: int = VAL_SEQ_LEN) -> dict:
    workers = workers or os.cpu_count() or 1
    out = Path(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from disttrain.data.chat_prepare import is_chat_input, write_chat
        from disttrain.data.preference_prepare import is_preference_input, write_preference

        if is_preference_input(paths):  # pairs of completions: rendered by the tokenizer's chat template
            meta = write_preference(paths, tmp, tokenizer, val_fraction, seq_len)
        elif is_chat_input(paths):  # chat or instruction records: rendered by the tokenizer's chat template
            meta = write_chat(paths, tmp, tokenizer, val_fraction, seq_len)
        else:
            meta = _write(paths, tmp, resolve_tokenizer(tokenizer), vocab_size, val_fraction, text_key, progress,
                          workers, val_tokens_wanted(seq_len) if val_fraction > 0 else 0)
        if out.exists():  # --force: the old directory goes only once the new one is complete
            shutil.rmtree(out)
        tmp.rename(out)
        return meta
    except BaseException:  # errors and Ctrl-C alike: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(paths, out: Path, tokenizer: str, vocab_size: int, val_fraction: float, text_key: str, progress: bool,
           workers: int, val_minimum: int) -> dict:
    if tokenizer == "byte":
        tok: Tokenizer = ByteTokenizer()
        tok_ref = tok_path = "byte"
    elif tokenizer == "bpe":
        tok = train_bpe(paths, text_key, vocab_size, out / "tokenizer.json")
        tok_ref, tok_path = "tokenizer.json", str(out / "tokenizer.json")
    else:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        tok = HFTokenizer(out / "tokenizer.json")
        tok_ref, tok_path = "tokenizer.json", str(out / "tokenizer.json")
    writer = ShardWriter(out, tok.vocab_size, tok_ref, tok.eos_id)
    sep = np.array([] if tok.eos_id is None else [tok.eos_id], dtype=np.int64)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("tokenizing"), BarColumn(), TextColumn("{task.fields[docs]:,} docs ({task.fields[dps]:,.0f}/s)"),
               TextColumn("{task.fields[tokens]:,} tokens ({task.fields[tps]:,.0f}/s)"), TimeElapsedColumn())
    doc_index = tokens = 0
    try:
        with Progress(*columns, disable=not progress, transient=True) as bar:
            task = bar.add_task("tokenizing", total=None, docs=0, dps=0.0, tokens=0, tps=0.0)
            for arrays, nbytes in _encoded(paths, text_key, tok_path, workers):
                for ids in arrays:
                    writer.append("val" if _is_val(doc_index, val_fraction) else "train", np.concatenate([ids, sep]))
                    doc_index += 1
                    tokens += len(ids) + len(sep)
                elapsed = max(bar.tasks[0].elapsed or 0.0, 1e-9)
                bar.update(task, advance=nbytes, docs=doc_index, dps=doc_index / elapsed, tokens=tokens,
                           tps=tokens / elapsed)
    except BaseException:
        writer.abort()
        raise
    if doc_index == 0:
        writer.abort()
        raise ValueError(f"inputs {', '.join(map(str, paths))}: no documents (empty corpus)")
    splits = writer.meta["splits"]
    short = val_minimum - splits["val"]
    if short > 0 and splits["train"] - short >= val_minimum:  # validation never takes more than half
        writer.move_tail("train", "val", short)
    writer.close()
    return writer.meta
