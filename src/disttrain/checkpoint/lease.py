"""One writer per run: a lease in the run directory (`lease.json`) that the holding launch renews.

A lock file would outlive a crashed holder; a lease expires: its holder rewrites it every RENEW_S
seconds, and a claim not renewed for TTL_S seconds (or whose holder process is gone, when the reader
shares its host and process namespace) is free. The claim is keyed by what a job keeps across its own
restarts, so that they are never refused by their own earlier claim:

- a SLURM job (a requeued job keeps SLURM_JOB_ID),
- a launch of `disttrain train --nproc-per-node` (torchrun's restarts of its workers happen inside it;
  the nodes of a multi-node launch share its --rdzv-id and --rdzv-endpoint, a replacement node too),
- a plain torchrun launch (TORCHELASTIC_RUN_ID: --rdzv-id, or torchrun's own id under --standalone),
- else one process.

Works on a shared file system: the record is written to a temporary file and renamed into place
(a fresh claim is created exclusively with a hard link), and read back to confirm who won. Checkpoints on an
object store get the same claim as an object there as well (store_lease.py).
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
from typing import Mapping

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


def read(run_dir: Path) -> Claim | None:
    try:
        return Claim(**json.loads((Path(run_dir) / LEASE).read_text()))
    except (OSError, ValueError, TypeError):  # none, or a record torn by a crash mid-write: no claim
        return None


def live_other(run_dir: Path, key: str, ttl: float = TTL_S) -> Claim | None:
    """The live claim of another job on `run_dir`, if any (reads only)."""
    claim = read(run_dir)
    return claim if claim is not None and claim.key != key and claim.live(time.time(), ttl) else None


class Lease:
    """A held claim; `start()` renews it from a daemon thread until `release()`."""

    def __init__(self, run_dir: Path, key: str, since: float):
        self.path, self.key, self.since = Path(run_dir) / LEASE, key, since
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, released: bool = False) -> str:
        now = time.time()
        return json.dumps(asdict(Claim(self.key, socket.gethostname(), os.getpid(), _pidns(), self.since, now,
                                       released)))

    def _write(self, released: bool = False) -> None:
        tmp = self.path.with_name(f".{LEASE}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(self._record(released))
        tmp.replace(self.path)

    def renew(self) -> bool:
        """Rewrite the claim; False when it is no longer ours (taken over, or the run directory removed)."""
        claim = read(self.path.parent)
        if claim is not None and claim.key != self.key and not claim.released:
            return False
        try:
            self._write()
        except OSError:
            return False
        return True

    def start(self, every: float = RENEW_S) -> "Lease":
        def beat() -> None:
            while not self._stop.wait(every):
                if not self.renew():
                    log.warning("no longer holds %s (taken over, or the run directory is gone)", self.path)
                    return

        self._thread = threading.Thread(target=beat, name="disttrain-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Mark the claim released (kept as a record of the last holder: its own job may start over there)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        claim = read(self.path.parent)
        if claim is not None and claim.key == self.key:
            try:
                self._write(released=True)
            except OSError:
                pass


def acquire(run_dir: Path, key: str, ttl: float = TTL_S) -> tuple[Lease | None, Claim | None]:
    """Claim `run_dir` for `key`: (the lease, None), or (None, the live claim of whoever holds it).
    Creates the run directory."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LEASE
    current = read(run_dir)
    if current is not None and current.key != key and current.live(time.time(), ttl):
        return None, current
    lease = Lease(run_dir, key, current.since if current is not None and current.key == key else time.time())
    if current is None and not path.exists():
        tmp = path.with_name(f".{LEASE}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(lease._record())
        try:
            os.link(tmp, path)  # exclusive: of two launches starting together, one creates the claim
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    else:  # ours already (a restart of this job), or free (released, expired, its holder gone)
        lease._write()
    won = read(run_dir)
    if won is None or won.key != key:
        return None, won
    return lease, None
