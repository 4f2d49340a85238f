"""One writer per run: a lease (`lease.json`) that the holding launch renews, kept in the run directory and, when
checkpoints live on an object store, beside them as well.

A lock file would outlive a crashed holder; a lease expires: its holder rewrites it every RENEW_S seconds, and a
claim not renewed for TTL_S seconds (or whose holder process is gone, when the reader shares its host and process
namespace) is free. The claim is keyed by what a job keeps across its own restarts, so that they are never
refused by their own earlier claim:

- a SLURM job (a requeued job keeps SLURM_JOB_ID),
- a launch of `disttrain train --nproc-per-node` (torchrun's restarts of its workers happen inside it;
  the nodes of a multi-node launch share its --rdzv-id and --rdzv-endpoint, a replacement node too),
- a plain torchrun launch (TORCHELASTIC_RUN_ID: --rdzv-id, or torchrun's own id under --standalone),
- else one process.

Where the record lives is a `Record`: a file in the run directory (`FileRecord`: written to a temporary file and
renamed into place, a fresh claim created exclusively with a hard link, read back to confirm who won; works on a
shared file system) or an object beside remote checkpoints (`ObjectRecord`), so that two launches on different
machines, each with its own local run directory, still cannot both write one run's checkpoints. One `Lease`
renews either from one thread.

An object store has no rename and no hard link. On S3 (and stores that speak its conditional writes) a claim is
created with `If-None-Match: *` (of two launches starting together exactly one PUT succeeds) and every later
rewrite (renewal, takeover of an expired claim, release) carries `If-Match: <the ETag read>`, so a launch that
lost the object to another cannot overwrite it unnoticed. Other fsspec stores get a plain write read back to
confirm who won: two launches racing within that window could both believe they won, which a renewal then
detects (the loser stops renewing and says so).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Protocol

from disttrain.core import storage

log = logging.getLogger(__name__)

LEASE = "lease.json"
RENEW_S = 10.0  # the holder rewrites its claim this often
TTL_S = 60.0  # a claim not renewed for this long is free (a crashed holder on another host)
KEY_ENV = "DISTTRAIN_RUN_KEY"  # set by disttrain's launcher for its workers: the launcher holds the claim


@dataclass(frozen=True)
class Claim:
    key: str
    host: str
    pid: int
    pidns: int  # the holder's process-namespace id: its pid means something only inside it
    since: float
    renewed: float
    released: bool = False

    def live(self, now: float, ttl: float = TTL_S) -> bool:
        if self.released or now - self.renewed > ttl:
            return False
        if self.host == socket.gethostname() and self.pidns and self.pidns == _pidns():
            return _alive(self.pid)
        return True

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        ago = max(0.0, time.time() - self.renewed)
        return f"host {self.host}, pid {self.pid}, since {since}, renewed {ago:.0f} s ago"


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_key(environ: Mapping[str, str] = os.environ) -> str:
    """The claim key of a process that is not under disttrain's launcher."""
    if environ.get(KEY_ENV):
        return environ[KEY_ENV]
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-job-{environ['SLURM_JOB_ID']}"
    if environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{environ['TORCHELASTIC_RUN_ID']}"
    return f"process-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def launch_key(rdzv_id: str | None, rdzv_endpoint: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The claim key of a `disttrain train --nproc-per-node` launch (every node of it computes the same)."""
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-job-{environ['SLURM_JOB_ID']}"
    if rdzv_endpoint:
        return f"rdzv-{rdzv_id or 'none'}@{rdzv_endpoint}"
    return f"launch-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def parse(data: bytes | str) -> Claim | None:
    try:
        return Claim(**json.loads(data))
    except (ValueError, TypeError):  # a record torn by a crash mid-write: no claim
        return None


class Record(Protocol):
    """Where a claim is kept. `version` is what a read saw (None: no record at all), for a conditional rewrite."""

    where: str

    def read(self) -> tuple[Claim | None, object]: ...

    def create(self, data: str) -> None: ...  # only if there is none (of two creators, one wins)

    def rewrite(self, data: str, key: str, version, takeover: bool = False) -> tuple[bool, object]: ...
    # False: no longer `key`'s; `takeover`: the record was read free (released, expired) and is claimed

    def release(self, data: str, key: str, version) -> None: ...


class FileRecord:
    """The claim as `<run dir>/lease.json`."""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / LEASE
        self.where = str(self.path)

    def read(self) -> tuple[Claim | None, object]:
        try:
            return parse(self.path.read_text()), "present"
        except FileNotFoundError:
            return None, None
        except OSError:
            return None, "present"

    def _tmp(self, data: str) -> Path:
        tmp = self.path.with_name(f".{LEASE}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(data)
        return tmp

    def create(self, data: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp(data)
        try:
            os.link(tmp, self.path)  # exclusive: of two launches starting together, one creates the claim
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)

    def rewrite(self, data: str, key: str, version, takeover: bool = False) -> tuple[bool, object]:
        claim, version = self.read()
        if not takeover and claim is not None and claim.key != key and not claim.released:
            return False, version  # taken over
        try:
            self._tmp(data).replace(self.path)
        except OSError:  # the run directory is gone
            return False, version
        return True, "present"

    def release(self, data: str, key: str, version) -> None:
        claim, _ = self.read()
        if claim is not None and claim.key == key:
            try:
                self._tmp(data).replace(self.path)
            except OSError:
                pass


def location(checkpoint_dir) -> str:
    return storage.join(checkpoint_dir, LEASE)


def _conditional(fs) -> bool:
    """Whether the store takes S3's If-None-Match / If-Match on a PUT (s3fs passes them through)."""
    return type(fs).__name__ == "S3FileSystem"


def get(url: str) -> tuple[Claim | None, str | None]:
    """(claim, ETag) of the object, (None, None) when there is none."""
    fs, path = storage.fs_of(url)
    fs.invalidate_cache(path)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
            etag = getattr(f, "details", {}).get("ETag")
    except FileNotFoundError:
        return None, None
    return parse(data), etag


def put(url: str, data: bytes, etag: str | None) -> bool:
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


class ObjectRecord:
    """The claim as an object; `version` is the ETag this launch last wrote or read."""

    def __init__(self, checkpoint_dir):
        self.where = location(checkpoint_dir)

    def read(self) -> tuple[Claim | None, object]:
        return get(self.where)

    def create(self, data: str) -> None:
        put(self.where, data.encode(), None)

    def rewrite(self, data: str, key: str, version, takeover: bool = False) -> tuple[bool, object]:
        try:
            ok = put(self.where, data.encode(), version)
            return ok, get(self.where)[1] if ok else version
        except Exception as exc:  # the store is unreachable now: keep trying until the claim would expire
            log.info("could not renew %s: %s", self.where, storage.describe(exc))
            return True, version

    def release(self, data: str, key: str, version) -> None:
        try:
            put(self.where, data.encode(), version)
        except Exception as exc:
            log.info("could not release %s: %s (it expires in %.0f s)", self.where, storage.describe(exc), TTL_S)


class Lease:
    """A held claim on a record; `start()` renews it from a daemon thread until `release()`."""

    def __init__(self, record: Record, key: str, since: float, version=None):
        self.record, self.key, self.since, self.version = record, key, since, version
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim_text(self, released: bool = False) -> str:
        return json.dumps(asdict(Claim(self.key, socket.gethostname(), os.getpid(), _pidns(), self.since,
                                       time.time(), released)))

    def renew(self) -> bool:
        """Rewrite the claim; False when it is no longer ours (taken over, or the run directory removed)."""
        ok, self.version = self.record.rewrite(self.claim_text(), self.key, self.version)
        return ok

    def start(self, every: float = RENEW_S) -> "Lease":
        def beat() -> None:
            while not self._stop.wait(every):
                if not self.renew():
                    log.warning("no longer holds %s (taken over, or the run directory is gone)", self.record.where)
                    return

        self._thread = threading.Thread(target=beat, name="disttrain-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Mark the claim released (kept as a record of the last holder: its own job may start over there)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.record.release(self.claim_text(released=True), self.key, self.version)


def record_for(where) -> Record:
    """A run directory's record, or the one beside checkpoints on an object store (a URL)."""
    return ObjectRecord(where) if storage.is_url(where) else FileRecord(where)


def read(where) -> Claim | None:
    try:
        return record_for(where).read()[0]
    except Exception:  # a store unreachable now: the checks at start have already reached it
        return None


def live_other(where, key: str, ttl: float = TTL_S) -> Claim | None:
    """The live claim of another job on `where` (a run directory or a checkpoint URL), if any (reads only)."""
    claim = read(where)
    return claim if claim is not None and claim.key != key and claim.live(time.time(), ttl) else None


def acquire(where, key: str, ttl: float = TTL_S) -> tuple[Lease | None, Claim | None]:
    """Claim `where` for `key`: (the lease, None), or (None, the live claim of whoever holds it). Creates a run
    directory that does not exist."""
    record = record_for(where)
    if isinstance(record, FileRecord):
        record.path.parent.mkdir(parents=True, exist_ok=True)
    current, version = record.read()
    if current is not None and current.key != key and current.live(time.time(), ttl):
        return None, current
    lease = Lease(record, key, current.since if current is not None and current.key == key else time.time(), version)
    if current is None and version is None:
        record.create(lease.claim_text())
    else:  # ours already (a restart of this job), or free (released, expired, its holder gone)
        record.rewrite(lease.claim_text(), key, version, takeover=True)
    won, lease.version = record.read()
    if won is None or won.key != key:
        return None, won
    return lease, None
