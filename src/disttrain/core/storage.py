"""One set of file operations for checkpoint locations: local paths and fsspec URLs (s3://, gs://, az://, ...).

Local paths keep their POSIX guarantees (a file renamed into place appears whole). On an object store a
single PUT is atomic too: an object is either absent or complete, so a record written last (COMMIT) still
marks a complete checkpoint. Everything goes through fsspec (s3fs for s3://); `pathlib` never sees a URL
(it would turn `s3://b/p` into `s3:/b/p`). Credentials come from where the store's own client finds them
(environment, profile, `AWS_ENDPOINT_URL`); nothing here reads, logs or stores them.

Transient store errors (a dropped connection, throttling) are retried with exponential backoff on top of the
client's own retries; what still fails is raised to the caller, which names the location in one line
(describe() says what failed).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import posixpath
import time
import uuid
from typing import Callable, TypeVar

from disttrain.core.errors import UserError

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRIES_ENV = "DISTTRAIN_STORAGE_RETRIES"  # attempts after the first, ours (3 unless set; read at each call)
BACKOFF_S = 0.5  # first wait; doubled each time
COMMIT = "COMMIT"  # a checkpoint directory is whole once this file exists (checkpoint/manager.py writes it last)


def is_url(path) -> bool:
    """An fsspec URL other than a plain local path (file:// counts as local)."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def where(path) -> str:
    """The bucket (or local directory) a location lives in, for messages."""
    text = str(path)
    if is_url(text):
        protocol, rest = text.split("://", 1)
        return f"{protocol}://{rest.split('/', 1)[0]}"
    return text


def join(base, *names: str) -> str:
    base = str(base)
    return posixpath.join(base, *names) if is_url(base) else os.path.join(base, *names)


def name_of(path) -> str:
    return posixpath.basename(str(path).rstrip("/"))


def parent_of(path) -> str:
    text = str(path).rstrip("/")
    return posixpath.dirname(text) if is_url(text) else os.path.dirname(text)


def client_options(protocol: str) -> dict:
    """Client settings (never credentials): short client retries (ours below add the backoff), so a dead
    endpoint is reported in seconds."""
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5,
                                  "read_timeout": 60}}
    return {}


@functools.lru_cache(maxsize=16)
def _fs_for(protocol: str, pid: int):
    """One instance per protocol and process: an async file system (s3fs) cannot cross a fork (the suite's
    workers are forked from their launcher)."""
    import fsspec

    if protocol == "file":
        return fsspec.filesystem("file")
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise UserError(f"{protocol}:// storage needs its fsspec package ({exc}); for s3:// install "
                        "disttrain[s3]") from None
    fs = cls(skip_instance_cache=True, **client_options(protocol))
    if getattr(fs, "async_impl", False):
        _quiet_orphaned_tasks()
    return fs


def _quiet_orphaned_tasks() -> None:
    """When the store drops mid-upload, aiohttp leaves a request task whose error nobody awaits (the failure
    itself reaches us through the call that was waiting); asyncio would print it with a traceback when the
    task is collected. Such errors go to the debug log, so a storage fault stays one line."""
    from fsspec.asyn import get_loop

    def handler(loop, context):
        log.debug("storage client: %s (%r)", context.get("message"), context.get("exception"))

    get_loop().set_exception_handler(handler)


def fs_of(path):
    """(fsspec file system, its path for `path`)."""
    text = str(path)
    if not is_url(text):
        return _fs_for("file", os.getpid()), os.path.abspath(text.removeprefix("file://"))
    protocol = text.split("://", 1)[0]
    fs = _fs_for(protocol, os.getpid())
    return fs, fs._strip_protocol(text)


def transient(exc: BaseException) -> bool:
    """Worth another try: a dropped or refused connection, a timeout, throttling. Not: no space, no such
    object, no permission, a failed precondition."""
    import errno

    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, UserError)):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EINVAL):
        return False
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in ("connect", "timeout", "timed out", "throttl", "slowdown", "slow down",
                                         "503", "500", "reset", "broken pipe", "temporar"))


def retried(fn: Callable[[], T], what: str, attempts: int | None = None) -> T:
    """fn(), retried with exponential backoff while it fails transiently."""
    attempts = int(os.environ.get(RETRIES_ENV, "3")) if attempts is None else attempts
    for attempt in range(attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts or not transient(exc):
                raise
            wait = BACKOFF_S * 2 ** attempt
            log.info("%s failed (%s); retrying in %.1f s", what, describe(exc), wait)  # the log file, not the console
            time.sleep(wait)
    raise AssertionError("unreachable")


def root_cause(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException (which gathers every rank's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return root_cause(inner[0] if isinstance(inner, tuple) else inner)
    return exc


FULL_BYTES = 1 << 20  # a local file system with less free than this after a failed write is full


def describe(exc: BaseException, location=None) -> str:
    """What failed, in a few words. A full local disk is named as such even when the writer hid the errno
    (torch's zip writer reports ENOSPC as a RuntimeError): `location` is checked for free space."""
    import errno
    import shutil

    exc = root_cause(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    if location is not None and not is_url(location):
        probe = str(location)
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if probe and shutil.disk_usage(probe).free < FULL_BYTES:
            return "no space left on the device"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


# ---------------------------------------------------------------- operations (local paths and URLs alike)
def exists(path) -> bool:
    fs, p = fs_of(path)
    return retried(lambda: fs.exists(p), f"checking {path}")


def isfile(path) -> bool:
    fs, p = fs_of(path)
    return retried(lambda: fs.isfile(p), f"checking {path}")


def isdir(path) -> bool:
    fs, p = fs_of(path)
    return retried(lambda: fs.isdir(p), f"checking {path}")


def listdir(path) -> list[str]:
    """Names directly under `path` (empty when it does not exist)."""
    fs, p = fs_of(path)

    def ls():
        fs.invalidate_cache(p)  # another process may have written since the last listing
        try:
            return [name_of(e) for e in fs.ls(p, detail=False)]
        except FileNotFoundError:
            return []
    return sorted(retried(ls, f"listing {path}"))


def files_under(path) -> dict[str, int]:
    """Every file under `path` (subfolders included): relative name -> size."""
    fs, p = fs_of(path)
    fs.invalidate_cache(p)
    found = retried(lambda: fs.find(p, detail=True), f"listing {path}")
    root = p.rstrip("/") + "/"
    return {name[len(root):]: int(info.get("size") or 0) for name, info in found.items()
            if info.get("type") != "directory" and name.startswith(root)}


def size(path) -> int:
    fs, p = fs_of(path)
    return int(retried(lambda: fs.size(p), f"reading the size of {path}"))


def read_bytes(path) -> bytes:
    fs, p = fs_of(path)
    return retried(lambda: fs.cat_file(p), f"reading {path}")


def read_text(path) -> str:
    return read_bytes(path).decode()


def write_bytes(path, data: bytes) -> None:
    """Appears whole or not at all: a local file is written aside and renamed, an object is one PUT."""
    fs, p = fs_of(path)
    if is_url(path):
        retried(lambda: fs.pipe_file(p, data), f"writing {path}")
        return
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = f"{p}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path, text: str) -> None:
    write_bytes(path, text.encode())


def makedirs(path) -> None:
    """A local directory; object stores have none to make."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def rmtree(path) -> bool:
    """Remove a directory (every object under a prefix); False (logged, not raised) when that failed."""
    fs, p = fs_of(path)
    try:
        retried(lambda: fs.rm(p, recursive=True) if fs.exists(p) else None, f"removing {path}")
    except Exception as exc:
        log.info("could not remove %s: %s", path, describe(exc))  # the caller says so in its own line
        return False
    return True


def open_file(path, mode: str = "rb", **options):
    fs, p = fs_of(path)
    return fs.open(p, mode, **options)


def torch_save(obj, path) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(path, buffer.getvalue())


def torch_load(path):
    import torch

    return torch.load(io.BytesIO(read_bytes(path)), weights_only=True)


# ---------------------------------------------------------------- DCP
def dcp_writer(path):
    """DCP's writer for a location: its file-system writer locally, its fsspec writer for a URL."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(str(path), **_dcp_options(path))
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path))


def dcp_reader(path):
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(path), **_dcp_options(path))
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))


def _dcp_options(path) -> dict:
    """The same client settings DCP's own file system instance gets."""
    return {**client_options(str(path).split("://", 1)[0]), "skip_instance_cache": True}


# ---------------------------------------------------------------- checks at start
def check_reachable(path, key: str) -> None:
    """Before training: the store answers, the credentials work and the bucket exists. UserError (one line,
    naming `key` and the location) otherwise. Local paths: nothing to check here."""
    if not is_url(path):
        return
    if "@" in str(path).split("://", 1)[1].split("/", 1)[0]:
        raise UserError(f"{key}={where(path)}...: credentials in the URL would be written to config.yaml and "
                        "logs; give them through the environment or a profile instead")
    fs, p = fs_of(path)
    bucket = p.split("/", 1)[0]
    fs.invalidate_cache(bucket)
    try:
        retried(lambda: fs.ls(bucket, detail=False), f"reaching {where(path)}", attempts=0)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{key}={path}: {reason_unreachable(exc)}") from None


def reason_unreachable(exc: BaseException) -> str:
    """Why a store refused at start, in words a user can act on (never the credentials themselves)."""
    name, text = type(exc).__name__, str(exc)
    low = f"{name} {text}".lower()
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if "nocredentials" in low or "unable to locate credentials" in low:
        return ("no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an "
                "instance role)")
    if isinstance(exc, FileNotFoundError) or "nosuchbucket" in low or "does not exist" in low:
        return "no such bucket (create it first, or correct the URL)"
    if isinstance(exc, PermissionError) or "accessdenied" in low or "invalidaccesskeyid" in low or \
            "signaturedoesnotmatch" in low or "forbidden" in low:
        return "the credentials were refused (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile)"
    if "connect" in low or "endpoint" in low or "timeout" in low or "timed out" in low:
        return f"cannot reach the store{f' at {endpoint}' if endpoint else ''} ({name}; check AWS_ENDPOINT_URL " \
               "and the network)"
    return f"the store refused access ({describe(exc)})"
