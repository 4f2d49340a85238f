"""Token-shard format: a directory with meta.json, train.bin and val.bin (flat uint16/uint32 tokens).

Files are read through `numpy.memmap`, so a corpus larger than memory costs nothing to open; a directory on an
object store (an fsspec URL) is read in byte ranges instead (remote.py), with an optional local cache.
Documents are separated by the tokenizer's end-of-document id. Chat and instruction data (`meta["chat"]`)
also keep `<split>.mask.bin` (uint8 per token: 1 where the token is a target that carries loss) and
`<split>.ends.npy` (int64: where each conversation ends), so training can pad or pack whole conversations.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from disttrain.core import storage

FORMAT = "disttrain-tokens-v1"
SPLITS = ("train", "val")


def is_val_document(doc_index: int, val_fraction: float) -> bool:
    """Documents k, 2k, 3k, ... (counting from 1) go to validation, k = round(1 / val_fraction); a corpus of
    fewer documents keeps them all for training (its validation comes from the end of the stream)."""
    k = max(1, round(1 / val_fraction)) if val_fraction > 0 else 0
    return k > 0 and doc_index % k == k - 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def read_meta(directory: str | Path) -> dict:
    meta = json.loads(storage.read_text(storage.join(directory, "meta.json")))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory}/meta.json is not a {FORMAT} shard directory")
    return meta


def _flat(directory: str | Path, name: str, dtype, cache_dir: str):
    if storage.is_url(directory):
        from disttrain.data.remote import RangeArray

        return RangeArray(storage.join(directory, name), dtype, cache_dir)
    return np.memmap(Path(directory) / name, dtype=dtype, mode="r")


def open_mask(directory: str | Path, split: str, cache_dir: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(per-token loss mask, conversation ends) of a chat split."""
    meta = read_meta(directory)
    if meta["splits"].get(split, 0) == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    ends = np.load(io.BytesIO(storage.read_bytes(storage.join(directory, f"{split}.ends.npy"))))
    return _flat(directory, f"{split}.mask.bin", np.uint8, cache_dir), ends


def open_split(directory: str | Path, split: str, cache_dir: str = ""):
    """A split's tokens: a numpy.memmap, or for a URL an array read in ranges (`cache_dir`: cache them there)."""
    meta = read_meta(directory)
    if meta["splits"].get(split, 0) == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return _flat(directory, f"{split}.bin", meta["dtype"], cache_dir)


class ShardWriter:
    """Appends token arrays to `<split>.bin.tmp`; `close()` renames them and writes meta.json last."""

    def __init__(self, directory: str | Path, vocab_size: int, tokenizer: str, eos_id: int | None,
                 masks: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.meta = {"format": FORMAT, "dtype": self.dtype.name, "vocab_size": vocab_size,
                     "tokenizer": tokenizer, "eos_id": eos_id, "splits": {s: 0 for s in SPLITS}}
        self._files = {s: open(self.dir / f"{s}.bin.tmp", "wb") for s in SPLITS}
        self._masks = {s: open(self.dir / f"{s}.mask.bin.tmp", "wb") for s in SPLITS} if masks else {}
        self._ends: dict[str, list[int]] = {s: [] for s in SPLITS}

    def append(self, split: str, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        self._files[split].write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self.meta["splits"][split] += int(len(tokens))
        if mask is not None:  # one whole conversation
            self._masks[split].write(np.asarray(mask, dtype=np.uint8).tobytes())
            self._ends[split].append(self.meta["splits"][split])

    def move_tail(self, src: str, dst: str, count: int) -> None:
        """Move the last `count` tokens of split `src` to the end of split `dst` (before close)."""
        f, width = self._files[src], self.dtype.itemsize
        f.flush()
        keep = (self.meta["splits"][src] - count) * width
        with open(self.dir / f"{src}.bin.tmp", "rb") as reader:
            reader.seek(keep)
            self._files[dst].write(reader.read())
        f.truncate(keep)
        f.seek(keep)
        self.meta["splits"][src] -= count
        self.meta["splits"][dst] += count

    def close(self) -> None:
        for split, f in self._files.items():
            f.close()
            (self.dir / f"{split}.bin.tmp").replace(self.dir / f"{split}.bin")
        for split, f in self._masks.items():
            f.close()
            (self.dir / f"{split}.mask.bin.tmp").replace(self.dir / f"{split}.mask.bin")
            np.save(self.dir / f"{split}.ends.npy", np.asarray(self._ends[split], dtype=np.int64))
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=2) + "\n")
        tmp.replace(self.dir / "meta.json")

    def abort(self) -> None:
        for split, f in self._files.items():
            f.close()
            (self.dir / f"{split}.bin.tmp").unlink(missing_ok=True)
        for split, f in self._masks.items():
            f.close()
            (self.dir / f"{split}.mask.bin.tmp").unlink(missing_ok=True)
