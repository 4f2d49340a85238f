"""The built-in corpus: English prose that ships with every Python, so nothing is downloaded.

It is the language reference topics behind `help()` plus the docstrings of a fixed list of
standard-library modules (about 1 MB of text). Documents are ordered deterministically; every
20th goes to the validation split. The exact text follows the Python version in use.

What a module's namespace holds depends on what else the process imported (lazy attributes,
submodules that other packages pull in: torch replaces `inspect.getfile`), so the documents are
always collected in a fresh interpreter in one fixed state (torch imported, nothing else: what every
training process has loaded when it reads data) and cached per Python version: every process,
whatever it imported before (transformers, a test runner), trains on the same corpus.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar collections concurrent.futures contextlib copy csv "
    "dataclasses datetime decimal difflib email enum fractions functools glob gzip hashlib heapq html "
    "http.client http.server inspect io ipaddress itertools json logging math mimetypes multiprocessing "
    "operator os pathlib pickle pprint queue random re sched secrets selectors shlex shutil signal socket "
    "sqlite3 statistics string struct subprocess tarfile tempfile textwrap threading time timeit tokenize "
    "traceback types typing unittest urllib.parse urllib.request uuid warnings weakref "
    "xml.etree.ElementTree zipfile zlib"
).split()

VAL_EVERY = 20


def _module_docs(name: str) -> list[str]:
    try:
        mod = importlib.import_module(name)
    except Exception:  # an optional stdlib module missing from this build
        return []
    docs = [inspect.getdoc(mod) or ""]
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                docs.extend(inspect.getdoc(m) or "" for n, m in sorted(vars(obj).items())
                            if not n.startswith("_") and inspect.isfunction(m))
    return [d for d in docs if len(d) > 40]


def _collect_documents() -> list[str]:
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    with warnings.catch_warnings():  # some modules warn when their deprecated aliases are touched
        warnings.simplefilter("ignore")
        for name in _MODULES:
            docs.extend(_module_docs(name))
    return list(dict.fromkeys(docs))  # inherited docstrings repeat; keep each text once


# The fixed state the documents are collected in: torch imported and no training code (torch's import
# changes what some standard-library modules hold; the corpus is the one a training process sees).
_COLLECT = ("import sys, json, torch; from disttrain.data.corpus import _collect_documents; "
            "sys.stdout.write(json.dumps(_collect_documents()))")


def _cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "disttrain"
    key = hashlib.sha256(f"{sys.version}|{' '.join(_MODULES)}".encode()).hexdigest()[:16]
    return root / f"builtin_corpus_{key}.json"


def builtin_documents() -> list[str]:
    cache = _cache_file()
    if cache.is_file():
        try:
            return json.loads(cache.read_text())
        except ValueError:
            pass  # a torn file from another interpreter: rebuild it
    src = str(Path(__file__).resolve().parents[2])  # disttrain importable however this process found it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _COLLECT], capture_output=True, check=True, env=env).stdout
    docs = json.loads(out)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False, suffix=".tmp") as f:
            f.write(out.decode())
        os.replace(f.name, cache)  # atomic: ranks building it at once all write the same text
    except OSError:
        pass  # a read-only home: collect again next time
    return docs


def builtin_splits() -> dict[str, list[str]]:
    docs = builtin_documents()
    return {
        "train": [d for i, d in enumerate(docs) if i % VAL_EVERY != VAL_EVERY - 1],
        "val": [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1],
    }
