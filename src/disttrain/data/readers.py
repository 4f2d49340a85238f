"""Documents from the files pretraining corpora ship in, streamed (memory bounded by one batch of rows
or one document, whatever the file size): .txt, .jsonl (.gz, .zst), .parquet, and directories written
by `datasets.Dataset.save_to_disk` (or holding Parquet / JSONL files). Local files only."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Iterator

ROWS_PER_BATCH = 1024
NOT_RECORDS = "; chat and instruction records need 'messages', or 'prompt' and 'completion'"
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


def kind_of(path: Path) -> str | None:
    """What reads `path` ('txt', 'jsonl', 'parquet', 'saved_dataset', 'folder'), or None."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "saved_dataset"
        return "folder" if any(_member_files(path)) else None
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".txt"):
        return "txt"
    return None


def _member_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.lower().endswith(SUFFIXES))


def iter_documents(paths: list[Path], text_key: str) -> Iterator[str]:
    for path in paths:
        kind = kind_of(path)
        if kind == "txt":
            yield from _txt(path)
        elif kind == "jsonl":
            yield from _jsonl(path, text_key)
        elif kind == "parquet":
            yield from _parquet(path, text_key)
        elif kind == "saved_dataset":
            yield from _saved_dataset(path, text_key)
        elif kind == "folder":
            yield from iter_documents(_member_files(path), text_key)
        else:
            raise ValueError(f"input {path}: not a readable corpus (allowed: {', '.join(SUFFIXES)} files, a "
                             "datasets.save_to_disk directory, or a folder of such files)")


def _txt(path: Path) -> Iterator[str]:
    """Documents are separated by an empty line (as `text.split("\\n\\n")` would cut them); read line by line."""
    lines: list[str] = []
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        for line in f:
            if line in ("\n", ""):
                doc = "".join(lines).strip()
                if doc:
                    yield doc
                lines = []
            else:
                lines.append(line)
    doc = "".join(lines).strip()
    if doc:
        yield doc


def _open_text(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if name.endswith(".zst"):
        import zstandard

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(path.open("rb")), encoding="utf-8")
    return path.open(encoding="utf-8")


def _jsonl(path: Path, text_key: str) -> Iterator[str]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if text_key not in record:
                raise ValueError(f"{path}:{lineno} has no {text_key!r} field (use --text-key)" + NOT_RECORDS)
            yield str(record[text_key])


def _parquet(path: Path, text_key: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for non-Parquet bytes
        raise ValueError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    columns = file.schema_arrow.names
    if text_key not in columns:
        raise ValueError(f"{path} has no column {text_key!r} (columns: {', '.join(columns)}; use --text-key)"
                         + NOT_RECORDS)
    for batch in file.iter_batches(batch_size=ROWS_PER_BATCH, columns=[text_key]):
        yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)


def _saved_dataset(path: Path, text_key: str) -> Iterator[str]:
    """Memory-mapped Arrow: rows are read a batch at a time."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: not a readable datasets directory ({str(exc).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if text_key not in ds.column_names:
        raise ValueError(f"{path} has no column {text_key!r} (columns: {', '.join(ds.column_names)}; use "
                         "--text-key)" + NOT_RECORDS)
    for start in range(0, len(ds), ROWS_PER_BATCH):
        yield from (str(t) for t in ds[start:start + ROWS_PER_BATCH][text_key] if t is not None)


def iter_records(paths: list[Path]) -> Iterator[tuple[str, dict]]:
    """(where, record) of every row of JSONL, Parquet and saved-dataset inputs (chat and instruction data);
    `where` names the file and line or row for messages."""
    for path in paths:
        kind = kind_of(path)
        if kind == "jsonl":
            with _open_text(path) as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield f"{path}:{lineno}", json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        elif kind == "parquet":
            import pyarrow.parquet as pq

            row = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_BATCH):
                for record in batch.to_pylist():
                    row += 1
                    yield f"{path} row {row}", record
        elif kind == "saved_dataset":
            import datasets

            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            for start in range(0, len(ds), ROWS_PER_BATCH):
                for i, record in enumerate(ds.select(range(start, min(len(ds), start + ROWS_PER_BATCH)))):
                    yield f"{path} row {start + i + 1}", record
        elif kind == "folder":
            yield from iter_records(_member_files(path))
        else:
            raise ValueError(f"input {path}: chat and instruction records are read from .jsonl, .parquet or "
                             f"datasets.save_to_disk inputs (not {kind or 'this kind of file'})")


def first_record(paths: list[Path]) -> dict | None:
    """The first record of the first JSONL/Parquet/dataset input (None for text files or no records)."""
    path = paths[0]
    kind = kind_of(path)
    if kind == "folder":
        members = _member_files(path)
        return first_record(members) if members else None
    if kind not in ("jsonl", "parquet", "saved_dataset"):
        return None
    try:
        return next(iter_records([path]), (None, None))[1]
    except Exception:  # unreadable input: the text reader says why
        return None
