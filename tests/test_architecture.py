"""The layering rules of docs/ARCHITECTURE.md, checked on the source: no import cycles, the runtime
never imports the planner, Llama module names stay in models/llama/, files stay short."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO

SRC = REPO / "src" / "disttrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the disttrain modules it imports (top-level and inside functions)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("disttrain"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("disttrain")]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_runtime_never_imports_the_planner():
    offenders = [f"{m} imports {t}" for m, targets in _imports().items() for t in targets
                 if t.startswith("disttrain.plan") and not m.startswith(("disttrain.plan", "disttrain.cli"))]
    assert not offenders, offenders


def test_llama_module_names_stay_in_its_package():
    names = re.compile(r"\b(tok_embeddings|feed_forward|attention_norm|ffn_norm|attention\.wq)\b")
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if "models/llama" not in p.as_posix() and names.search(p.read_text())]
    assert not offenders, offenders


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
