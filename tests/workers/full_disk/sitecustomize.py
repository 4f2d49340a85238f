"""A full disk without a mount: with DISTTRAIN_TEST_FULL_DISK=BYTES:DIR in the environment (and this directory on
PYTHONPATH), DIR is a "disk" of BYTES, as a full file system behaves: the files under DIR count against it, the
write that would pass it writes what fits and raises OSError(ENOSPC), and its free space (shutil.disk_usage) reads
what is left. The writers are the two a checkpoint save uses (disttrain.core.storage): DCP's file-system writer (its
streams: the shards and .metadata) and write_bytes (train_state.pt, the ranks' RNG files, COMMIT).
tests/test_object_storage.py.
"""

import errno
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/workers: dcp_streams

_SETTING = os.environ.get("DISTTRAIN_TEST_FULL_DISK")


def _install(capacity: int, root: str) -> None:
    from dcp_streams import wrap_dcp_streams

    from disttrain.core import storage

    def used() -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
                   if os.path.isfile(os.path.join(d, f)))

    def on_disk(path) -> bool:
        return os.path.abspath(str(path)).startswith(root + os.sep)

    def no_space(path) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    class Filling:
        """A stream on the disk: writes past its free space write what fits, then fail."""

        def __init__(self, stream, path):
            self._stream, self._path, self._free = stream, path, capacity - used()

        def write(self, data) -> int:
            view = memoryview(data).cast("B")
            if len(view) > self._free:
                self._stream.write(view[:max(self._free, 0)])
                self._free = 0
                raise no_space(self._path)
            self._free -= len(view)
            return self._stream.write(view)

        def __getattr__(self, name):
            return getattr(self._stream, name)

    wrap_dcp_streams(lambda opened, path: Filling(opened, path) if on_disk(path) else opened)
    write_bytes = storage.write_bytes

    def bytes_on_disk(path, data: bytes) -> None:
        if on_disk(path) and len(data) > capacity - used():
            raise no_space(path)  # write_bytes writes aside and renames: a failed write leaves nothing
        write_bytes(path, data)

    storage.write_bytes = bytes_on_disk

    import shutil

    disk_usage = shutil.disk_usage

    def usage_on_disk(path):
        if not (on_disk(path) or os.path.abspath(str(path)) == root):
            return disk_usage(path)
        taken = used()
        return type(disk_usage(os.sep))(capacity, taken, max(capacity - taken, 0))  # (total, used, free)

    shutil.disk_usage = usage_on_disk


if _SETTING:
    _bytes, _dir = _SETTING.split(":", 1)
    _install(int(_bytes), os.path.abspath(_dir))
