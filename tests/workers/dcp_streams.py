"""For the test disk hooks (tests/workers/*_disk/sitecustomize.py): DCP's local file-system writer with each
written stream passed through `wrap(stream, path)` (a stream that fills, a stream that stalls)."""

import contextlib


def wrap_dcp_streams(wrap) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem

    from disttrain.core import storage

    class Disk(FileSystem):
        def create_stream(self, path, mode):
            @contextlib.contextmanager
            def stream():
                with FileSystem.create_stream(self, path, mode) as opened:
                    yield wrap(opened, path) if "w" in mode else opened
            return stream()

    dcp_writer = storage.dcp_writer

    def writer_on_disk(path):
        writer = dcp_writer(path)
        if not storage.is_url(path):
            writer.fs = Disk()
        return writer

    storage.dcp_writer = writer_on_disk
