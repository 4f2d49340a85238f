"""The layering rules of docs/architecture.md, checked on the source: only `__init__.py` and `__main__.py` at the
top, every package in one layer order that imports only go down (so no loops between packages), hidden loads
counted as imports, the diagram's arrows equal to the import graph, the runtime never imports the planner,
Llama module names stay in models/llama/, files stay short."""

from __future__ import annotations

import re

from helpers import REPO
from import_graph import SRC, imported_names, module_graph, package_graph

# Top to bottom: a package imports only packages below it. core/ is below everything and every package may
# import it (the diagram leaves those arrows out).
LAYERS = ("cli", "bench", "launch", "plan", "dryrun", "train", "checkpoint", "config", "observe", "parallel", "data",
          "models", "distributed", "layout", "core")


def test_only_the_package_entry_points_sit_at_the_top():
    assert sorted(p.name for p in SRC.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_every_package_is_a_layer():
    packages = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
    assert packages == sorted(LAYERS)


def test_imports_only_go_down_the_layers():
    upward = [f"{a} -> {b}: {', '.join(why)}" for (a, b), why in package_graph().items()
              if LAYERS.index(a) >= LAYERS.index(b)]
    assert not upward, upward


def test_no_loops_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in package_graph():
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in graph.get(start, ()))

    loops = [p for p in graph if reaches(p, p, {p})]
    assert not loops, loops


def test_hidden_loads_count_as_imports():
    """A module named in a string (importlib, runpy, `python -m`, a preload list) and the imports of code in a
    string (`python -c`) are loads; a logger's name and an import under TYPE_CHECKING are not."""
    source = """
import importlib, logging, subprocess, sys
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from disttrain.config.schema import RunConfig
importlib.import_module("disttrain.train.loop")
__import__("disttrain.train.builder")
subprocess.run([sys.executable, "-c", "import json, disttrain.cli; print(1)"])
subprocess.run([sys.executable, "-m", "disttrain.launch.agent"])
log = logging.getLogger("disttrain.checkpoint")
"""
    assert imported_names(source) == {"disttrain.train.loop", "disttrain.train.builder", "disttrain.cli",
                                      "disttrain.launch.agent"}


def test_no_import_cycles():
    graph = module_graph()
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
    offenders = [f"{m} imports {t}" for m, targets in module_graph().items() for t in targets
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
    graph = module_graph()
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
