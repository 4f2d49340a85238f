"""The registry shape tables of docs/config.md (generated, but read back here as a reader sees them), the
README's claims about `make demo`, and `make demo`'s install say what the code does."""

from __future__ import annotations

import re
import subprocess
from dataclasses import asdict

from disttrain.config.load import load_config
from disttrain.models.registry import MODEL_SHAPES
from helpers import REPO


def _table(text: str, header: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    lines = text[text.index(header):].split("\n\n")[0].splitlines()
    keys = [k.strip(" `") for k in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(keys, (c.strip(" `") for c in line.strip("|").split("|"))))
        rows[cells.pop("name")] = cells
    return keys, rows


def _count(cell: str) -> float:
    return float(cell[:-1]) * {"M": 1e6, "B": 1e9}[cell[-1]]


def test_the_config_page_lists_every_registry_shape_as_it_is():
    text = (REPO / "docs" / "config.md").read_text()
    keys, rows = _table(text, "| `name` | `dim` | `n_layers` | `n_heads` | `n_kv_heads` | `ffn_hidden_dim`")
    moe_keys, moe_rows = _table(text, "| `name` | `dim` | `n_layers` | `n_heads` | `n_kv_heads` | `num_experts`")
    from disttrain.models.hf.published import PUBLISHED_CONFIGS  # their own table (tests/test_published_models.py)

    built_in = {name: shape for name, shape in MODEL_SHAPES.items() if name not in PUBLISHED_CONFIGS}
    assert list(rows) + list(moe_rows) == list(built_in)
    for name, shape in built_in.items():
        moe = shape.moe is not None
        fields, row, columns = asdict(shape), (moe_rows if moe else rows)[name], (moe_keys if moe else keys)
        fields.update(fields.pop("moe") or {})
        for key in [k for k in columns[1:] if k not in ("parameters", "active")]:
            value = fields[key]
            same = row[key] == str(value).lower() if isinstance(value, bool) else float(row[key]) == value
            assert same, (name, key, row[key])
        unit = 1e6 if row["parameters"].endswith("M") else 1e9
        assert abs(_count(row["parameters"]) - shape.num_params()) <= 0.005 * unit, name
        if moe:
            assert abs(_count(row["active"]) - shape.num_params(active=True)) <= 0.005 * unit, name
    # published sizes of the shapes named after models: Llama 2 7B/13B/70B, Llama 3.2 1B, and the MoE models'
    # total / active counts (Mixtral 8x7B 46.7B / 12.9B, Qwen3-30B-A3B 30.5B / 3.3B, Qwen3-235B-A22B 235B / 22B)
    assert [rows[n]["parameters"] for n in ("7b", "13b", "70b", "1b")] == ["6.74B", "13.02B", "68.98B", "1.24B"]
    published = {"mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9)}
    for name, (total, active) in published.items():
        assert abs(MODEL_SHAPES[name].num_params() / total - 1) < 0.01, name
        assert abs(MODEL_SHAPES[name].num_params(active=True) / active - 1) < 0.02, name


def test_readme_says_what_make_demo_trains():
    """The README's account of `make demo` (model size, steps, checkpoints, validation, sample, processes)
    is configs/demo.yaml's and the Makefile's."""
    readme = " ".join((REPO / "README.md").read_text().split())
    cfg = load_config(REPO / "configs" / "demo.yaml", [])
    size = re.search(r"trains a ([\d.]+)M-parameter", readme)
    assert size and float(size.group(1)) == round(MODEL_SHAPES[cfg.model.name].num_params() / 1e6, 1)
    assert f"for {cfg.train.steps} steps" in readme
    assert f"checkpoints every {cfg.checkpoint.every_steps} steps" in readme
    assert cfg.train.eval_every > 0 and "validation loss" in readme
    assert cfg.train.sample_tokens > 0 and "generated sample" in readme
    assert "--nproc-per-node $(NPROC)" in (REPO / "Makefile").read_text() and "2 CPU processes" in readme


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
    assert "-e '.[test,deepspeed,trackers,ray,float8]'" in test and "-c constraints.txt -e ." in test
