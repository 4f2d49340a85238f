"""MoE models balance their experts out of the box, the run's config.yaml says how, and a layer whose routing
collapses anyway gets one warning on the console (before, balancing was off by default and only metrics.jsonl
showed every token going to two experts)."""

from __future__ import annotations

import json

import pytest
import yaml

from disttrain.config.load import load_config
from disttrain.config.resolve import resolve_run
from disttrain.observe.run_report import load_records, summary
from helpers import DEBUG_CONFIG, events, records, run_cli
from hf_models import save_tiny


def _balancing(*overrides) -> tuple[float | None, float | None]:
    moe = load_config(DEBUG_CONFIG, list(overrides)).model.moe
    return moe.aux_loss_coef, moe.bias_update_rate


def test_a_built_in_moe_balances_with_the_loss_unless_told_otherwise():
    assert _balancing("model.name=debug-moe") == (0.001, 0.0)  # Qwen3-MoE's and Mixtral's coefficient
    assert _balancing("model.name=debug-moe", "engine=deepspeed") == (0.001, 0.0)
    assert _balancing("model.name=debug-moe", "precision.compute_dtype=fp16") == (0.0, 0.0)  # refused there
    assert _balancing("model.name=debug-moe", "model.moe.bias_update_rate=0.001") == (0.0, 0.001)  # the one chosen
    assert _balancing("model.name=debug-moe", "model.moe.aux_loss_coef=0") == (0.0, 0.0)  # off, as asked
    assert _balancing() == (None, None)  # a dense model has nothing to balance


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_a_hugging_face_moe_takes_the_loss_its_config_carries(kind, tmp_path):
    model = save_tiny(kind, tmp_path / kind)
    own = json.loads((model / "config.json").read_text())["router_aux_loss_coef"]
    assert _balancing(f"model.hf={model}") == (own, 0.0)


def test_the_run_config_states_the_balancing_in_force():
    cfg = load_config(DEBUG_CONFIG, ["model.name=debug-moe"])
    saved = yaml.safe_load(cfg.to_yaml(resolve_run(cfg, 1, "cpu")))
    assert saved["model"]["moe"]["aux_loss_coef"] == 0.001 and saved["model"]["moe"]["bias_update_rate"] == 0.0
    dense = load_config(DEBUG_CONFIG, [])
    assert "moe" not in yaml.safe_load(dense.to_yaml(resolve_run(dense, 1, "cpu")))["model"]


def test_a_collapsed_layer_is_named_once_with_its_experts_and_the_keys(tmp_path):
    """Balancing off, the debug MoE's routers send every token to the same two experts within a few steps."""
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=r", "model.name=debug-moe",
                   "model.moe.bias_update_rate=0", "model.moe.aux_loss_coef=0")
    run = tmp_path / "r"
    warned = [line for line in proc.stdout.splitlines() if "routing collapsed" in line]
    logged = [r for r in records(run) if "moe_tokens_per_expert" in r]
    for layer in (0, 1):
        imbalance = [r[f"moe_{layer}_load_imbalance"] for r in logged]
        collapsed = next((k for k in range(2, len(imbalance)) if min(imbalance[k - 2:k + 1]) > 0.9 * 8 / 2), None)
        mine = [line for line in warned if line.startswith(f"warning: MoE layer {layer}: ")]
        if collapsed is None:
            assert not mine
            continue
        counts = next(v for k, v in logged[collapsed]["moe_tokens_per_expert"].items() if f"layers.{layer}." in k)
        assert len(mine) == 1, warned  # once, however long it stays collapsed
        named = json.loads(mine[0].split("experts ", 1)[1].split(" of 8", 1)[0])
        assert sorted(named) == sorted(sorted(range(8), key=lambda e: -counts[e])[:len(named)]), (mine, counts)
        assert sum(counts[e] for e in named) >= 0.9 * sum(counts)  # the busiest, holding 90% of the choices
        assert mine[0].endswith("balance it with model.moe.aux_loss_coef=0.001 or (built-in MoE) "
                                "model.moe.bias_update_rate=0.001")
        step = logged[collapsed]["step"]
        assert any(e["message"] == mine[0][len("warning: "):] and e["step"] == step for e in events(run, "warning"))
    assert warned, "the debug MoE's routing no longer collapses without balancing: pick another case"
    rows = dict(summary(*load_records(run)))
    assert rows["MoE routing (last logged step)"].startswith(
        f"layer 0: imbalance {logged[-1]['moe_0_load_imbalance']:.2f}")
