"""Resolve `data.source` + `data.tokenizer` into a tokenizer and token arrays per split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disttrain.data import shards
from disttrain.data.tokenizer import Tokenizer, load_tokenizer
from disttrain.errors import UserError


@dataclass(frozen=True)
class SourceInfo:
    vocab_size: int
    tokenizer_name: str


def _tokenizer_spec(source: str, tokenizer: str) -> str:
    """A shard directory carries its own tokenizer; `data.tokenizer` applies to the built-in corpus."""
    if source == "builtin":
        return tokenizer
    meta = shards.read_meta(source)
    return "byte" if meta["tokenizer"] == "byte" else str(Path(source) / meta["tokenizer"])


PY_PREFIX = "py:"


def user_datasets(source: str) -> dict:
    """`py:FILE.py:function` -> {"train": Dataset, "val": Dataset or None}; the function returns a map-style
    Dataset of (input, target) pairs, or a dict with "train" (and optionally "val")."""
    from torch.utils.data import Dataset

    from disttrain.user_code import call_user

    value = call_user("data.source", source[len(PY_PREFIX):], (Dataset, dict),
                      "a map-style torch.utils.data.Dataset (or a dict of them with key 'train')", PY_PREFIX)
    splits = value if isinstance(value, dict) else {"train": value}
    if not isinstance(splits.get("train"), Dataset) or not hasattr(splits["train"], "__len__"):
        raise UserError(f"data.source={source}: needs a map-style Dataset (with __len__) for 'train'")
    if len(splits["train"]) == 0:
        raise UserError(f"data.source={source}: the train dataset is empty")
    return {"train": splits["train"], "val": splits.get("val")}


def describe_source(source: str, tokenizer: str) -> SourceInfo:
    """Validate the data keys without reading any tokens; raises UserError."""
    if source.startswith(PY_PREFIX):
        user_datasets(source)
        return SourceInfo(0, source)

    if source != "builtin":
        path = Path(source)
        if not path.is_dir():
            raise UserError(f"data.source={source}: no such directory (allowed: builtin, or a directory "
                              "written by `disttrain prepare-data`)")
        if not (path / "meta.json").is_file():
            raise UserError(f"data.source={source}: no meta.json inside (allowed: builtin, or a directory "
                              "written by `disttrain prepare-data`)")
        try:
            meta = shards.read_meta(path)
        except (ValueError, KeyError) as exc:
            raise UserError(f"data.source={source}: {exc}") from None
        if meta["splits"].get("train", 0) == 0:
            raise UserError(f"data.source={source}: the train split holds no tokens")
        return SourceInfo(meta["vocab_size"], f"{source}/meta.json")
    if tokenizer != "byte" and not Path(tokenizer).is_file():
        raise UserError(f"data.tokenizer={tokenizer}: no such file (allowed: byte, or a tokenizer.json path)")
    try:
        tok = load_tokenizer(tokenizer)
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"data.tokenizer={tokenizer}: cannot be loaded ({str(exc).splitlines()[0]})") from None
    return SourceInfo(tok.vocab_size, tok.name)


def _concat(token_lists: list[list[int]], eos_id: int | None, dtype: np.dtype) -> np.ndarray:
    sep = [] if eos_id is None else [eos_id]
    return np.fromiter((t for ids in token_lists for t in (*ids, *sep)), dtype=dtype)


def load_samples(source: str, tokenizer: str, seq_len: int):
    """(tokenizer or None, train samples, val samples): token windows of text, or a user's datasets."""
    from disttrain.data.loader import DatasetSamples, TokenWindows

    if source.startswith(PY_PREFIX):
        splits = user_datasets(source)
        return None, DatasetSamples(splits["train"]), DatasetSamples(splits["val"])
    tok, splits = load_splits(source, tokenizer)
    return tok, TokenWindows(splits["train"], seq_len), TokenWindows(splits["val"], seq_len)


def load_splits(source: str, tokenizer: str) -> tuple[Tokenizer, dict[str, np.ndarray]]:
    tok = load_tokenizer(_tokenizer_spec(source, tokenizer))
    if source != "builtin":
        return tok, {s: shards.open_split(source, s) for s in shards.SPLITS}
    from disttrain.data.corpus import builtin_splits

    dtype = shards.token_dtype(tok.vocab_size)
    return tok, {s: _concat(tok.encode_batch(docs), tok.eos_id, dtype) for s, docs in builtin_splits().items()}
