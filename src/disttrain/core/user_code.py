"""Load a user's function named as `FILE.py:function` or `package.module:function` (model.spec,
data.source=py:...). Import and call mistakes become one-line UserErrors naming the config key."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from disttrain.core.errors import UserError


def load_function(key: str, ref: str):
    if ":" not in ref:
        raise UserError(f"{key}={ref}: expected FILE.py:function or package.module:function")
    where, name = ref.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise UserError(f"{key}={ref}: no such file {where}")
            module_name = f"disttrain_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                sys.path.insert(0, str(path.parent))  # the file's own imports of its neighbours
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as exc:  # the user's module failed to import: say where, in one line
        raise UserError(f"{key}={ref}: importing {where} failed ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{key}={ref}: {where} has no function {name}")
    return fn


def call_user(key: str, ref: str, expected: type | tuple, what: str, prefix: str = ""):
    """Call the user's function; `prefix` is what precedes `ref` in the config value (e.g. `py:`)."""
    fn = load_function(key, ref)
    ref = prefix + ref
    try:
        value = fn()
    except Exception as exc:
        raise UserError(f"{key}={ref}: calling it raised {type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]}") from None
    if not isinstance(value, expected):
        raise UserError(f"{key}={ref}: returned {type(value).__name__}, expected {what}")
    return value
