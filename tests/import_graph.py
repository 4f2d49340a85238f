"""disttrain's import graph, read from the source: every `import`, including those inside functions, plus the
loads no import statement shows: a module named in a string (`importlib.import_module(NAME)`, `__import__`,
`runpy`, `python -m NAME`, a tuple of modules to preload) and the imports of Python code held in a string
(`python -c "import ..."`). Imports under `if TYPE_CHECKING:` load nothing and are not counted."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "disttrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    """`disttrain.train.loop` -> `train`; the root package and its __main__ -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def _logger_names(tree: ast.AST) -> set[int]:
    """String arguments of `logging.getLogger(...)`: logger names, not loads."""
    return {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("getLogger") for arg in node.args}


def imported_names(source: str) -> set[str]:
    """Every disttrain module (or name inside one) that `source` imports or loads by name."""
    tree = ast.parse(source)
    skipped = _type_checking_nodes(tree) | _logger_names(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("disttrain"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("disttrain"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "disttrain" in node.value:
            text = node.value.strip()
            if text.startswith("disttrain") and all(p.isidentifier() for p in text.split(".")):
                found.add(text)  # a module named in a string: importlib, runpy, `python -m`, a preload list
            elif "import" in text:
                try:
                    found |= imported_names(text)  # `python -c CODE`
                except SyntaxError:
                    pass
    return found


@cache
def module_graph() -> dict[str, frozenset[str]]:
    """Module -> the disttrain modules it imports or loads."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        names = imported_names(path.read_text())
        graph[name] = frozenset(t for t in names if t in modules and t != name)
    return graph


@cache
def package_graph() -> dict[tuple[str, str], tuple[str, ...]]:
    """(package, package) -> the module imports behind that edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in module_graph().items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a and b and a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return {k: tuple(sorted(v)) for k, v in edges.items()}
