"""Resolve `data.source` + `data.tokenizer` into a tokenizer and token arrays per split."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disttrain.core import storage
from disttrain.data import shards
from disttrain.data.tokenizer import Tokenizer, load_tokenizer
from disttrain.core.errors import UserError


@dataclass(frozen=True)
class SourceInfo:
    vocab_size: int
    tokenizer_name: str
    eos_id: int | None = None


def tokenizer_file(source, tokenizer: str) -> str:
    """A shard directory carries its own tokenizer; `data.tokenizer` applies to the built-in corpus."""
    if source == "builtin":
        return tokenizer
    if isinstance(source, dict):  # a mixture: its sources share one tokenizer (checked by describe_source)
        source = next(iter(source))
    meta = shards.read_meta(source)
    if meta["tokenizer"] == "byte":
        return "byte"
    return local_copy(storage.join(source, meta["tokenizer"])) if storage.is_url(source) else \
        str(Path(source) / meta["tokenizer"])


def local_copy(url: str) -> str:
    """A small file of a remote source (its tokenizer) where the tokenizer library can open it."""
    import tempfile

    target = Path(tempfile.gettempdir()) / "disttrain-remote" / hashlib.sha256(url.encode()).hexdigest()[:16]
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(storage.read_bytes(url))
        tmp.replace(target)
    return str(target)


PY_PREFIX = "py:"


def user_datasets(source: str) -> dict:
    """`py:FILE.py:function` -> {"train": Dataset, "val": Dataset or None}; the function returns a map-style
    Dataset of (input, target) pairs, or a dict with "train" (and optionally "val")."""
    from torch.utils.data import Dataset

    from disttrain.core.user_code import call_user

    value = call_user("data.source", source[len(PY_PREFIX):], (Dataset, dict),
                      "a map-style torch.utils.data.Dataset (or a dict of them with key 'train')", PY_PREFIX)
    splits = value if isinstance(value, dict) else {"train": value}
    if not isinstance(splits.get("train"), Dataset) or not hasattr(splits["train"], "__len__"):
        raise UserError(f"data.source={source}: needs a map-style Dataset (with __len__) for 'train'")
    if len(splits["train"]) == 0:
        raise UserError(f"data.source={source}: the train dataset is empty")
    return {"train": splits["train"], "val": splits.get("val")}


def source_names(mixture: dict) -> list[str]:
    """Short names of a mixture's sources (for metrics): directory names, whole paths where they clash."""
    names = [storage.name_of(p) or str(p) for p in mixture]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, mixture)]


def _tokenizer_identity(directory: str) -> tuple:
    meta = shards.read_meta(directory)
    name = meta["tokenizer"]
    content = name if name == "byte" else hashlib.sha256(storage.read_bytes(storage.join(directory, name))).hexdigest()
    return meta["vocab_size"], meta["eos_id"], content


def describe_mixture(mixture: dict) -> SourceInfo:
    """data.source={DIR: weight, ...}: shard directories with positive weights and one tokenizer."""
    if not mixture:
        raise UserError("data.source={}: a mixture needs at least one DIR: weight entry")
    for path, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            shown = f"{weight:g}" if isinstance(weight, (int, float)) else repr(weight)
            raise UserError(f"data.source: the weight of {path} is {shown} (allowed: a number > 0)")
        if path == "builtin" or str(path).startswith(PY_PREFIX):
            raise UserError(f"data.source: {path} cannot be part of a mixture (allowed: directories written by "
                            "`disttrain prepare-data`)")
        describe_source(str(path), "byte")
    first, *rest = list(mixture)
    for other in rest:
        if _tokenizer_identity(other) != _tokenizer_identity(first):
            raise UserError(f"data.source: {other} was tokenised differently from {first} (a mixture needs one "
                            "tokenizer; prepare both with the same --tokenizer)")
    meta = shards.read_meta(first)
    return SourceInfo(meta["vocab_size"], f"{first}/meta.json", meta.get("eos_id"))


def describe_source(source, tokenizer: str) -> SourceInfo:
    """Validate the data keys without reading any tokens; raises UserError."""
    if isinstance(source, dict):
        return describe_mixture(source)
    if source.startswith(PY_PREFIX):
        user_datasets(source)
        return SourceInfo(0, source)

    if source != "builtin":
        path = source
        if not storage.is_url(source) and not Path(source).is_dir():
            raise UserError(f"data.source={source}: no such directory (allowed: builtin, or a directory "
                              "written by `disttrain prepare-data`)")
        if not storage.isfile(storage.join(source, "meta.json")):
            raise UserError(f"data.source={source}: no meta.json inside (allowed: builtin, or a directory "
                              "written by `disttrain prepare-data`)")
        try:
            meta = shards.read_meta(path)
        except (ValueError, KeyError) as exc:
            raise UserError(f"data.source={source}: {exc}") from None
        if meta["splits"].get("train", 0) == 0:
            raise UserError(f"data.source={source}: the train split holds no tokens")
        return SourceInfo(meta["vocab_size"], f"{source}/meta.json", meta.get("eos_id"))
    if tokenizer != "byte" and not Path(tokenizer).is_file():
        raise UserError(f"data.tokenizer={tokenizer}: no such file (allowed: byte, or a tokenizer.json path)")
    try:
        tok = load_tokenizer(tokenizer)
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"data.tokenizer={tokenizer}: cannot be loaded ({str(exc).splitlines()[0]})") from None
    return SourceInfo(tok.vocab_size, tok.name, tok.eos_id)


def _concat(token_lists: list[list[int]], eos_id: int | None, dtype: np.dtype) -> np.ndarray:
    sep = [] if eos_id is None else [eos_id]
    return np.fromiter((t for ids in token_lists for t in (*ids, *sep)), dtype=dtype)


def split_samples(directory: str, split: str, seq_len: int, packing: bool = False, cache_dir: str = "",
                  padding_free: bool = False):
    """One split of a shard directory: token windows of text, or whole conversations of chat data (`padding_free`:
    each micro-batch's conversations laid into as few rows as hold them, data.padding=none)."""
    from disttrain.data.chat_samples import ChatSamples
    from disttrain.data.loader import TokenWindows

    tokens = shards.open_split(directory, split, cache_dir)
    meta = shards.read_meta(directory)
    if "chat" not in meta and "preference" not in meta:
        return TokenWindows(tokens, seq_len)
    mask, ends = shards.open_mask(directory, split, cache_dir)
    if "preference" in meta:
        from disttrain.data.preference_samples import PreferenceSamples

        return PreferenceSamples(tokens, mask, ends, seq_len, meta["eos_id"] or 0, packing or padding_free)
    return ChatSamples(tokens, mask, ends, seq_len, meta["eos_id"] or 0, packing, padding_free)


def source_tokenizer(source, tokenizer: str) -> Tokenizer:
    """The run's tokenizer; a chat directory's also renders sample prompts through its chat template."""
    first = next(iter(source)) if isinstance(source, dict) else source
    if first not in ("builtin",) and not str(first).startswith(PY_PREFIX) and \
            {"chat", "preference"} & set(shards.read_meta(first)):
        if storage.is_url(first):
            raise UserError(f"data.source={first}: chat data is read from a local directory (its chat template and "
                            "tokenizer files); copy it to local disk (allowed on an object store: text shards)")
        from disttrain.data.tokenizer import ChatTokenizer

        return ChatTokenizer(first)
    return load_tokenizer(tokenizer_file(source, tokenizer))


def load_samples(source, tokenizer: str, seq_len: int, packing: bool = False, cache_dir: str = "",
                 padding_free: bool = False):
    """(tokenizer or None, train samples, val samples): token windows of text or conversations of chat data
    (per source, for a mixture), or a user's datasets. Sources on an object store are read in ranges
    (`cache_dir`: through a local block cache)."""
    from disttrain.data.loader import DatasetSamples, MixtureSamples

    if isinstance(source, dict):
        tok = source_tokenizer(source, tokenizer)
        names = source_names(source)
        train, val = (MixtureSamples(names, [split_samples(d, split, seq_len, packing, cache_dir, padding_free)
                                           for d in source])
                      for split in ("train", "val"))
        for directory, part in zip(source, train.parts):
            if len(part) == 0:
                raise UserError(f"data.source: {directory} holds fewer than data.seq_len+1={seq_len + 1} training "
                                "tokens (a mixture's every source needs at least one sequence)")
        return tok, train, val
    if source.startswith(PY_PREFIX):
        splits = user_datasets(source)
        return None, DatasetSamples(splits["train"]), DatasetSamples(splits["val"])
    from disttrain.data.loader import TokenWindows

    if source != "builtin":
        return (source_tokenizer(source, tokenizer),
                *(split_samples(source, split, seq_len, packing, cache_dir, padding_free) for split in ("train", "val")))
    tok, splits = load_splits(source, tokenizer)
    return tok, TokenWindows(splits["train"], seq_len), TokenWindows(splits["val"], seq_len)


def make_sampler(samples, source, global_batch_size: int, seed: int, shuffle: bool = True):
    """The order a run reads `samples` in: one seeded stream, or one per source of a mixture."""
    from disttrain.data.loader import MixtureSamples
    from disttrain.data.sampling import GlobalBatchSampler, MixtureSampler

    if isinstance(samples, MixtureSamples):
        return MixtureSampler([len(p) for p in samples.parts], list(source.values()), global_batch_size, seed,
                              shuffle)
    return GlobalBatchSampler(len(samples), global_batch_size, seed, shuffle)


def load_splits(source: str, tokenizer: str) -> tuple[Tokenizer, dict[str, np.ndarray]]:
    tok = load_tokenizer(tokenizer_file(source, tokenizer))
    if source != "builtin":
        return tok, {s: shards.open_split(source, s) for s in shards.SPLITS}
    from disttrain.data.corpus import builtin_splits

    dtype = shards.token_dtype(tok.vocab_size)
    return tok, {s: _concat(tok.encode_batch(docs), tok.eos_id, dtype) for s, docs in builtin_splits().items()}


def truncation_warnings(source, samples, seq_len: int) -> list[str]:
    """One line when chat data holds conversations longer than a sequence: they are cut to it."""
    parts = getattr(samples, "parts", [samples])
    cut = sum(getattr(p, "truncated", 0) for p in parts)
    what = "pairs hold a sequence" if getattr(samples, "pairs", False) else "conversations are"
    return [f"data.source={source}: {cut} training {what} longer than data.seq_len+1={seq_len + 1} "
            "tokens and are cut to it (the cut part carries no loss)"] if cut else []


def validation_gaps(source, val_samples, seq_len: int) -> list[str]:
    """One line per source whose validation cannot run (no split, or shorter than one sequence), said at the
    start of training: evaluation skips it, and a mixture's would otherwise just be missing from
    `val_loss_by_source`."""
    from disttrain.data.loader import MixtureSamples, TokenWindows

    need = f"fewer than data.seq_len+1={seq_len + 1}"
    if isinstance(val_samples, MixtureSamples):
        return [f"data.source: {d}'s validation split holds {len(part.tokens)} tokens, {need}: it is left out of "
                f"validation (val_loss_by_source)" for d, part in zip(source, val_samples.parts) if len(part) == 0]
    if len(val_samples):
        return []
    if hasattr(val_samples, "rows"):  # chat data
        return [f"data.source={source}: the validation split holds no conversations: nothing is validated"]
    if isinstance(val_samples, TokenWindows):
        return [f"data.source={source}: the validation split holds {len(val_samples.tokens)} tokens, {need}: "
                "nothing is validated"]
    return [f"data.source={source}: no 'val' dataset: nothing is validated"]
