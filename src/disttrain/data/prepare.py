"""`disttrain prepare-data`: text or JSONL files -> token shards (+ tokenizer.json when BPE)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

from disttrain.data.shards import ShardWriter
from disttrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

BATCH_DOCS = 256


def iter_documents(paths: list[Path], text_key: str) -> Iterator[str]:
    """A .jsonl line is one document (its `text_key` field); a text file splits on blank lines."""
    for path in paths:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        record = json.loads(line)
                        if text_key not in record:
                            raise ValueError(f"{path}:{lineno} has no {text_key!r} field (use --text-key)")
                        yield str(record[text_key])
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            yield from (p.strip() for p in text.split("\n\n") if p.strip())


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


def _is_val(doc_index: int, val_fraction: float) -> bool:
    """Every k-th document goes to validation, k = round(1 / val_fraction)."""
    return val_fraction > 0 and doc_index % max(1, round(1 / val_fraction)) == 0


def prepare(paths: list[Path], out: Path, tokenizer: str = "byte", vocab_size: int = 8192,
            val_fraction: float = 0.05, text_key: str = "text", progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer == "byte":
        tok: Tokenizer = ByteTokenizer()
        tok_ref = "byte"
    elif tokenizer == "bpe":
        tok = train_bpe(paths, text_key, vocab_size, out / "tokenizer.json")
        tok_ref = "tokenizer.json"
    else:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        tok = HFTokenizer(out / "tokenizer.json")
        tok_ref = "tokenizer.json"
    writer = ShardWriter(out, tok.vocab_size, tok_ref, tok.eos_id)
    sep = [] if tok.eos_id is None else [tok.eos_id]
    total_bytes = sum(p.stat().st_size for p in paths)
    try:
        from rich.progress import Progress

        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("tokenizing", total=total_bytes)
            batch: list[str] = []
            doc_index = 0

            def flush() -> None:
                nonlocal doc_index
                for ids in tok.encode_batch(batch):
                    split = "val" if _is_val(doc_index, val_fraction) else "train"
                    writer.append(split, np.array(ids + sep))
                    doc_index += 1
                bar.advance(task, sum(len(d.encode("utf-8")) for d in batch))
                batch.clear()

            for doc in iter_documents(paths, text_key):
                batch.append(doc)
                if len(batch) >= BATCH_DOCS:
                    flush()
            flush()
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.meta
