"""The planner against published numbers, against what the runtime really holds, and its search over every
micro-batch size. Reference values are copied from the papers, with where they are printed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from disttrain.config.load import load_config
from disttrain.config.resolve import resolve_run
from disttrain.models.registry import MODEL_SHAPES
from disttrain.models import flops as F
from disttrain.plan.estimate import estimate, shape_for_params
from disttrain.core.gpus import GPUS, GPUSpec, find_gpu, match_device_name
from disttrain.layout.layout import Layout
from disttrain.layout.rules import layout_problems
from disttrain.layout.splits import split_layers
from disttrain.plan.activations import rotary_input_bytes
from disttrain.plan.memory import (korthikanti_in_flight_factor, korthikanti_layer_bytes, model_state_bytes,
                                   stage_activation_bytes)
from disttrain.plan.search import SearchSpace, search
from disttrain.plan.timing import Cluster, all_gather_s, all_reduce_s, bubble_fraction, step_time
from helpers import REPO, run_cli

# ---------------------------------------------------------------- ZeRO (Rajbhandari et al. 2020)

# Table 1: per-device memory (GB) of model states with mixed-precision Adam (K = 12), by
# data-parallel degree, for Pos / Pos+g / Pos+g+p. Columns: 7.5B, 128B and 1T models.
ZERO_TABLE_1 = {
    # Nd: ((7.5B: os, os+g, os+g+p), (128B: ...), (1T: ...))
    1: ((120, 120, 120), (2048, 2048, 2048), (16000, 16000, 16000)),
    4: ((52.5, 41.3, 30), (896, 704, 512), (7000, 5500, 4000)),
    16: ((35.6, 21.6, 7.5), (608, 368, 128), (4750, 2875, 1000)),
    64: ((31.4, 16.6, 1.88), (536, 284, 32), (4187, 2218, 250)),
    256: ((30.4, 15.4, 0.47), (518, 263, 8), (4046, 2054, 62.5)),
    1024: ((30.1, 15.1, 0.12), (513, 257, 2), (4011, 2013, 15.6)),
}


def _last_digit(printed: float) -> float:
    text = repr(float(printed)).rstrip("0").rstrip(".")
    return 10.0 ** -len(text.split(".")[1]) if "." in text else 1.0


@pytest.mark.parametrize("nd", list(ZERO_TABLE_1))
def test_zero_paper_table_1_cell_for_cell(nd):
    for psi, row in zip((7.5e9, 128e9, 1e12), ZERO_TABLE_1[nd]):
        for stage, printed in zip((1, 2, 3), row):
            layout = Layout(dp_shard=nd, zero_stage=stage, param_dtype="fp16")
            s = model_state_bytes(psi, layout, accounting="zero-paper")
            gb = (s.params + s.grads + s.optimizer) / 1e9
            # The table prints 3 significant figures, rounding some cells and truncating others:
            # the prediction must lie within one unit of the last printed digit.
            assert abs(gb - printed) < _last_digit(printed), (nd, psi, stage, gb, printed)


def test_zero_paper_baseline_is_16_bytes_per_parameter_and_runtime_differs_as_documented():
    psi = 7.5e9
    base = model_state_bytes(psi, Layout(param_dtype="fp16"), "zero-paper")
    assert (base.params, base.grads, base.optimizer) == (2 * psi, 2 * psi, 12 * psi)  # 2Ψ + 2Ψ + KΨ
    # This runtime keeps fp32 parameters and gradients (no separate master copy): 4 + 4 + 8.
    runtime = model_state_bytes(psi, Layout(dp_shard=8, zero_stage=2, param_dtype="bf16"), "runtime")
    assert (runtime.params, runtime.grads, runtime.optimizer) == (4 * psi / 8, 4 * psi / 8, 8 * psi / 8)
    offload = model_state_bytes(psi, Layout(dp_shard=8, zero_stage=3, cpu_offload=True), "runtime")
    assert offload.params == offload.grads == offload.optimizer == 0 and offload.cpu == 16 * psi / 8


# ---------------------------------------------------------------- Korthikanti et al. 2022


def test_korthikanti_activation_formulas():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B (their Table 3)
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(s, b, h, a, t, True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(s, b, h, a, t, True, "selective") == pytest.approx(sbh * 34 / t)
    assert korthikanti_layer_bytes(s, b, h, a, t, False, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert korthikanti_layer_bytes(s, b, h, a, 1, False, "full") == 2 * sbh
    # Section 5: selective recomputation saves 70% of activation memory for GPT-3 and 65% for MT-NLG.
    for (h_, a_), saving in (((12288, 96), 0.70), ((20480, 128), 0.65)):
        full = korthikanti_layer_bytes(s, b, h_, a_, t, True)
        assert 1 - korthikanti_layer_bytes(s, b, h_, a_, t, True, "selective") / full == pytest.approx(saving, abs=0.005)


def test_korthikanti_recomputation_flops_overheads():
    # Section 6: selective recomputation costs 2.7% (GPT-3) and 1.6% (MT-NLG 530B) more FLOPs.
    for layers, hidden, overhead in ((96, 12288, 0.027), (105, 20480, 0.016)):
        model = F.korthikanti_hardware_flops_per_iteration(1, 2048, layers, hidden, 51200, "none")
        sel = F.korthikanti_hardware_flops_per_iteration(1, 2048, layers, hidden, 51200, "selective")
        assert sel / model - 1 == pytest.approx(overhead, abs=0.0006)


def test_pipeline_in_flight_micro_batches():
    assert korthikanti_in_flight_factor(1, 8, "1f1b") == 1
    assert korthikanti_in_flight_factor(4, 16, "1f1b") == 4  # p in flight on the first stage
    assert korthikanti_in_flight_factor(4, 16, "gpipe") == 16  # all m
    assert korthikanti_in_flight_factor(4, 16, "interleaved_1f1b", 2) == pytest.approx(4 * (1 + 3 / 8))
    assert korthikanti_in_flight_factor(4, 2, "1f1b") == 2  # never more than exist


# ---------------------------------------------------------------- FLOPs (PaLM, Megatron 2021)


def test_palm_540b_model_flops_utilisation():
    # PaLM (Chowdhery et al. 2022), section 4.1 and appendix B: 540.35B parameters, L=118, H=48,
    # Q=256, T=2048, 238.3K tokens/s on 6144 TPU v4 chips of 275 TFLOP/s -> MFU 46.2%.
    per_token = 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    assert F.mfu(per_token, 238.3e3 / 6144, 275e12) == pytest.approx(0.462, abs=0.0005)


def test_model_flops_follow_palm_for_this_framework_models():
    shape = MODEL_SHAPES["7b"]
    n = shape.num_params() - shape.vocab_size * shape.dim  # the input embedding is a lookup
    expected = 6 * n + 12 * shape.n_layers * shape.n_heads * shape.head_dim * 4096
    assert F.model_flops_per_token(shape, 4096) == expected
    tied = MODEL_SHAPES["1b"]  # tied: the shared matrix counts once, as the output projection
    assert F.matmul_params(tied) == tied.num_params()
    # Full recomputation redoes each block's forward: a third of the blocks' matmul FLOPs.
    extra = F.hardware_flops_per_token(shape, 4096, "full") - F.model_flops_per_token(shape, 4096)
    assert extra == pytest.approx(2 * F.block_params(shape) + 4 * shape.n_layers * shape.n_heads * shape.head_dim * 4096)


@pytest.mark.parametrize("layers,hidden,billions", [(96, 12288, 174.6), (80, 12288, 145.6), (96, 16384, 310.1),
                                                    (105, 20480, 529.6), (128, 25600, 1008.0)])
def test_megatron_parameter_count_table_1(layers, hidden, billions):
    # Narayanan et al. 2021, Table 1 (V = 51200, s = 2048).
    assert F.megatron_params(layers, hidden, 51200, 2048) / 1e9 == pytest.approx(billions, abs=0.05)


def test_megatron_training_time_estimates():
    # Section 5.1: GPT-3 175B on 300B tokens, 1024 A100s at 140 TFLOP/s: about 34 days; the 1T model
    # on 450B tokens, 3072 GPUs at 163 TFLOP/s: about 84 days (end-to-end time ≈ 8TP/nX).
    assert F.training_days(300e9, 8 * 175e9, 1024, 140e12) == pytest.approx(34, abs=0.5)
    assert F.training_days(450e9, 8 * 1e12, 3072, 163e12) == pytest.approx(84, abs=1)
    # Eq. 3 with recomputation is ≈ 8·B·s·P (the approximation behind 8TP/nX).
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    assert F.megatron_flops_per_iteration(b, s, l, h, v) / (8 * b * s * F.megatron_params(l, h, v, s)) == \
        pytest.approx(1.0, abs=0.03)
    assert F.megatron_flops_per_iteration(b, s, l, h, v, recompute=False) / \
        F.megatron_flops_per_iteration(b, s, l, h, v) == pytest.approx(0.75, abs=0.01)


# ---------------------------------------------------------------- hardware and communication


def test_hardware_table_is_complete_and_sourced():
    for key in ("a100-40g", "a100-80g", "h100", "h100-pcie", "h200", "b200", "l40s", "l4", "mi300x"):
        gpu = GPUS[key]
        assert set(gpu.peak_tflops) == {"bf16", "fp16", "tf32", "fp32"}
        assert gpu.peak_tflops["bf16"] > gpu.peak_tflops["tf32"] > 0 and gpu.memory_gb > 0
        assert gpu.source.startswith("https://") and gpu.intra_node_gbs > 0 and gpu.inter_node_gbs > 0
    assert GPUS["a100-80g"].peak_tflops["bf16"] == 312 and GPUS["h100"].peak_tflops["bf16"] == 989.4
    assert find_gpu("A100").name == "a100-40g"
    assert match_device_name("NVIDIA H100 80GB HBM3").name == "h100"
    assert match_device_name("NVIDIA A100-SXM4-80GB").name == "a100-80g"
    assert match_device_name("Tesla V100-SXM2-32GB").name == "v100-32g"
    v100 = GPUS["v100-32g"]  # no bf16 tensor cores: bf16 at the fp32 rate, fp16 on tensor cores
    assert v100.peak_tflops["fp16"] == 125 and v100.peak_tflops["bf16"] == v100.peak_tflops["fp32"] == 15.7
    with pytest.raises(KeyError):
        find_gpu("tpu")


def test_alpha_beta_collectives():
    # Ring all-reduce moves 2(n−1)/n of the data, all-gather (n−1)/n (NCCL's bus-bandwidth factors).
    assert all_reduce_s(8, 8e9, 1e9, 0.0) == pytest.approx(2 * 7 / 8 * 8)
    assert all_gather_s(8, 8e9, 1e9, 0.0) == pytest.approx(7 / 8 * 8)
    assert all_reduce_s(4, 0, 1e9, 1e-5) == pytest.approx(6e-5)
    assert all_reduce_s(1, 1e9, 1e9, 1.0) == 0


def test_bubble_fractions():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)  # (p−1)/(m+p−1)
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert bubble_fraction("zero_bubble", 4, 8, 2) < bubble_fraction("interleaved_1f1b", 4, 8, 2)
    assert bubble_fraction("1f1b", 1, 8) == 0


def test_pipeline_fill_and_drain_idle_for_the_other_stages_work():
    """On a measured machine the stages' times differ (125m's last stage holds the 50k-vocabulary output
    layer): 1F1B over 2 stages idles one micro-batch of the cheaper stage, not of the dearer one."""
    from disttrain.plan.timing import _stage_compute

    shape = MODEL_SHAPES["125m"]
    cluster = Cluster(GPUS["h100"], gpus_per_node=2, nodes=1, elementwise_bytes_per_s=20e9, op_overhead_s=2e-6)
    layout = Layout(pp=2, global_batch_size=4, micro_batch_size=1, seq_len=128, param_dtype="fp32")
    t = step_time(shape, layout, cluster)
    rate = cluster.gpu.peak_flops("tf32")
    first, last = (_stage_compute(shape, layout, cluster, rate, r)[0] for r in (0, 1))
    assert last > 1.2 * first and t.compute_s == pytest.approx(last)
    assert t.bubble_s == pytest.approx(first / layout.microbatches)  # (p-1)/m of the other stage's step


def test_collectives_are_placed_on_the_links_they_use():
    """tp innermost: tp=8 on 8-GPU nodes stays on NVLink; data parallel over nodes pays the network."""
    shape = MODEL_SHAPES["7b"]
    cluster = Cluster(GPUS["h100"], gpus_per_node=8, nodes=2)
    tp8 = step_time(shape, Layout(tp=8, dp_shard=2, zero_stage=0, global_batch_size=16, seq_len=4096), cluster)
    slow_net = replace(cluster, inter_node_gbs=1.0)
    tp8_slow = step_time(shape, Layout(tp=8, dp_shard=2, zero_stage=0, global_batch_size=16, seq_len=4096), slow_net)
    assert tp8_slow.tp_comm_s == pytest.approx(tp8.tp_comm_s)  # unaffected by the network
    assert tp8_slow.dp_comm_s > 10 * tp8.dp_comm_s


# ---------------------------------------------------------------- against the runtime


@pytest.mark.parametrize("model", ["debug", "tiny"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_prediction_matches_saved_tensors(model, recompute):
    """Predicted saved-activation bytes vs. what autograd holds (saved-tensor hooks + the selective
    checkpoint cache), fp32 and bf16, on CPU (decomposed RMSNorm). The issue asks for 20%; the
    per-tensor accounting makes it exact to a few bytes (the loss's scalar weight)."""
    import torch

    from disttrain.bench.activations import saved_activation_bytes

    shape = MODEL_SHAPES[model]
    # the loss on whole logits, in chunks smaller than a micro-batch, in one chunk
    for mb, seq, dtype, chunk in ((1, 64, "fp32", 0), (2, 128, "fp32", 0), (2, 96, "bf16", 0), (2, 128, "fp32", 40),
                                  (2, 96, "bf16", 2048)):
        measured = saved_activation_bytes(shape, mb, seq, recompute, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                                          loss_chunk_tokens=chunk)
        # bf16 weights throughout: FSDP2's parameter dtype (DDP would keep fp32 weights under autocast,
        # tests/test_planner_grid.py)
        layout = Layout(micro_batch_size=mb, global_batch_size=mb, seq_len=seq, activation_checkpointing=recompute,
                        param_dtype=dtype, compute_dtype=dtype, zero_stage=3, loss_chunk_tokens=chunk)
        # one device: no FSDP2 to cast the rotary tables into each block (tests/test_context_parallel.py)
        uncast = shape.n_layers * rotary_input_bytes(shape, mb, seq, layout)
        predicted = stage_activation_bytes(shape, layout, 0, fused_norm=False).saved - uncast
        assert predicted == pytest.approx(measured, rel=1e-3), (mb, seq, dtype, chunk)


# The model-state comparison against allocations on 1, 2 and 4 ranks lives in tests/test_sharding.py
# (test_model_state_bytes_match_the_planner), next to the runtime it measures.


# ---------------------------------------------------------------- layouts and search


def test_layout_rules():
    shape = MODEL_SHAPES["tiny"]  # 8 heads, 4 kv heads, 4 layers
    problems = layout_problems(shape, Layout(tp=3, dp_shard=1, global_batch_size=3, micro_batch_size=1))
    assert [str(p) for p in problems] == [
        "parallel.tp=3 does not divide model.n_heads=8", "parallel.tp=3 does not divide model.n_kv_heads=4",
        "parallel.tp=3 does not divide model.vocab_size=256"]
    assert "exceeds model.n_layers=4" in str(layout_problems(shape, Layout(pp=8))[0])
    assert "must be a multiple of parallel.pp=2" in str(layout_problems(
        shape, Layout(pp=2, pp_schedule="interleaved_1f1b", global_batch_size=3, micro_batch_size=1))[0])
    assert "must be at least parallel.pp=4" in str(layout_problems(
        shape, Layout(pp=4, global_batch_size=2, micro_batch_size=1))[0])
    assert layout_problems(shape, Layout(pp=4, pp_schedule="gpipe", global_batch_size=2, micro_batch_size=1)) == []
    assert split_layers(10, 4) == [2, 2, 3, 3]


def test_tensor_and_pipeline_split_the_model_states():
    shape = MODEL_SHAPES["7b"]
    base = estimate(shape, Layout(seq_len=4096)).memory
    tp = estimate(shape, Layout(tp=4, seq_len=4096)).memory
    pp = estimate(shape, Layout(pp=4, seq_len=4096, global_batch_size=4)).memory
    assert tp.params_per_rank == pytest.approx(base.params_per_rank / 4, rel=0.01)
    assert pp.params_per_rank == pytest.approx(base.params_per_rank / 4, rel=0.05)
    sp = estimate(shape, Layout(tp=4, seq_len=4096, sequence_parallel=True)).memory
    assert sp.activations.saved < tp.activations.saved < base.activations.saved


def _toy_cluster(memory_gb: float, gpus_per_node: int, nodes: int) -> Cluster:
    gpu = GPUSpec("toy", "toy", {"bf16": 100, "fp16": 100, "tf32": 50, "fp32": 10}, memory_gb, 100, 10, "https://x")
    return Cluster(gpu, gpus_per_node, nodes)


def test_search_tries_every_micro_batch_size():
    """Memory is not monotonic in the micro-batch size: a GPipe rank holds every micro-batch in flight, each with
    its chunked loss head's weight gradient, so on 4 GB GPUs `125m` over 4 GPipe stages fits at micro-batch 4 but
    not at 1 or 2. The search finds it (a search that stopped at the first size not fitting missed it), and ranks
    only what fits, fastest first."""
    shape, cluster = MODEL_SHAPES["125m"], _toy_cluster(4.0, 4, 1)
    result = search(shape, cluster, SearchSpace(seq_len=1024, global_batch_size=32), headroom=0.1)
    gpipe = {e.layout.micro_batch_size: e for e in result.ranked if e.layout.pp == 4 and e.layout.dp == 1
             and e.layout.pp_schedule == "gpipe" and e.layout.activation_checkpointing == "full"}
    assert {1, 2}.isdisjoint(gpipe) and 4 in gpipe
    low = Layout(pp=4, pp_schedule="gpipe", activation_checkpointing="full", seq_len=1024, global_batch_size=32,
                 micro_batch_size=1, dp_shard=1)
    assert estimate(shape, low, cluster).memory.total > 0.9 * 4e9 >= gpipe[4].memory.total
    assert all(e.memory.total <= 4e9 * 0.9 for e in result.ranked)
    speeds = [e.time.tokens_per_s for e in result.ranked]
    assert speeds == sorted(speeds, reverse=True)


def test_search_drops_what_does_not_fit():
    shape = MODEL_SHAPES["7b"]
    space = SearchSpace(seq_len=4096, global_batch_size=64)
    assert not search(shape, _toy_cluster(20, 1, 1), space).ranked  # 7B x 16 bytes on one 20 GB GPU
    assert search(shape, Cluster(GPUS["a100-80g"], 8, 1), space).ranked


def test_shape_for_params():
    name, shape = shape_for_params(13e9)
    assert name == "13b-shaped" and shape.num_params() == pytest.approx(13e9, rel=0.02)


# ---------------------------------------------------------------- CLI


def test_estimate_json_has_stable_keys_and_matches_the_api():
    proc = run_cli("estimate", "--model", "7b", "--gpus", "8", "--zero-stage", "3", "--seq-len", "4096",
                   "--micro-batch-size", "2", "--activation-checkpointing", "full", "--json")
    out = json.loads(proc.stdout)
    assert set(out["bytes_per_rank"]) >= {"params", "grads", "optimizer", "activations", "buffers", "total"}
    layout = Layout(dp_shard=8, zero_stage=3, seq_len=4096, micro_batch_size=2, global_batch_size=16,
                    activation_checkpointing="full")
    est = estimate(MODEL_SHAPES["7b"], layout)
    psi = MODEL_SHAPES["7b"].num_params()
    assert out["params"] == psi
    # ZeRO-3 over 8 ranks in this runtime: fp32 parameters, fp32 gradients, two fp32 Adam moments, all / 8
    assert (out["bytes_per_rank"]["params"], out["bytes_per_rank"]["grads"], out["bytes_per_rank"]["optimizer"]) == \
        (4 * psi / 8, 4 * psi / 8, 8 * psi / 8)
    assert out["bytes_per_rank"]["total"] == pytest.approx(est.memory.total)
    assert out["flops_per_token"] == pytest.approx(F.model_flops_per_token(MODEL_SHAPES["7b"], 4096))
    assert out["flops_per_step"] == pytest.approx(out["flops_per_token"] * 16 * 4096)


def test_estimate_from_config_and_zero_paper_accounting():
    proc = run_cli("estimate", str(REPO / "configs" / "fsdp.yaml"), "--accounting", "zero-paper", "--gpus", "2", "--json")
    out = json.loads(proc.stdout)
    cfg = load_config(REPO / "configs" / "fsdp.yaml")
    assert out["model"] == cfg.model.name and out["layout"]["dp_shard"] == 2
    assert out["accounting"] == "zero-paper"
    text = run_cli("estimate", "--model", "13b", "--gpus", "32", "--zero-stage", "3", "--time", "--gpu", "a100-80g",
                   "--tokens", "300e9").stdout
    assert "Memory per GPU" in text and "tokens/s" in text and "days" in text


def test_plan_writes_a_config_the_runtime_validates(tmp_path):
    out = tmp_path / "winner.yaml"
    proc = run_cli("plan", "--model", "7b", "--gpus", "16", "--gpu", "a100-80g", "--seq-len", "4096",
                   "--global-batch-tokens", "1M", "--tokens", "100e9", "--out", str(out), "--json")
    result = json.loads(proc.stdout)
    assert result["winner"]["bytes_per_rank"]["total"] <= 80e9 * 0.9
    cfg = load_config(out)
    resolve_run(cfg, 16, "cuda")
    assert cfg.train.global_batch_size * cfg.data.seq_len == 2 ** 20
    winner = yaml.safe_load(out.read_text())
    assert winner["parallel"]["zero_stage"] == result["winner"]["layout"]["zero_stage"]
    # a complete run: an optimizer for a 7B model (GPT-3's 6.7B rate, 1.2e-4), warmup over 1% of the 95,367
    # steps, decay to a tenth, and the file says these are a starting point
    steps = round(100e9 / 2 ** 20)
    assert cfg.train.steps == steps
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.min_lr) == (1.2e-4, round(steps / 100), 1.2e-5)
    assert "not a tuned one" in out.read_text().splitlines()[2]



@pytest.mark.parametrize("model,gpus,seq_len", [("13b", 32, 4096), ("7b", 16, 4096), ("70b", 64, 4096),
                                                ("qwen3-30b-a3b", 32, 4096), ("7b", 32, 131072)])
def test_the_written_config_is_the_planned_layout(model, gpus, seq_len):
    """The config `plan --out` writes resolves, on the planned world size, to exactly the winning Layout (its
    pipeline schedule length spelled out): Layout.to_config is the one inverse of Layout.from_config."""
    from disttrain.config.schema import RunConfig
    from disttrain.plan.render import winner_config
    from disttrain.plan.search import SearchSpace, search
    from disttrain.plan.timing import Cluster
    from disttrain.core.gpus import find_gpu

    shape = MODEL_SHAPES[model]
    space = SearchSpace(seq_len=seq_len, global_batch_size=max(gpus, 2 ** 22 // seq_len))
    result = search(shape, Cluster(find_gpu("h100"), 8, gpus // 8), space, model=model)
    assert result.ranked
    for est in result.ranked[:5]:
        expected = est.layout.replace(pp_microbatches=est.layout.microbatches) if est.layout.pp > 1 else est.layout
        cfg = RunConfig.model_validate(winner_config(est))
        assert Layout.from_config(cfg, gpus, "cuda") == expected

# ---------------------------------------------------------------- mixed GPU types


def test_mixed_cluster_shares_follow_peak_flops_and_balance_the_busy_time(tmp_path):
    """8 x A100-80G + 8 x V100-32G in fp16: weights are the ratio of modelled time per micro-batch (not
    far from the peak ratio 312 : 125 TFLOP/s), the split gives each type about the same busy time,
    and the step beats equal shares."""
    from disttrain.plan.mixed_gpus import parse_cluster, plan_mixed

    groups = parse_cluster("8xa100-80g,8xv100-32g")
    space = SearchSpace(seq_len=4096, global_batch_size=64, param_dtype="fp16")
    plans = plan_mixed(MODEL_SHAPES["13b"], groups, space, model="13b", dtype="fp16")
    win = plans[0]
    lay = win.estimate.layout
    assert lay.pp == 1 and lay.dp > 1 and lay.balanced
    n_a100 = win.rank_types.count("a100-80g")
    per = win.per_micro_batch_s
    speed = round(per["v100-32g"] / per["a100-80g"], 2)
    assert list(lay.balance_weights) == [speed] * n_a100 + [1.0] * (lay.dp - n_a100)
    assert 0.8 < speed / (312 / 125) < 1.0  # tensor-parallel communication does not speed up with FLOP/s
    busy = {t: max(n for n, r in zip(win.shares, win.rank_types) if r == t) * win.per_micro_batch_s[t]
            for t in ("a100-80g", "v100-32g")}
    per_mb = max(win.per_micro_batch_s.values())
    assert abs(busy["a100-80g"] - busy["v100-32g"]) <= per_mb  # within one micro-batch of the slower type
    assert win.equal_step_s > 1.5 * win.step_s
    assert all(p.estimate.memory.total <= 32.5e9 * 0.9 for p in plans)  # fits the smaller GPU
    # the written config trains on the 16 ranks with those shares
    out = tmp_path / "mixed.yaml"
    proc = run_cli("plan", "--model", "13b", "--cluster", "8xa100-80g,8xv100-32g", "--dtype", "fp16",
                   "--seq-len", "4096", "--global-batch-size", "64", "--out", str(out), "--json")
    result = json.loads(proc.stdout)
    assert result["winner"]["shares"] == win.shares
    cfg = load_config(out)
    layout = resolve_run(cfg, 16, "cuda").layout
    assert layout.initial_shares() == win.shares and cfg.parallel.balance == "auto"


def test_one_gpu_type_as_a_cluster_is_the_plain_planner():
    from disttrain.plan.mixed_gpus import parse_cluster, plan_mixed

    space = SearchSpace(seq_len=4096, global_batch_size=64)
    mixed = plan_mixed(MODEL_SHAPES["13b"], parse_cluster("16xa100-80g"), space, model="13b")[0]
    plain = search(MODEL_SHAPES["13b"], Cluster(find_gpu("a100-80g"), 8, 2), space, model="13b").ranked[0]
    assert mixed.estimate.layout == plain.layout and not mixed.estimate.layout.balanced
    assert mixed.step_s == pytest.approx(plain.time.step_s, rel=1e-12)


def test_plan_writes_nothing_unless_asked(tmp_path):
    proc = run_cli("plan", "--model", "tiny", "--gpus", "2", "--gpu", "a100-80g", cwd=tmp_path)
    assert "Pass --out FILE.yaml to write the winner as a config." in proc.stdout
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,expected", [
    (["estimate", "--model", "tiny", "--cpu-offload", "--zero-stage", "1"],
     "parallel.cpu_offload=true needs parallel.zero_stage 2 or 3 (FSDP2), not 1"),
    (["estimate", "--model", "huge"], "--model=huge: unknown model (allowed: debug"),
    (["estimate", "--model", "tiny", "--tp", "3", "--gpus", "3"], "parallel.tp=3 does not divide model.n_heads=8"),
    (["estimate", "--model", "tiny", "--time", "--gpu", "tpu9"], "--gpu=tpu9: unknown GPU (allowed: a100-40g"),
    (["plan", "--model", "70b", "--gpus", "1", "--gpu", "l4"], "no layout of 70b fits 1 x l4"),
    (["plan", "--model", "tiny", "--gpus", "2", "--global-batch-tokens", "lots"], "--global-batch-tokens=lots"),
    (["plan", "--model", "tiny", "--cluster", "2xa100-80g,2xk80"], "--cluster=2xa100-80g,2xk80: k80: unknown GPU"),
    (["plan", "--model", "tiny", "--cluster", "two a100"], "expected COUNTxGPU, e.g. 8xa100-80g"),
    (["plan", "--model", "70b", "--cluster", "1xl4,1xv100"], "no layout of 70b fits 1xl4,1xv100"),
])
def test_planner_mistakes_are_one_line(args, expected, tmp_path):
    proc = run_cli(*args, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and expected in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- pipeline schedule tables


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_simulated_schedules_reach_the_closed_form_bubble(schedule, pp, m):
    """The table is built from each rank's order of work and the data dependencies alone; its idle
    share must equal the closed forms ((p−1)/(m+p−1), divided by v when interleaved)."""
    from disttrain.plan.schedule import simulate

    v = 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    grid, simulated = simulate(schedule, pp, m, 2)
    assert simulated == pytest.approx(bubble_fraction(schedule, pp, m, v), abs=1e-9)
    work_per_rank = m * v * 3  # F = 1 unit, backward = 2 (B + W under zero-bubble)
    for r in range(pp):
        assert sum(row[r] != "-" for row in grid) == work_per_rank


def test_show_schedule_prints_the_time_by_stage_table():
    out = run_cli("plan", "--show-schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b").stdout
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("Time")))
    assert lines[start].split() == ["Time", "GPU0", "GPU1", "GPU2", "GPU3"]
    assert lines[start + 1].split() == ["1", "F0", "-", "-", "-"]
    assert lines[start + 2].split() == ["2", "F1", "F0", "-", "-"]
    assert "bubble: 27.3% theory, 27.3% in this table" in out
    proc = run_cli("plan", "--show-schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved_1f1b",
                   check=False)
    assert proc.returncode == 2 and "--microbatches=6 must be a multiple of --pp=4" in proc.stderr


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_peak_activations_match_the_planner(recompute):
    """At the memory peak of a real step (torch's MemTracker on CPU tensors), activations + temporaries
    are within 20% of the planner's peak activations (saved + what backward adds)."""
    from disttrain.bench.activations import peak_activation_bytes
    from disttrain.plan.memory import stage_activation_bytes

    shape = MODEL_SHAPES["debug"]
    measured = peak_activation_bytes(shape, 4, 128, recompute)
    layout = Layout(micro_batch_size=4, global_batch_size=4, seq_len=128, activation_checkpointing=recompute,
                    param_dtype="fp32")
    predicted = stage_activation_bytes(shape, layout, 0, fused_norm=False).peak
    held = measured["activations"] + measured["temporary"]
    assert abs(predicted / held - 1) <= 0.2, (predicted, measured)


def test_hardware_profile_feeds_estimate(tmp_path):
    """`bench hardware` on 2 processes writes a profile whose rates are measured (positive, α-β fitted
    per collective from the points it lists); `estimate --time --hardware` then predicts from it: a step is
    its parts, the optimizer counts this rank's share, and a layout that issues more collectives
    (TP=2) pays for them at the measured link; ZeRO-3 gathers twice where ZeRO-2 gathers once."""
    out = tmp_path / "hw.json"
    run_cli("bench", "hardware", "--models", "debug", "--micro-batch", "2", "--seq-len", "32", "--out", str(out),
            timeout=300)
    profile = json.loads(out.read_text())
    assert profile["ranks"] == 2
    for fit in profile["collectives"].values():  # all-reduce, all-gather, reduce-scatter
        assert fit["ranks"] == 2 and len(fit["points"]) >= 5
        assert fit["bandwidth_gbs"] > 0 and fit["latency_s"] >= 0
    assert profile["matmul_flops"]["debug"]["fp32"] > 0 and profile["attention_flops"]["debug"] > 0
    assert profile["elementwise_bytes_per_s"] > 0 and profile["optimizer_s_per_param"] > 0
    assert profile["matmul_flops"]["debug"]["tp"]["2"]["fp32"] > 0  # a tensor-parallel rank's slices
    fsdp = profile["fsdp_round_trip"]["debug"]  # FSDP2's gather and reduce-scatter with their copies
    assert fsdp["ranks"] == 2 and fsdp["gather_s_per_byte"] > 0 and fsdp["reduce_s_per_byte"] > 0
    assert profile["tp_collective"]["debug"]["bytes"] == 4 * 2 * 32 * MODEL_SHAPES["debug"].dim

    def predict(*flags):
        proc = run_cli("estimate", "--model", "debug", "--gpus", "2", "--seq-len", "32", "--micro-batch-size", "2",
                       "--dtype", "fp32", "--time", "--hardware", str(out), "--json", *flags)
        return json.loads(proc.stdout)["time"]

    ddp, zero3, tp = predict("--zero-stage", "0"), predict("--zero-stage", "3"), predict("--tp", "2")
    zero2 = predict("--zero-stage", "2")
    assert zero3["dp_comm_s"] > zero2["dp_comm_s"] > 0  # stage 3 gathers again for backward
    for t in (ddp, zero3, tp):
        parts = t["compute_s"] + t["optimizer_s"] + t["bubble_s"] + t["tp_comm_s"] + t["pp_comm_s"] + t["dp_exposed_s"]
        assert t["step_s"] == pytest.approx(parts)
    psi = MODEL_SHAPES["debug"].num_params()
    assert ddp["optimizer_s"] == pytest.approx(psi * profile["optimizer_s_per_param"])
    assert zero3["optimizer_s"] == pytest.approx(ddp["optimizer_s"] / 2)  # each rank updates its shard
    assert zero3["dp_exposed_s"] == pytest.approx(zero3["dp_comm_s"])  # FSDP2 on a CPU: nothing overlapped
    assert tp["tp_comm_s"] > 0 and ddp["tp_comm_s"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--models", "gpt9"], "--models=gpt9: unknown model gpt9 (allowed: "),
    (["--seq-len", "0"], "--seq-len=0: must be at least 1"),
    (["--out", "/nonexistent/dir/hw.json"], "--out=/nonexistent/dir/hw.json: folder /nonexistent/dir does not exist"),
])
def test_bench_hardware_bad_input_is_one_line(argv, message):
    proc = run_cli("bench", "hardware", *argv, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith(f"disttrain: error: {message}"), proc.stderr


def test_estimate_with_a_missing_hardware_profile_is_one_line(tmp_path):
    proc = run_cli("estimate", "--model", "debug", "--time", "--hardware", str(tmp_path / "none.json"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--hardware={tmp_path / 'none.json'}: no such file" in proc.stderr
