"""A slow disk for checkpoint shards: with DISTTRAIN_TEST_SLOW_DISK=SECONDS:MARKER:NAME in the environment (and this
directory on PYTHONPATH), the first write of each process to a stream of DCP's file-system writer under a directory
called NAME (a step's, e.g. step_00000004) first creates the file MARKER, then takes SECONDS. A test waits for
MARKER and so signals the processes in the middle of a real save (tests/test_interrupts.py)."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/workers: dcp_streams

_SETTING = os.environ.get("DISTTRAIN_TEST_SLOW_DISK")


def _install(seconds: float, marker: str, name: str) -> None:
    from dcp_streams import wrap_dcp_streams

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

    wrap_dcp_streams(lambda opened, path: Slow(opened) if name in os.path.normpath(str(path)).split(os.sep)
                     else opened)


if _SETTING:
    _seconds, _marker, _name = _SETTING.split(":", 2)
    _install(float(_seconds), _marker, _name)
