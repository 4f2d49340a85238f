"""Token-shard format: a directory with meta.json, train.bin and val.bin (flat uint16/uint32 tokens).

Files are read through `numpy.memmap`, so a corpus larger than memory costs nothing to open.
Documents are separated by the tokenizer's end-of-document id.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FORMAT = "disttrain-tokens-v1"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def read_meta(directory: str | Path) -> dict:
    meta = json.loads((Path(directory) / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory}/meta.json is not a {FORMAT} shard directory")
    return meta


def open_split(directory: str | Path, split: str) -> np.ndarray:
    meta = read_meta(directory)
    path = Path(directory) / f"{split}.bin"
    if meta["splits"].get(split, 0) == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=meta["dtype"], mode="r")


class ShardWriter:
    """Appends token arrays to `<split>.bin.tmp`; `close()` renames them and writes meta.json last."""

    def __init__(self, directory: str | Path, vocab_size: int, tokenizer: str, eos_id: int | None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.meta = {"format": FORMAT, "dtype": self.dtype.name, "vocab_size": vocab_size,
                     "tokenizer": tokenizer, "eos_id": eos_id, "splits": {s: 0 for s in SPLITS}}
        self._files = {s: open(self.dir / f"{s}.bin.tmp", "wb") for s in SPLITS}

    def append(self, split: str, tokens: np.ndarray) -> None:
        self._files[split].write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self.meta["splits"][split] += int(len(tokens))

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
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=2) + "\n")
        tmp.replace(self.dir / "meta.json")

    def abort(self) -> None:
        for split, f in self._files.items():
            f.close()
            (self.dir / f"{split}.bin.tmp").unlink(missing_ok=True)
