"""Token shards on an object store (data.source=s3://bucket/prepared, any fsspec URL), read in byte ranges.

A prepared directory on the store is the same files as a local one; a split is one flat array, so a batch of
windows is a handful of ranged GETs (fsspec's random access), never a download of the whole split. With
`data.cache_dir` the ranges read pass through fsspec's block cache on local disk (`blockcache::`), so a
restart or a second epoch reads what it already fetched from there.
"""

from __future__ import annotations

import threading

import numpy as np

from disttrain.core import storage

BLOCK = 4 << 20  # bytes per ranged read and per cached block: a few windows of any model, few requests


def _open(url: str, cache_dir: str):
    if not cache_dir:
        fs, path = storage.fs_of(url)
        return fs.open(path, "rb", block_size=BLOCK, cache_type="readahead")
    import fsspec

    protocol = url.split("://", 1)[0]
    fs = fsspec.filesystem("blockcache", target_protocol=protocol, cache_storage=cache_dir,
                           target_options=storage.client_options(protocol), block_size=BLOCK)
    return fs.open(url, "rb")


class RangeArray:
    """A read-only flat array in an object: len() and slices like a numpy.memmap, each slice one ranged read."""

    def __init__(self, url: str, dtype, cache_dir: str = ""):
        self.url, self.dtype, self.cache_dir = url, np.dtype(dtype), cache_dir
        self._file = _open(url, cache_dir)
        self._length = self._file.size // self.dtype.itemsize
        self._lock = threading.Lock()  # the loader's prefetch thread and the main thread share the file

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice):
            return self[key:key + 1][0] if key >= 0 else self[self._length + key]
        start, stop, step = key.indices(self._length)
        size = self.dtype.itemsize
        with self._lock:
            self._file.seek(start * size)
            data = storage.retried(lambda: self._file.read(max(0, stop - start) * size), f"reading {self.url}")
        return np.frombuffer(data, dtype=self.dtype)[::step]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole.astype(dtype) if dtype is not None else whole

    def __getstate__(self) -> dict:
        return {"url": self.url, "dtype": self.dtype.str, "cache_dir": self.cache_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["dtype"], state["cache_dir"])
