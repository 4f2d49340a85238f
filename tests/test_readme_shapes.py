"""The README's registry table and `make demo`'s install say what the code does."""

from __future__ import annotations

import re
import subprocess
from dataclasses import asdict

from disttrain.models.registry import MODEL_SHAPES
from helpers import REPO


def test_readme_lists_every_registry_shape_as_it_is():
    text = (REPO / "README.md").read_text()
    header = text.index("| `name` | `dim` | `n_layers`")
    lines = text[header:].split("\n\n")[0].splitlines()
    keys = [k.strip(" `") for k in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(keys, (c.strip(" `") for c in line.strip("|").split("|"))))
        rows[cells.pop("name")] = cells
    assert list(rows) == list(MODEL_SHAPES)
    for name, shape in MODEL_SHAPES.items():
        fields, row = asdict(shape), rows[name]
        for key in keys[1:-1]:
            value = fields[key]
            assert row[key] == (str(value).lower() if isinstance(value, bool) else f"{value:g}"), (name, key)
        count, unit = float(row["parameters"][:-1]), {"M": 1e6, "B": 1e9}[row["parameters"][-1]]
        assert abs(count * unit - shape.num_params()) <= 0.005 * unit, name
    # published sizes of the shapes named after models: Llama 2 7B/13B/70B, Llama 3.2 1B
    assert [rows[n]["parameters"] for n in ("7b", "13b", "70b", "1b")] == ["6.74B", "13.02B", "68.98B", "1.24B"]


def _make_commands(target: str, tmp_path) -> str:
    return subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def test_make_demo_installs_only_what_the_demo_needs(tmp_path):
    """A fresh `make demo` installs disttrain alone (its dependencies); `make test` adds every extra."""
    demo = [line.split("pip install")[1] for line in _make_commands("demo", tmp_path).splitlines()
            if "pip install" in line]
    assert len(demo) == 2 and demo[1].endswith("-c constraints.txt -e .")
    assert not re.search(r"deepspeed|trackers|test", " ".join(demo))
    test = _make_commands("test", tmp_path)
    assert "-e '.[test,deepspeed,trackers]'" in test and "-c constraints.txt -e ." in test
