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


def test_engines_hold_only_the_training_math():
    """A step engine announces its phases (train/phases.py) and imports none of their observers: no step
    breakdown, watchdog, fault injection, balancer or clock in an engine module."""
    observers = ("disttrain.observe", "disttrain.train.faults", "disttrain.train.resilience", "disttrain.train.balance",
                 "disttrain.dryrun")
    graph = _imports()
    for engine in ("torch_engine", "pipeline_engine", "deepspeed_engine"):
        module = f"disttrain.train.{engine}"
        assert not [t for t in graph[module] if t.startswith(observers)], module
        source = (SRC / "train" / f"{engine}.py").read_text()
        step = source[source.index("def train_step"):source.index("def eval_loss_sum")]
        assert not re.search(r"\b(time|perf_counter|faults|watchdog|breakdown|on_phase)\b", step), engine


def test_phases_nest_and_let_the_innermost_subscriber_change_the_loss():
    """Exits run in reverse order of entry; an `outermost` subscriber spans the others; a subscriber may replace
    the loss a forward phase produced (how test-only fault injection makes a step's loss NaN)."""
    from disttrain.train.phases import Phases, Subscriber

    seen = []

    class Record(Subscriber):
        def __init__(self, name):
            self.name = name

        def enter(self, event):
            seen.append((self.name, "enter", event.name, event.depth))

        def exit(self, event):
            seen.append((self.name, "exit", event.name, event.depth))

    class Double(Subscriber):
        def exit(self, event):
            if event.name == "forward":
                event.loss = 2 * event.loss

    phases = Phases(Record("a"), Double())
    phases.subscribe(Record("watch"), outermost=True)
    with phases("pipeline", step=1):
        with phases("forward", step=1) as forward:
            forward.loss = 3.0
    assert forward.loss == 6.0
    assert seen == [("watch", "enter", "pipeline", 0), ("a", "enter", "pipeline", 0),
                    ("watch", "enter", "forward", 1), ("a", "enter", "forward", 1),
                    ("a", "exit", "forward", 1), ("watch", "exit", "forward", 1),
                    ("a", "exit", "pipeline", 0), ("watch", "exit", "pipeline", 0)]
