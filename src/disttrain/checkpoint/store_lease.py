"""One writer per run when checkpoints live on an object store: lease.py's claim kept as an object
(`<checkpoint.dir>/lease.json`), so two launches on different machines, each with its own local run
directory, still cannot both write one run's checkpoints.

An object store has no rename and no hard link. On S3 (and stores that speak its conditional writes) a claim
is created with `If-None-Match: *` (of two launches starting together exactly one PUT succeeds) and every
later rewrite (renewal, takeover of an expired claim, release) carries `If-Match: <the ETag read>`, so a
launch that lost the object to another cannot overwrite it unnoticed. Other fsspec stores get a plain write
read back to confirm who won: two launches racing within that window could both believe they won, which a
renewal then detects (the loser stops renewing and says so). Expiry is lease.py's: TTL_S without renewal,
or at once when the holder's process is gone and the reader shares its host.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from disttrain.checkpoint import lease
from disttrain.core import storage

log = logging.getLogger(__name__)


def location(checkpoint_dir) -> str:
    return storage.join(checkpoint_dir, lease.LEASE)


def _conditional(fs) -> bool:
    """Whether the store takes S3's If-None-Match / If-Match on a PUT (s3fs passes them through)."""
    return type(fs).__name__ == "S3FileSystem"


def _get(url: str) -> tuple[lease.Claim | None, str | None]:
    """(claim, ETag) of the object, (None, None) when there is none or it does not parse."""
    fs, path = storage.fs_of(url)
    fs.invalidate_cache(path)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
            etag = getattr(f, "details", {}).get("ETag")
    except FileNotFoundError:
        return None, None
    try:
        return lease.Claim(**json.loads(data)), etag
    except (ValueError, TypeError):
        return None, etag


def _put(url: str, data: bytes, etag: str | None) -> bool:
    """Write the claim only if the object is still what we read (`etag`; None: only if there is none)."""
    fs, path = storage.fs_of(url)
    if _conditional(fs):
        try:
            if etag is None:
                fs.pipe_file(path, data, mode="create")
            else:
                fs.pipe_file(path, data, IfMatch=etag)
        except FileExistsError:
            return False
        except OSError as exc:
            if "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower():
                return False
            raise
        return True
    fs.pipe_file(path, data)
    fs.invalidate_cache(path)
    return fs.cat_file(path) == data


def read(checkpoint_dir) -> lease.Claim | None:
    try:
        return _get(location(checkpoint_dir))[0]
    except Exception:  # unreadable now: the checks at start have already reached the store
        return None


def live_other(checkpoint_dir, key: str, ttl: float = lease.TTL_S) -> lease.Claim | None:
    claim = read(checkpoint_dir)
    return claim if claim is not None and claim.key != key and claim.live(time.time(), ttl) else None


class StoreLease(lease.Lease):
    """lease.Lease whose record is an object written conditionally on the ETag it last wrote."""

    def __init__(self, checkpoint_dir, key: str, since: float, etag: str | None):
        self.url, self.key, self.since, self.etag = location(checkpoint_dir), key, since, etag
        self.path = self.url  # for the base class's messages
        self._stop = threading.Event()
        self._thread = None

    def _claim_as(self, released: bool = False) -> bool:
        ok = _put(self.url, self._record(released).encode(), self.etag)
        if ok:
            self.etag = _get(self.url)[1]
        return ok

    def renew(self) -> bool:
        try:
            return self._claim_as()
        except Exception as exc:  # the store is unreachable now: keep trying until the claim would expire
            log.info("could not renew %s: %s", self.url, storage.describe(exc))
            return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._claim_as(released=True)
        except Exception as exc:
            log.info("could not release %s: %s (it expires in %.0f s)", self.url, storage.describe(exc), lease.TTL_S)


def acquire(checkpoint_dir, key: str, ttl: float = lease.TTL_S) -> tuple[StoreLease | None, lease.Claim | None]:
    """Claim the run's checkpoint location for `key`: (the lease, None), or (None, the live claim of another)."""
    url = location(checkpoint_dir)
    current, etag = _get(url)
    if current is not None and current.key != key and current.live(time.time(), ttl):
        return None, current
    held = StoreLease(checkpoint_dir, key, current.since if current is not None and current.key == key
                      else time.time(), etag if (current is not None or etag is not None) else None)
    if not held._claim_as():
        return None, _get(url)[0]
    won = _get(url)[0]
    if won is None or won.key != key:
        return None, won
    return held, None
