"""The planner's mixture-of-experts terms: parameter counts against transformers' own models and the published
ones, FLOPs from the active parameters, expert shards per expert-parallel rank, the all-to-all's α-β time,
dispatch buffers, and the search over `parallel.ep`. In process: nothing here needs a launch."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import transformers

from disttrain.models import flops as F
from disttrain.cli import main
from disttrain.core.gpus import find_gpu
from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.models.hf.shape import hf_shape
from disttrain.models.registry import MODEL_SHAPES
from disttrain.models.shape import ModelShape, MoEShape
from disttrain.plan.estimate import estimate
from disttrain.plan.activations import rotary_input_bytes
from disttrain.plan.memory import layer_params, stage_activation_bytes
from disttrain.plan.moe import ALL_TO_ALLS_PER_LAYER, dispatch_s
from disttrain.plan.search import SearchSpace, layout_families, search
from disttrain.plan.timing import Cluster
from helpers import REPO

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
# Tiny configs of every MoE family transformers ships, each with its own names for the same things.
HF_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, mlp_only_layers=[0])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         shared_expert_intermediate_size=64, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
                                             n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                                             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                             qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
                                             topk_group=1)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
}
# What the built-in registry shapes leave out, by transformers' parameter names: Qwen3's q/k norms (the built-in
# model has none). A config.json's shape counts them, and gpt-oss's sinks and biases, Qwen2-MoE's shared-expert
# gate; only OLMoE's q/k norms (over the whole width, not per head) are left out (docs/planning.md).
NOT_COUNTED = ("q_norm.", "k_norm.")
NOT_COUNTED_HF = {"olmoe": NOT_COUNTED}


def _transformers_count(config, skip: tuple[str, ...] = NOT_COUNTED) -> tuple[int, int]:
    """(all parameters, those ModelShape counts) of transformers' own model, built on the meta device."""
    import torch

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    named = list(model.named_parameters())
    return sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if not any(s in n for s in skip))


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_hf_moe_configs_count_as_transformers_builds_them(family, tmp_path):
    cls, extra = HF_CONFIGS[family]
    config = getattr(transformers, cls)(**{**SMALL, **extra})
    config.save_pretrained(tmp_path)
    shape = hf_shape(str(tmp_path))
    total, counted = _transformers_count(config, NOT_COUNTED_HF.get(family, ()))
    assert shape.num_params() == counted, (family, total - counted)
    assert total - counted < 0.02 * total
    moe = shape.moe
    assert moe.num_experts == extra.get("num_experts", extra.get("n_routed_experts", extra.get("num_local_experts")))
    assert moe.num_experts_per_tok == 2
    assert moe.first_k_dense_replace == (1 if family in ("qwen3_moe", "deepseek_v3") else 0)
    assert moe.n_shared_experts == {"qwen2_moe": 2, "deepseek_v3": 1}.get(family, 0)
    assert moe.scoring_func == ("sigmoid" if family == "deepseek_v3" else "softmax")
    assert (shape.mla is not None) == (family == "deepseek_v3")  # multi-head latent attention, counted exactly


@pytest.mark.parametrize("name,cls,config", [
    ("qwen3-30b-a3b", "Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, moe_intermediate_size=768, num_experts=128,
                                             num_experts_per_tok=8)),
    ("qwen3-235b-a22b", "Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                               num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                                               head_dim=128, moe_intermediate_size=1536, num_experts=128,
                                               num_experts_per_tok=8)),
    ("mixtral-8x7b", "MixtralConfig", {}),  # transformers' defaults are Mixtral 8x7B's
])
def test_registry_moe_shapes_count_as_transformers_builds_them(name, cls, config):
    total, counted = _transformers_count(getattr(transformers, cls)(**config))
    shape = MODEL_SHAPES[name]
    assert shape.num_params() == counted  # Qwen3: less its q/k-norm weights (layers x 2 x head_dim)
    assert total - counted == (shape.n_layers * 2 * shape.head_dim if name.startswith("qwen3") else 0)


def test_deepseek_v3_config_counts_its_published_size(tmp_path):
    """DeepSeek-V3's report: 671B parameters, 37B activated per token (its MTP module, not in transformers' model,
    aside). transformers' DeepseekV3Config defaults are DeepSeek-V3's; the tiny model above checks every term
    against transformers' own count."""
    transformers.DeepseekV3Config().save_pretrained(tmp_path)
    shape = hf_shape(str(tmp_path))
    assert abs(shape.num_params() / 671e9 - 1) < 0.001
    assert abs(shape.num_params(active=True) / 37e9 - 1) < 0.02
    assert (shape.moe.n_shared_experts, shape.moe.first_k_dense_replace, shape.mla.kv_lora_rank) == (1, 3, 512)


def test_estimate_prints_the_published_total_and_active_counts(capsys):
    """Qwen3-30B-A3B's model card: 30.5B in total, 3.3B activated (its exact count, 3.353B, is truncated there)."""
    main(["estimate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--zero-stage", "3", "--ep", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert abs(out["params"] / 30.5e9 - 1) < 0.01
    assert abs(out["active_params"] / 3.3e9 - 1) < 0.02
    # The active parameters by hand from the card's architecture: attention (32 q heads and 4 kv heads of 128),
    # the router, 8 of the 128 experts of width 768 and two norms per layer; the final norm, embedding, output.
    d, layers = 2048, 48
    per_layer = 2 * d * 32 * 128 + 2 * d * 4 * 128 + d * 128 + 8 * 3 * d * 768 + 2 * d
    assert out["active_params"] == layers * per_layer + d + 2 * 151936 * d
    assert out["moe"]["experts_per_rank"] == 16 and out["moe"]["ep"] == 8
    main(["estimate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--zero-stage", "3", "--ep", "8"])
    assert "30,532,110,336 parameters (30.53 B; 3.35 B active: 128 experts, top-8)" in capsys.readouterr().out


def test_flops_per_token_follow_the_active_parameters():
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    active_matmul = shape.num_params(active=True) - shape.vocab_size * shape.dim  # the embedding is a lookup
    assert F.model_flops_per_token(shape, 4096) == 6 * active_matmul + 12 * 48 * 32 * 128 * 4096
    # A dense model of the same active size costs the same: FLOPs do not see the idle experts.
    experts = shape.moe.num_experts
    every_expert_active = replace(shape, moe=replace(shape.moe, num_experts_per_tok=experts))
    assert F.model_flops_per_token(every_expert_active, 4096) - F.model_flops_per_token(shape, 4096) == \
        6 * 48 * (experts - 8) * 3 * shape.dim * 768
    # Full recomputation redoes one forward of the active blocks.
    blocks = active_matmul - shape.vocab_size * shape.dim - shape.dim
    assert F.recompute_flops_per_token(shape, 4096, "full") == 2 * blocks + 12 * 48 * 32 * 128 * 4096 / 3
    # Selective keeps every matmul's output, the grouped expert matmuls' too: no matmul runs again
    # (tests/test_activation_checkpoint.py counts it on the blocks).
    assert F.recompute_flops_per_token(shape, 4096, "selective") == 0
    assert F.recompute_flops_per_token(MODEL_SHAPES["7b"], 4096, "selective") == 0


def _expert_split(shape: ModelShape) -> tuple[int, int]:
    """(dense parameters, routed-expert parameters) from the shape's fields."""
    moe = shape.moe
    experts = (shape.n_layers - moe.first_k_dense_replace) * moe.num_experts * 3 * shape.dim * moe.moe_intermediate_size
    return shape.num_params() - experts, experts


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_expert_states_per_rank_split_over_ep(ep):
    """DDP: every rank holds the dense parameters and 1/ep of the experts (fp32 parameters, gradients, Adam).
    ZeRO-1 splits the dense states over the 8 (one rank holds the embedding's whole) and the experts' over the
    8/ep ranks holding the same experts: 1/8 of them either way. ZeRO-3: the experts' dp/ep copies shard them,
    so a rank's share is 1/dp either way; its gathered block holds num_experts/ep experts."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    dense, experts = _expert_split(shape)
    base = dict(dp_shard=8, seq_len=4096, global_batch_size=8, ep=ep)
    ddp = estimate(shape, Layout(zero_stage=0, **base)).memory.states
    assert ddp.params == ddp.grads == 4 * (dense + experts / ep)
    assert ddp.optimizer == 8 * (dense + experts / ep)
    if ep > 1:
        zero1 = estimate(shape, Layout(zero_stage=1, **base)).memory.states
        assert zero1.params == ddp.params
        assert zero1.optimizer == pytest.approx(8 * (max(dense / 8, shape.vocab_size * shape.dim) + experts / 8),
                                                rel=1e-12)
    zero3 = estimate(shape, Layout(zero_stage=3, **base)).memory
    assert zero3.states.params == pytest.approx(4 * (dense + experts) / 8, rel=1e-12)
    block = zero3.moments["block"]["communication"]
    layer_experts = experts / shape.n_layers
    # gathered and prefetched (2 x 2 B) per expert parameter (their unsharded gradients are temporaries), and a
    # later block's: the earlier block's reduce-scatter input (4 B per parameter of its unit; with ep > 1 the split
    # experts are an FSDP unit of their own, reduced and freed before that block's end: its other parameters only),
    # where it and that block's sharded gradients outweigh the earlier block's freed activations
    def previous(lay: Layout) -> float:
        unit = layer_params(shape, 1, lay.ep)
        own = layer_experts / lay.ep if lay.ep > 1 else 0.0
        later = 4 * (unit - own) + 4 * unit / lay.shard_ranks > stage_activation_bytes(shape, lay, 0).layer_saved
        return 4 * (unit - own) if later else 0.0

    one = Layout(zero_stage=3, **{**base, "ep": 1})
    assert block - estimate(shape, one).memory.moments["block"]["communication"] == pytest.approx(
        2 * 2 * layer_experts * (1 / ep - 1) + previous(Layout(zero_stage=3, **base)) - previous(one), rel=1e-9)


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_accumulated_gradients_hold_this_ranks_experts_only(ep):
    """FSDP accumulating two micro-batches keeps the held parameters' gradients unsharded (fp32) until the last
    reduce-scatter: the dense ones and the E/ep experts this rank computes, not all E."""
    shape = MODEL_SHAPES["mixtral-8x7b"]
    dense, experts = _expert_split(shape)
    lay = Layout(dp_shard=8, zero_stage=3, ep=ep, seq_len=4096, global_batch_size=16, micro_batch_size=1)
    assert lay.microbatches == 2
    assert estimate(shape, lay).memory.states.unsharded_grads == 4 * (dense + experts / ep)


def test_hsdp_shards_expert_states_over_the_ranks_holding_the_same_experts():
    """HSDP 2 x 4 with ep=4: the experts' shard group is dp_shard / ep = 1 and dp_replicate replicates them, so
    a rank holds 1/4 of the experts, as the dense parameters are sharded 4 ways."""
    shape = MODEL_SHAPES["mixtral-8x7b"]
    dense, experts = _expert_split(shape)
    hsdp = estimate(shape, Layout(dp_replicate=2, dp_shard=4, zero_stage=3, ep=4, seq_len=4096,
                                  global_batch_size=8)).memory.states
    assert hsdp.params == pytest.approx(4 * dense / 4 + 4 * experts / 4, rel=1e-12)


def _a2a(n: int, nbytes: float, gbs: float, latency: float, efficiency: float = 0.8) -> float:
    return (n - 1) * latency + (n - 1) / n * nbytes / (gbs * 1e9 * efficiency)


def test_all_to_all_time_follows_the_alpha_beta_model():
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    h100 = find_gpu("h100")
    cluster = Cluster(h100, gpus_per_node=8, nodes=4)
    lay = Layout(dp_shard=32, zero_stage=3, seq_len=4096, global_batch_size=64, micro_batch_size=1)
    tokens_bytes = 2 * 4096 * 8 * shape.dim  # bf16 rows of dim, top-8, per micro-batch
    per_step = 2 * shape.n_layers * ALL_TO_ALLS_PER_LAYER  # micro-batches x MoE layers x 4
    assert dispatch_s(shape, lay, cluster) == 0.0  # ep=1: no dispatch
    intra = dispatch_s(shape, lay.replace(ep=8), cluster)
    assert intra == pytest.approx(per_step * _a2a(8, tokens_bytes, h100.intra_node_gbs, 5e-6), rel=1e-12)
    inter = dispatch_s(shape, lay.replace(ep=16), cluster)  # 16 ranks span two nodes: the network
    assert inter == pytest.approx(per_step * _a2a(16, tokens_bytes, h100.inter_node_gbs, 15e-6), rel=1e-12)
    assert inter / intra > 8  # NVLink 450 GB/s against 50 GB/s per GPU
    # Linear in the tokens routed; skew loads the busiest rank; full recomputation repeats the forward two.
    long = dispatch_s(shape, lay.replace(ep=8, seq_len=8192), cluster)
    assert long == pytest.approx(per_step * _a2a(8, 2 * tokens_bytes, h100.intra_node_gbs, 5e-6), rel=1e-12)
    assert dispatch_s(shape, lay.replace(ep=8), cluster, skew=2.0) == pytest.approx(
        per_step * _a2a(8, 2 * tokens_bytes, h100.intra_node_gbs, 5e-6), rel=1e-12)
    assert dispatch_s(shape, lay.replace(ep=8, activation_checkpointing="full"), cluster) == pytest.approx(1.5 * intra)
    # selective keeps the all-to-alls' results: its recomputation exchanges nothing
    assert dispatch_s(shape, lay.replace(ep=8, activation_checkpointing="selective"), cluster) == intra
    est = estimate(shape, lay.replace(ep=8), cluster)
    assert est.time.ep_comm_s == intra and est.time.step_s > est.time.compute_s + intra


def test_dispatch_buffers_grow_with_routing_skew_up_to_ep():
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    lay = Layout(dp_shard=8, zero_stage=3, seq_len=4096, global_batch_size=8, ep=8)
    rows = 4096 * 8  # tokens x top-k, balanced: each rank receives what it sends
    width, dim, e = 768, shape.dim, DTYPE_BYTES["bf16"]
    balanced = estimate(shape, lay).memory.activations
    skewed = estimate(shape, lay, routing_skew=2.0).memory.activations
    # The busiest rank receives twice the rows: its received copy and expert intermediates (saved, every layer),
    # and its receive buffer while the all-to-all runs (transient).
    assert skewed.saved - balanced.saved == pytest.approx(48 * e * rows * (dim + 4 * width), rel=1e-12)
    assert skewed.layer - balanced.layer == pytest.approx(e * rows * dim, rel=1e-12)
    capped = estimate(shape, lay.replace(ep=2), routing_skew=8.0).memory.activations  # at most all ep ranks' rows
    assert capped.saved == estimate(shape, lay.replace(ep=2), routing_skew=2.0).memory.activations.saved
    one = estimate(shape, lay.replace(ep=1), routing_skew=4.0).memory.activations  # one rank holds every expert
    assert one.saved == estimate(shape, lay.replace(ep=1)).memory.activations.saved


def test_context_parallel_ranks_route_their_chunk_and_lend_themselves_to_ep():
    """cp=2 x dp_shard=4 with ep=8: expert parallelism borrows the context ranks (8 ranks hold 1/8 of the experts
    each, the experts' shard group is dp_shard x cp / ep = 1), each rank routes half of every sequence (the
    all-to-all moves the rows of 4,096 of 8,192 tokens), and the search tries ep with cp."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    dense, experts = _expert_split(shape)
    cluster = Cluster(find_gpu("h100"), gpus_per_node=8, nodes=1)
    lay = Layout(dp_shard=4, cp=2, ep=8, zero_stage=3, seq_len=8192, global_batch_size=8, micro_batch_size=1)
    assert estimate(shape, lay).memory.states.params == pytest.approx(4 * (dense + experts) / 8, rel=1e-12)
    ddp = estimate(shape, lay.replace(zero_stage=0)).memory.states
    assert ddp.params == 4 * (dense + experts / 8)
    spread = {ep: estimate(shape, lay.replace(ep=ep)).as_dict()["moe"]["expert_data_parallel"] for ep in (1, 2, 8)}
    assert spread == {1: 8, 2: 4, 8: 1}  # the ranks an expert's states are spread over: dp_shard x cp / ep
    rows = 2 * 4096 * 8 * shape.dim  # bf16 rows of dim, top-8, per micro-batch: this rank's half of the sequence
    per_step = 2 * shape.n_layers * ALL_TO_ALLS_PER_LAYER
    assert dispatch_s(shape, lay, cluster) == pytest.approx(
        per_step * _a2a(8, rows, cluster.gpu.intra_node_gbs, 5e-6), rel=1e-12)
    space = SearchSpace(seq_len=32768, global_batch_size=8, zero_stages=(3,), recompute=("full",),
                        schedules=("1f1b",))
    assert any(lay.cp > 1 and lay.ep > 1 and lay.ep > lay.dp_shard for lay in layout_families(shape, cluster, space))


# One MoE layer whose 64 experts are 99.5% of the parameters: tensor and pipeline parallelism cannot split them.
EXPERT_HEAVY = ModelShape(dim=1024, n_layers=1, n_heads=8, n_kv_heads=8, vocab_size=1024, ffn_hidden_dim=1024,
                          max_seq_len=2048, moe=MoEShape(num_experts=64, num_experts_per_tok=2,
                                                         moe_intermediate_size=16384))


def test_search_picks_expert_parallelism_when_experts_dominate_memory():
    cluster = Cluster(find_gpu("l4"), gpus_per_node=8, nodes=1)
    space = SearchSpace(seq_len=2048, global_batch_size=16, zero_stages=(0,), max_micro_batch_size=2)
    result = search(EXPERT_HEAVY, cluster, space)
    assert result.ranked and all(e.layout.ep > 1 for e in result.ranked)
    assert not search(EXPERT_HEAVY, cluster, replace(space, ep=(1,))).ranked  # without it nothing fits
    assert {e.layout.ep for e in result.ranked} == {4, 8}  # ep=2 holds 32 experts: 25.8 GB of states, over 21.6
    with_zero1 = search(EXPERT_HEAVY, cluster, replace(space, zero_stages=(0, 1))).ranked  # it composes with ep
    assert {(e.layout.zero_stage, e.layout.ep) for e in with_zero1} == {(0, 4), (0, 8), (1, 4), (1, 8)}


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--ep", "3"],
     "parallel.ep=3 does not divide model.moe.num_experts=128"),
    (["estimate", "--model", "qwen3-30b-a3b", "--gpus", "4", "--ep", "8"],
     "parallel.ep=8 does not divide the data-parallel degree parallel.dp_shard=4"),
    (["estimate", "--model", "7b", "--gpus", "2", "--ep", "2"], "parallel.ep=2 on a dense model"),
    (["estimate", "--model", "qwen3-30b-a3b", "--routing-skew", "0.5"], "--routing-skew=0.5: must be at least 1"),
    (["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "3"],
     "--ep=3 does not divide model.moe.num_experts=8"),
    (["plan", "--model", "qwen3-30b-a3b", "--gpus", "32", "--ep", "64"], "--ep=64 does not divide --gpus=32"),
    (["plan", "--model", "qwen3-30b-a3b", "--gpus", "32", "--ep", "two"], "--ep=two: expected comma-separated"),
])
def test_planner_moe_mistakes_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("extra,message", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2 (allowed: 1"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers=[1] (allowed: the leading layers"),
    (dict(num_experts_per_tok=16), "num_experts_per_tok=16 (allowed: 1 to the 8 experts)"),
])
def test_hf_moe_configs_the_family_cannot_express_are_one_line(extra, message, tmp_path, capsys):
    config = transformers.Qwen3MoeConfig(**{**SMALL, "moe_intermediate_size": 32, "num_experts": 8,
                                            "num_experts_per_tok": 2, **extra})
    config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--hf", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_a_config_parallel_ep_goes_through_the_layout_rules_and_splits_the_experts():
    """`parallel.ep` from a config, through resolve_run and its layout rules (as training, the dry run and
    `estimate CONFIG` read it): refused in the rule's words where the experts cannot be split, and where accepted,
    the dry run on 8 simulated ranks (the real parallelize code on a fake process group) has each rank hold the
    dense parameters and a quarter of the experts (counted here from the shape's fields), all-reduce the experts'
    gradients over the 8 / 4 ranks that hold the same experts and dispatch tokens over 4."""
    import torch

    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run
    from disttrain.core.errors import UserError
    from disttrain.dryrun.simulate import simulate

    demo = str(REPO / "configs" / "demo.yaml")
    small = ["data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=1", "parallel.zero_stage=0"]
    for overrides, message in ((["model.name=debug-moe", "parallel.ep=3"],
                                "parallel.ep=3 does not divide model.moe.num_experts=8"),
                               (["model.name=debug-moe", "parallel.ep=8", "parallel.dp_shard=4", "parallel.tp=2"],
                                "parallel.ep=8 does not divide the data-parallel degree parallel.dp_shard=4"),
                               (["parallel.ep=4"], "parallel.ep=4 on a dense model")):  # demo.yaml: tiny, dense
        with pytest.raises(UserError, match=message):
            resolve_run(load_config(demo, [*small, *overrides]), 8, "cpu")
    assert resolve_run(load_config(demo, [*small, "model.name=debug-moe"]), 8, "cpu").layout.ep == 1  # no key: 1

    # without balancing: its all-reduce of routing statistics would add to dp_shard's gradient bytes below
    cfg = load_config(demo, [*small, "model.name=debug-moe", "parallel.ep=4", "model.moe.aux_loss_coef=0"])
    resolved = resolve_run(cfg, 8, "cpu")
    assert resolved.layout.describe() == "dp=8 zero=0 ep=4"
    dense, experts = _expert_split(resolved.shape)
    assert experts == 2 * 8 * 3 * 64 * 64  # debug-moe: 2 MoE layers of 8 routed SwiGLU experts, 64 x 64
    run = simulate(cfg, resolved, 0)
    with torch.device("meta"):
        buffers = sum(b.numel() * b.element_size() for b in resolved.spec.build().buffers())  # rotary tables
    assert run.bytes["parameters"] - buffers == 4 * (dense + experts // 4)  # fp32: 2 of the 8 experts per layer
    reduced = {c["dim"]: c["bytes"] for c in run.collectives if c["kind"] == "all_reduce"}
    assert reduced["dp_shard"] == 4 * dense and reduced["2 ranks"] == 4 * experts // 4
    assert {c["dim"] for c in run.collectives if c["kind"] == "all_to_all"} == {"4 ranks"}


def test_plan_writes_the_chosen_expert_parallel_degree(tmp_path, capsys):
    import yaml

    out = tmp_path / "mixtral.yaml"
    main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--gpu", "a100-80g", "--seq-len", "4096", "--top", "1",
          "--zero-stages", "3", "--out", str(out), "--json"])  # one ZeRO stage: a third of the search's CPU
    winner = json.loads(capsys.readouterr().out)["winner"]
    written = yaml.safe_load(out.read_text())
    assert written["model"]["name"] == "mixtral-8x7b"
    assert written["parallel"].get("ep", 1) == winner["layout"]["ep"] == winner["moe"]["ep"]
    assert winner["moe"]["experts_per_rank"] * winner["layout"]["ep"] == 8
    assert (winner["time"]["ep_comm_s"] > 0) == (winner["layout"]["ep"] > 1)


# Two layers of each: debug-moe (shared expert), and leading dense block + top-4 routed experts without shared ones.
SAVED_TENSOR_SHAPES = {"debug-moe": MODEL_SHAPES["debug-moe"],
                       "dense-first": replace(MODEL_SHAPES["debug-moe"], n_layers=3, moe=replace(
                           MODEL_SHAPES["debug-moe"].moe, num_experts_per_tok=4, first_k_dense_replace=1,
                           n_shared_experts=0, moe_intermediate_size=32))}


@pytest.mark.parametrize("name", list(SAVED_TENSOR_SHAPES))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_moe_activations_match_saved_tensors(name, recompute, monkeypatch):
    """The planner's MoE block against what autograd keeps for the built-in MoE family on one device (ep = 1):
    saved-tensor hooks and the selective-checkpoint cache, fp32 and bf16, as for the dense block in
    tests/test_plan.py."""
    import torch

    import disttrain.bench.activations as bench
    import disttrain.models.moe as moe_family

    def build(shape):
        model = moe_family.moe_spec(shape).build()
        with torch.no_grad():
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
        return model

    monkeypatch.setattr(bench, "Transformer", build)
    shape = SAVED_TENSOR_SHAPES[name]
    for mb, seq, dtype, chunk in ((1, 64, "fp32", 0), (2, 96, "bf16", 0), (2, 96, "bf16", 40)):
        measured = bench.saved_activation_bytes(shape, mb, seq, recompute,
                                                {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                                                loss_chunk_tokens=chunk)
        layout = Layout(micro_batch_size=mb, global_batch_size=mb, seq_len=seq, activation_checkpointing=recompute,
                        param_dtype=dtype, compute_dtype=dtype, zero_stage=3, loss_chunk_tokens=chunk)
        # one device: no FSDP2 to cast the rotary tables into each block (tests/test_context_parallel.py)
        uncast = shape.n_layers * rotary_input_bytes(shape, mb, seq, layout)
        predicted = stage_activation_bytes(shape, layout, 0, fused_norm=False).saved - uncast
        assert predicted == pytest.approx(measured, rel=1e-3), (mb, seq, dtype, chunk)


@pytest.mark.parametrize("name", list(SAVED_TENSOR_SHAPES))
def test_moe_layer_under_autocast_matches_saved_tensors(name):
    """fp32 weights under bf16 autocast (DDP, ZeRO-1): what one MoE layer keeps for backward, its input and its
    weights' cast copies apart (the planner counts those with the block's norm and the model states), against
    the planner's MoE term plus the two casts of the MLP input the dense block's term already holds."""
    import torch

    from disttrain.models.moe.layer import MoEFeedForward, MoERouting
    from disttrain.plan.activations import LayerActivations, dtype_bytes
    from disttrain.plan.moe import moe_layer_bytes

    shape, mb, seq = SAVED_TENSOR_SHAPES[name], 2, 96
    moe = shape.moe
    torch.manual_seed(0)
    shared = None
    if moe.n_shared_experts:
        from disttrain.models.llama.model import FeedForward
        shared = FeedForward(shape.dim, moe.n_shared_experts * moe.moe_intermediate_size)
    layer = MoEFeedForward(shape.dim, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
                           moe.n_shared_experts, "softmax", MoERouting(), shared)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(mb, seq, shape.dim, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    held: dict[int, tuple] = {}

    def pack(t):
        held.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), t.dtype, t.dim()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).sum().backward()
    cast_sizes = {2 * p.numel() for p in layer.parameters() if p.dim() >= 2}
    weight_casts = {k for k, (nbytes, dtype, dim) in held.items() if dtype == torch.bfloat16 and nbytes in cast_sizes}
    measured = sum(v[0] for k, v in held.items() if k not in params | weight_casts | {x.untyped_storage().data_ptr()})
    layout = Layout(micro_batch_size=mb, global_batch_size=mb, seq_len=seq, param_dtype="bf16", compute_dtype="bf16",
                    zero_stage=0)  # DDP's layout names the autocast dtype as its parameter dtype
    ec, er = dtype_bytes(layout)
    predicted = moe_layer_bytes(shape, layout, LayerActivations(0.0, 0.0), ec, er=er).saved + 2 * ec * mb * seq * shape.dim
    assert predicted == pytest.approx(measured, rel=1e-3)


def test_skew_and_whole_experts_under_tensor_parallel_cost_compute():
    """The FLOP count spreads a replica's work evenly over its tp ranks; the busiest expert-parallel rank does
    skew x its share of the routed experts, and tensor-parallel ranks run the experts whole on the same tokens."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    h100 = find_gpu("h100")
    cluster = Cluster(h100, gpus_per_node=8, nodes=1)
    rate = h100.peak_flops("bf16") * cluster.compute_efficiency
    routed_per_token = 6 * 48 * 8 * 3 * shape.dim * 768  # the 8 routed experts of every layer, fwd + bwd
    lay = Layout(dp_shard=8, zero_stage=3, ep=8, seq_len=4096, global_batch_size=16, micro_batch_size=1)
    tokens = 2 * 4096  # per data-parallel rank and step
    balanced = estimate(shape, lay, cluster).time.compute_s
    assert estimate(shape, lay, cluster, routing_skew=2.0).time.compute_s - balanced == pytest.approx(
        routed_per_token * tokens / rate, rel=1e-9)
    tp = Layout(dp_shard=4, tp=2, zero_stage=3, ep=4, seq_len=4096, global_batch_size=16, micro_batch_size=1)
    even_share = F.hardware_flops_per_token(shape, 4096) * 16 * 4096 / 8  # the whole step's FLOPs over 8 ranks
    tokens = 4 * 4096  # per data-parallel rank, every one of them routed by both tensor-parallel ranks
    assert estimate(shape, tp, cluster).time.compute_s == pytest.approx(
        (even_share + routed_per_token * tokens * (1 - 1 / 2)) / rate, rel=1e-9)
