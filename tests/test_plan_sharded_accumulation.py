"""`parallel.gradient_accumulation=sharded`: ZeRO-2/3 reduce-scatters every micro-batch's gradients into the sharded
ones. The dry run counts one reduce-scatter per FSDP unit and micro-batch (the default: per unit and step) and no whole
gradient left between micro-batches; the planner holds no unsharded accumulation buffer, follows the dry run within
5%, charges the extra reduce-scatters to the step time, and its search takes the option only where the default does
not fit. (The parity of the runs with one process: tests/test_sharding.py, tests/test_model_parallel.py.)"""

from __future__ import annotations

import pytest

from disttrain.config.load import load_config

RANKS = 4


def _tiny(*overrides: str):
    """`tiny` at 512 tokens on 4 ranks in bf16, micro-batches of one sequence: two per rank (four under pp=2)."""
    return load_config(None, ["model.name=tiny", "data.seq_len=512", "train.micro_batch_size=1",
                              "train.global_batch_size=8", "precision.param_dtype=bf16",
                              "precision.compute_dtype=bf16", "parallel.gradient_accumulation=sharded", *overrides])


def _reduce_scatters(run: dict) -> int:
    return sum(c["count"] for c in run["collectives"] if c["kind"] == "reduce_scatter")


@pytest.mark.parametrize("extra,microbatches", [((), 2), (("parallel.pp=2",), 4)], ids=["fsdp", "pipeline"])
def test_every_micro_batch_reduce_scatters_and_keeps_no_whole_gradient(extra, microbatches):
    """`debug` (3 FSDP units: two blocks and the root) over 4 ranks, 2 micro-batches per rank: the default issues
    each unit's reduce-scatter once a step, sharded accumulation once per micro-batch; a pipeline stage (pp=2, 4
    micro-batches) likewise. What is left between steps is the sharded gradients alone: 1/shards of the default's
    whole ones."""
    from disttrain.cli.dryrun import dry_run

    def run(mode: str, *extra: str) -> dict:
        cfg = load_config(None, ["model.name=debug", "data.seq_len=64", "train.micro_batch_size=1",
                                 "train.global_batch_size=8", "parallel.zero_stage=3",
                                 f"parallel.gradient_accumulation={mode}", *extra])
        return dry_run(cfg, RANKS, [0])["ranks"][0]

    whole, sharded = run("unsharded", *extra), run("sharded", *extra)
    assert _reduce_scatters(sharded) == microbatches * _reduce_scatters(whole), whole["collectives"]
    shards = RANKS // (2 if extra else 1)
    assert sharded["bytes"]["gradients"] * shards == pytest.approx(whole["bytes"]["gradients"], rel=0.01)


ROWS = {  # the kinds of layout the search proposes with the option (DeepSeek-V3 on 64 H100: ZeRO-3, offload, full)
    "zero3": ("parallel.zero_stage=3",),
    "zero2": ("parallel.zero_stage=2",),
    "zero3 offload full": ("parallel.zero_stage=3", "parallel.cpu_offload=true",
                           "parallel.activation_checkpointing=full"),
    "pp2 1f1b zero3": ("parallel.zero_stage=3", "parallel.pp=2"),
    "pp2 gpipe zero2": ("parallel.zero_stage=2", "parallel.pp=2", "parallel.pp_schedule=gpipe"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_the_planner_follows_the_dry_run(row):
    """Every simulated rank's peak within ±5% of the planner's for that pipeline rank, with no unsharded
    gradients planned and the sharded ones (none on the device under CPU offload) at the peak."""
    from disttrain.cli.dryrun import dry_run, pp_rank_of
    from disttrain.config.resolve import resolve_run
    from disttrain.plan.memory import estimate_memory

    cfg = _tiny(*ROWS[row])
    resolved = resolve_run(cfg, RANKS, "cuda")
    layout = resolved.layout
    assert layout.reduces_every_microbatch and layout.microbatches > 1
    for run in dry_run(cfg, RANKS)["ranks"]:
        planned = estimate_memory(resolved.shape, layout, pp_rank=pp_rank_of(layout, run["rank"]))
        assert planned.states.unsharded_grads == 0
        assert abs(planned.total / run["peak_bytes"] - 1) <= 0.05, (row, run["rank"], planned.moments, run["bytes"])


def test_the_step_time_counts_a_reduce_scatter_per_micro_batch():
    """The data-parallel traffic grows by one reduce-scatter of the gradients per micro-batch beyond the first: the
    excess at 8 micro-batches is 7/3 of that at 4."""
    from disttrain.core.gpus import find_gpu
    from disttrain.layout.layout import Layout
    from disttrain.models.registry import MODEL_SHAPES
    from disttrain.plan.timing import Cluster, step_time

    shape, cluster = MODEL_SHAPES["7b"], Cluster(find_gpu("h100"), 8, 2)

    def excess(microbatches: int) -> float:
        layout = Layout(dp_shard=16, zero_stage=3, seq_len=4096, micro_batch_size=1,
                        global_batch_size=16 * microbatches)
        sharded = layout.replace(gradient_accumulation="sharded")
        assert sharded.reduces_every_microbatch and sharded.microbatches == microbatches
        return step_time(shape, sharded, cluster).dp_comm_s - step_time(shape, layout, cluster).dp_comm_s

    assert excess(4) > 0
    assert excess(8) == pytest.approx(excess(4) * 7 / 3, rel=1e-9)


def test_the_search_reduces_every_micro_batch_only_where_the_default_does_not_fit():
    """13b on 4 A100 80 GB (ZeRO-3, full checkpointing): each ranked layout with sharded accumulation is one whose
    default does not fit, and needs less than it; the default's layouts that fit are ranked as they are."""
    from disttrain.core.gpus import find_gpu
    from disttrain.models.registry import MODEL_SHAPES
    from disttrain.plan.estimate import estimate
    from disttrain.plan.search import SearchSpace, fits, search
    from disttrain.plan.timing import Cluster

    shape, cluster = MODEL_SHAPES["13b"], Cluster(find_gpu("a100-80g"), 4, 1)
    space = SearchSpace(seq_len=4096, global_batch_size=16, zero_stages=(3,), recompute=("full",), schedules=("1f1b",))
    result = search(shape, cluster, space, model="13b")
    sharded = [e for e in result.ranked if e.layout.gradient_accumulation == "sharded"]
    assert sharded and len(sharded) < len(result.ranked)
    for est in sharded:
        default = estimate(shape, est.layout.replace(gradient_accumulation="unsharded"), cluster, model="13b")
        assert not fits(default, result.budget_bytes), est.layout.describe(micro_batch=True)
        assert est.memory.total < default.memory.total
        assert est.time.step_s >= default.time.step_s


ACCUMULATIONS = {  # before the planner counted attention's backward without the reduced experts
    "sharded, offload": ("parallel.cpu_offload=true", "parallel.gradient_accumulation=sharded"),  # 21% over
    "unsharded": (),  # accumulating two micro-batches: 9% over
}


@pytest.fixture(scope="module")
def latent_moe(tmp_path_factory):
    """A tiny DeepSeek-V3 with its ratios of heads to width, 64 experts of the model's width, 2 a token."""
    from hf_models import saved_family

    return saved_family(tmp_path_factory, "deepseek_v3", hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                        qk_nope_head_dim=64, head_dim=32, qk_rope_head_dim=32, v_head_dim=64, kv_lora_rank=64,
                        q_lora_rank=96, n_routed_experts=64, num_experts_per_tok=2, moe_intermediate_size=256,
                        n_group=4, topk_group=2, num_hidden_layers=3, max_position_embeddings=2048)


@pytest.mark.parametrize("accumulation", list(ACCUMULATIONS))
def test_attention_after_the_reduced_experts_follows_the_dry_run(accumulation, latent_moe):
    """DeepSeek-V3's 131,072-token layout in small: latent attention over a cp=2 ring, experts split over ep=2 in
    FSDP units of their own, ZeRO-3, full checkpointing. Attention's backward (the ring's buffers) runs
    after its block's experts are reduced and resharded; the planner had counted it beside their gathered
    parameters and gradients (the full model: 5.8% over its dry run)."""
    from disttrain.cli.dryrun import dry_run

    cfg = load_config(None, [f"model.hf={latent_moe}", "precision.compute_dtype=bf16", "data.seq_len=2048",
                             "train.micro_batch_size=1", "train.global_batch_size=4", "parallel.cp=2", "parallel.ep=2",
                             "parallel.zero_stage=3", "parallel.activation_checkpointing=full",
                             *ACCUMULATIONS[accumulation]])
    run = dry_run(cfg, RANKS, [0], gpu_name="h100")["ranks"][0]
    assert abs(run["error"]["peak_bytes"]) <= 0.05, (run["error"], run["bytes"], run["planner"])
