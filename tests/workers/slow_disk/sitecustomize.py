"""A slow disk for checkpoint shards: with DISTTRAIN_TEST_SLOW_DISK=SECONDS:MARKER:NAME in the environment (and this
directory on PYTHONPATH), the first write of each process to a stream of DCP's file-system writer under a directory
called NAME (a step's, e.g. step_00000004) first creates the file MARKER, then takes SECONDS. A test waits for MARKER and so signals the processes in the middle of
a real save (tests/test_interrupts.py)."""

import os
import time

_SETTING = os.environ.get("DISTTRAIN_TEST_SLOW_DISK")


def _install(seconds: float, marker: str, name: str) -> None:
    import contextlib

    from torch.distributed.checkpoint.filesystem import FileSystem

    from disttrain.core import storage

    slow = [True]

    class Slow:
        def __init__(self, stream):
            self._stream = stream

        def write(self, data) -> int:
            if slow[0]:
                slow[0] = False
                open(marker, "a").close()
                time.sleep(seconds)
            return self._stream.write(data)

        def __getattr__(self, name):
            return getattr(self._stream, name)

    class Disk(FileSystem):
        def create_stream(self, path, mode):
            @contextlib.contextmanager
            def stream():
                with FileSystem.create_stream(self, path, mode) as opened:
                    yield Slow(opened) if "w" in mode and name in os.path.normpath(str(path)).split(os.sep) else opened
            return stream()

    dcp_writer = storage.dcp_writer

    def slow_writer(path):
        writer = dcp_writer(path)
        if not storage.is_url(path):
            writer.fs = Disk()
        return writer

    storage.dcp_writer = slow_writer


if _SETTING:
    _seconds, _marker, _name = _SETTING.split(":", 2)
    _install(float(_seconds), _marker, _name)
