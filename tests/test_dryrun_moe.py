"""The dry run of MoE layouts under its stated routing (dryrun/routing.py): balanced, or a skew with the
planner's meaning. In-process (fake process group, fake tensors): seconds. That the dry run reads what a
real run reads under the same routing is measured by benchmarks/moe_dryrun.py (docs/benchmarks/moe-plans.md)."""

from __future__ import annotations

import pytest
import torch

from disttrain.cli.dryrun import dry_run
from disttrain.config.load import load_config
from disttrain.dryrun.routing import AssumedRouting
from disttrain.dryrun.simulate import unsupported
from disttrain.core.errors import UserError
from disttrain.models.registry import MODEL_SHAPES
from disttrain.config.resolve import resolve_run

SEQ, MICRO = 128, 2
EP2 = ["model.name=debug-moe", f"data.seq_len={SEQ}", f"train.micro_batch_size={MICRO}", "train.global_batch_size=4",
       "parallel.ep=2", "parallel.zero_stage=0"]


def test_assumed_routing_gives_the_busiest_rank_its_skewed_share():
    for skew, ep, busiest in ((1.0, 2, 0), (1.5, 4, 3), (2.0, 8, 5), (16.0, 4, 1)):
        counts = AssumedRouting(skew).counts(rows=1000, num_experts=16, ep=ep, busiest=busiest)
        per_rank = [sum(counts[r * 16 // ep:(r + 1) * 16 // ep]) for r in range(ep)]
        assert sum(counts) == 1000 and len(counts) == 16
        assert per_rank[busiest] == round(min(skew, ep) * 1000 / ep)
        others = [c for r, c in enumerate(per_rank) if r != busiest]
        assert max(others) - min(others) <= 1
        for r in range(ep):  # spread evenly over each rank's experts
            mine = counts[r * 16 // ep:(r + 1) * 16 // ep]
            assert max(mine) - min(mine) <= 1


def test_dry_run_of_expert_parallel_debug_moe_matches_the_planner_and_skew_raises_it():
    """debug-moe at ep=2 on 2 simulated ranks (DDP), balanced and at skew 2 (every routed row on the simulated
    rank). The peak within 2% of the planner at both (measured -0.8% and -0.9%); the skew's extra bytes
    within 5% of the planner's; the all-to-alls carry the rows the routing states (counted independently:
    per layer a count exchange of E int64 and, forward and backward, T*k rows out and s*T*k rows back)."""
    cfg = load_config(None, EP2)
    runs = {s: dry_run(cfg, 2, routing_skew=s)["ranks"][0] for s in (1.0, 2.0)}
    for s, run in runs.items():
        assert abs(run["error"]["peak_bytes"]) <= 0.02, (s, run["error"])
        shape = MODEL_SHAPES["debug-moe"]
        rows = MICRO * SEQ * shape.moe.num_experts_per_tok
        per_layer = shape.moe.num_experts * 8 + 2 * (rows + rows * s) * shape.dim * 4
        a2a = [c for c in run["collectives"] if c["kind"] == "all_to_all"]
        assert a2a == [{"kind": "all_to_all", "dim": "dp_shard", "count": 5 * shape.n_layers,
                        "bytes": int(per_layer * shape.n_layers)}], a2a
    measured = runs[2.0]["peak_bytes"] - runs[1.0]["peak_bytes"]
    planned = runs[2.0]["planner"]["peak_bytes"] - runs[1.0]["planner"]["peak_bytes"]
    assert measured > 0.1 * runs[1.0]["peak_bytes"] and abs(planned / measured - 1) <= 0.05, (measured, planned)


def test_dry_run_of_selective_checkpointing_on_moe_matches_the_planner():
    """Selective checkpointing keeps the expert GEMMs' outputs and the all-to-alls' results
    (parallel/activation_checkpoint.py): the planner's activations within 5% of the dry run's (measured 0.1%),
    at ep=2 (DDP) and ep=1 (ZeRO-2); the recomputation exchanges nothing, so the step's all-to-alls stay
    the counts, dispatch and combine forward and the two gradients backward, per layer. On whole logits (FSDP's
    buffers at a chunked loss head: tests/test_chunked_loss.py)."""
    shape = MODEL_SHAPES["debug-moe"]
    for overrides, ranks in ((EP2, 2), ([*EP2[:-2], "parallel.zero_stage=2"], 2)):
        cfg = load_config(None, [*overrides, "parallel.activation_checkpointing=selective",
                                 "train.loss_chunk_tokens=0"])
        run = dry_run(cfg, ranks)["ranks"][0]
        assert abs(run["error"]["activations"]) <= 0.05 and abs(run["error"]["peak_bytes"]) <= 0.02, run["error"]
        a2a = [c["count"] for c in run["collectives"] if c["kind"] == "all_to_all"]
        assert a2a == ([5 * shape.n_layers] if "parallel.ep=2" in overrides else []), a2a


def test_dry_run_of_expert_with_context_parallel_matches_the_planner():
    """ep=2 borrowing the context ranks (cp=2, dp_shard=1, DDP) on 2 simulated ranks, one micro-batch of 4
    sequences: the all-to-alls run over the context pair and carry each rank's half of every sequence
    (T = 4 x SEQ / 2 tokens); the peak within 2% of the planner (measured -1.1%)."""
    shape = MODEL_SHAPES["debug-moe"]
    cfg = load_config(None, [*EP2, "parallel.cp=2", "parallel.dp_shard=1", "train.micro_batch_size=4"])
    run = dry_run(cfg, 2)["ranks"][0]
    assert abs(run["error"]["peak_bytes"]) <= 0.02, run["error"]
    rows = 4 * SEQ // 2 * shape.moe.num_experts_per_tok
    per_layer = shape.moe.num_experts * 8 + 2 * 2 * rows * shape.dim * 4
    a2a = [c for c in run["collectives"] if c["kind"] == "all_to_all"]
    assert a2a == [{"kind": "all_to_all", "dim": "cp", "count": 5 * shape.n_layers,
                    "bytes": int(per_layer * shape.n_layers)}], a2a


@pytest.mark.parametrize("stage,pp", [(2, 1), (3, 1), (2, 2)])
def test_experts_outside_fsdp_on_a_one_rank_expert_mesh(stage, pp):
    """ep=2 over 2 data-parallel ranks in fp32: each rank holds other experts, FSDP would only copy them
    (parallel/expert.py experts_need_fsdp), so they stay plain DTensors on the ep mesh. The dry run still counts
    their parameters and gradients (pipeline stages too), and the planner leaves them out of FSDP's gathered
    bytes: every category within 1% (under a pipeline, the model states' on every simulated rank). On whole logits:
    with the loss in chunks the peak moves to the output head, where the dry run finds more of FSDP's buffers than
    the planner counts (tests/test_chunked_loss.py)."""
    from disttrain.parallel.expert import experts_need_fsdp

    pipeline = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=1"] if pp > 1 else []
    cfg = load_config(None, [*EP2, f"parallel.zero_stage={stage}", "parallel.dp_shard=2", "train.global_batch_size=8",
                             "precision.param_dtype=fp32", "precision.compute_dtype=fp32", *pipeline,
                             "train.loss_chunk_tokens=0"])
    layout = resolve_run(cfg, 2 * pp, "cpu").layout
    experts = [torch.nn.Linear(2, 2)]
    assert not experts_need_fsdp(experts, layout, torch.float32) and experts_need_fsdp(experts, layout, torch.bfloat16)
    # Pipelines: the model states (where the experts are); the stages' activations are another matter.
    checked = ("parameters", "gradients", "optimizer", "communication") if pp > 1 else None
    for run in dry_run(cfg, 2 * pp)["ranks"]:
        errors = {k: e for k, e in run["error"].items() if checked is None or k in checked}
        assert all(e is None or abs(e) <= 0.01 for e in errors.values()), run["error"]


def test_dry_run_of_expert_parallel_under_zero1_matches_the_planner():
    """ZeRO-1 at ep=2 on 4 simulated ranks: the dense optimizer states split over the 4, the experts' over
    the 2 ranks holding the same experts (parallel/zero1.py). The peak within 2% of the planner, below DDP's.
    The data-parallel ranks as dp_replicate=2 x dp_shard=2: the ranks holding the same experts then span two
    mesh dims, one group (they once failed to build one)."""
    overrides = [*EP2[:-1], "train.global_batch_size=8", "parallel.dp_replicate=2", "parallel.dp_shard=2"]
    zero1, ddp = (dry_run(load_config(None, [*overrides, f"parallel.zero_stage={stage}"]), 4)["ranks"][0]
                  for stage in (1, 0))
    assert abs(zero1["error"]["peak_bytes"]) <= 0.02, zero1["error"]
    assert zero1["peak_bytes"] < ddp["peak_bytes"]


def test_dry_run_refusals_for_moe():
    cfg = load_config(None, EP2)
    with pytest.raises(UserError, match="--routing-skew=0.5"):
        dry_run(cfg, 2, routing_skew=0.5)
    dense = load_config(None, ["model.name=debug", "parallel.dp_shard=2"])
    with pytest.raises(UserError, match="needs a mixture-of-experts model"):
        dry_run(dense, 2, routing_skew=2)
    dropping = load_config(None, [*EP2, "model.moe.capacity_factor=1.25"])
    assert "model.moe.capacity_factor=1.25 cannot be dry-run" in unsupported(dropping,
                                                                            resolve_run(dropping, 2, "cuda").layout)
