"""The planner's step time under the post-training objectives, against FLOPs and collective times worked out by
hand here: a preference pair is two sequences through forward and backward, a frozen reference or teacher adds a
forward at its own shape (none for precomputed reference values), its parameters' gathers under ZeRO-3, and under
pipelines its own forward-only schedule (a bubble of (p-1)/v forwards, one transfer per micro-batch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.core.gpus import GPUS
from disttrain.layout.layout import Layout
from disttrain.models.shape import ModelShape
from disttrain.plan.estimate import estimate
from disttrain.plan.objective import ObjectiveTerms
from disttrain.plan.timing import Cluster, all_gather_s, p2p_s

SHAPE = ModelShape(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1000, ffn_hidden_dim=1376, max_seq_len=512)
SEQ, BATCH = 512, 8


def matmul_params(s: ModelShape) -> int:
    """Every weight a token multiplies by (the embedding is a lookup): per layer q, o (d x d), k, v (d x kv) and
    the three MLP matrices, two norm weights; the final norm and the untied output layer."""
    kv = s.n_kv_heads * (s.dim // s.n_heads)
    return s.n_layers * (2 * s.dim * s.dim + 2 * s.dim * kv + 3 * s.dim * s.ffn_hidden_dim + 2 * s.dim) \
        + s.dim + s.vocab_size * s.dim


def forward_flops(s: ModelShape, seq: int) -> float:
    """A forward per token: 2 per multiply-add of each weight, and the attention scores and weighted sum over the
    whole T x T matrix (2 x 2 x L x heads x head_dim x T)."""
    return 2 * matmul_params(s) + 4 * s.n_layers * s.n_heads * (s.dim // s.n_heads) * seq


def one_gpu(cluster_gpus: int = 1) -> Cluster:
    return Cluster(GPUS["h100"], gpus_per_node=cluster_gpus, nodes=1)


def rate(cluster: Cluster) -> float:
    return cluster.gpu.peak_flops("bf16") * cluster.compute_efficiency


def test_dpo_on_one_gpu_is_two_rows_trained_and_a_reference_forward():
    """One GPU, no collectives: the step is pure FLOPs. A pair of sequences of SEQ tokens each, BATCH pairs: forward
    and backward (3 forwards) of 2 x BATCH x SEQ tokens for the policy, one forward of them for the reference."""
    cluster, layout = one_gpu(), Layout(global_batch_size=BATCH, micro_batch_size=2, seq_len=SEQ)
    tokens = 2 * BATCH * SEQ
    policy = 3 * forward_flops(SHAPE, SEQ) * tokens / rate(cluster)
    reference = forward_flops(SHAPE, SEQ) * tokens / rate(cluster)

    dpo = estimate(SHAPE, layout, cluster, objective=ObjectiveTerms("dpo", 2, SHAPE)).time
    assert dpo.step_s == pytest.approx(policy + reference, rel=1e-12)
    assert dpo.frozen_compute_s == pytest.approx(reference, rel=1e-12)
    assert dpo.tokens_per_s == pytest.approx(tokens / (policy + reference), rel=1e-12)
    simpo = estimate(SHAPE, layout, cluster, objective=ObjectiveTerms("simpo", 2)).time  # no reference
    assert simpo.step_s == pytest.approx(policy, rel=1e-12) and simpo.frozen_s == 0
    precomputed = estimate(SHAPE, layout, cluster, objective=ObjectiveTerms("dpo", 2)).time  # values read back
    assert precomputed.step_s == pytest.approx(policy, rel=1e-12)
    lora = estimate(SHAPE, layout, cluster, objective=ObjectiveTerms("dpo", 2, forward=SHAPE)).time  # adapters off
    assert lora.step_s == pytest.approx(policy + reference, rel=1e-12)
    lm = estimate(SHAPE, layout, cluster).time
    assert lm.step_s == pytest.approx(policy / 2, rel=1e-12)
    assert dpo.mfu == pytest.approx(lm.mfu * lm.step_s * 2 / dpo.step_s, rel=1e-12)  # the policy's FLOPs only


def test_a_teachers_forward_scales_with_the_teachers_shape():
    """The teacher's term is a forward at its own shape: wider and deeper teachers cost what their FLOPs say."""
    cluster, layout = one_gpu(), Layout(global_batch_size=BATCH, micro_batch_size=2, seq_len=SEQ)
    lm = estimate(SHAPE, layout, cluster).time.step_s
    for teacher in (SHAPE, replace(SHAPE, n_layers=12), replace(SHAPE, dim=1024, ffn_hidden_dim=2752, n_heads=16)):
        t = estimate(SHAPE, layout, cluster, objective=ObjectiveTerms("distill", 1, teacher)).time
        expected = forward_flops(teacher, SEQ) * BATCH * SEQ / rate(cluster)
        assert t.frozen_s == pytest.approx(expected, rel=1e-12)
        assert t.step_s - lm == pytest.approx(expected, rel=1e-9)


def test_zero3_gathers_the_frozen_model_every_micro_batch():
    """Two GPUs under ZeRO-3, a frozen copy's parameters (blocks and root) gathered once per micro-batch; the LoRA
    reference (the policy with its adapters off) gathers the blocks again, its root stays gathered for the policy."""
    cluster = one_gpu(2)
    layout = Layout(dp_shard=2, zero_stage=3, global_batch_size=BATCH, micro_batch_size=2, seq_len=SEQ)
    m = 2  # 8 pairs over 2 ranks, 2 a micro-batch
    bw, lat = cluster.link(2, "all_gather")
    kv = SHAPE.n_kv_heads * (SHAPE.dim // SHAPE.n_heads)
    block = SHAPE.n_layers * (2 * SHAPE.dim ** 2 + 2 * SHAPE.dim * kv + 3 * SHAPE.dim * SHAPE.ffn_hidden_dim
                              + 2 * SHAPE.dim)
    root = 2 * SHAPE.vocab_size * SHAPE.dim + SHAPE.dim
    from disttrain.plan.frozen_time import frozen_forward_time

    args = dict(peak=cluster.gpu.peak_flops("bf16"), rate=0.0, teacher_head=False)
    pairs = layout.replace(global_batch_size=2 * BATCH, micro_batch_size=4)
    copy = frozen_forward_time(SHAPE, pairs, cluster, own_copy=True, **args)
    assert copy.gather_s == pytest.approx(m * all_gather_s(2, 2 * (block + root), bw, lat), rel=1e-12)
    lora = frozen_forward_time(SHAPE, pairs, cluster, own_copy=False, **args)
    assert lora.gather_s == pytest.approx(m * all_gather_s(2, 2 * block, bw, lat), rel=1e-12)
    ddp = frozen_forward_time(SHAPE, pairs.replace(zero_stage=0), cluster, own_copy=True, **args)
    assert ddp.gather_s == 0 and ddp.comm_s == 0


def test_a_pipelined_frozen_model_runs_its_own_forward_schedule():
    """pp=2, 4 micro-batches of 2 pairs (4 sequences): the reference's forwards on a rank take half its FLOPs, its
    fill and drain one micro-batch's forward more ((p-1)/m of them), and each micro-batch sends its hidden states
    once (no gradients come back)."""
    cluster = one_gpu(2)
    layout = Layout(pp=2, pp_schedule="gpipe", global_batch_size=BATCH, micro_batch_size=2, seq_len=SEQ)
    t = estimate(SHAPE, layout, cluster, objective=ObjectiveTerms("dpo", 2, SHAPE)).time
    compute = forward_flops(SHAPE, SEQ) * 2 * BATCH * SEQ / 2 / rate(cluster)
    bw, lat = cluster.link(2)
    transfers = 4 * p2p_s(2 * 4 * SEQ * SHAPE.dim, bw, lat)
    assert t.frozen_compute_s == pytest.approx(compute, rel=1e-12)
    assert t.frozen_s == pytest.approx(compute * (1 + 1 / 4) + transfers, rel=1e-12)


def test_plan_and_estimate_take_the_objective_from_flags(tmp_path):
    """`disttrain plan --objective`: every ranked layout's step has the reference's forward, the written config
    names the objective; `estimate --objective distill --teacher SHAPE` times the teacher; what is missing or does
    not go together is refused in one line."""
    import json

    import yaml

    from helpers import run_main

    common = ("--model", "tiny", "--gpus", "2", "--seq-len", "256", "--global-batch-size", "8")
    code, out, err = run_main("plan", *common, "--objective", "dpo", "--json", "--out", str(tmp_path / "w.yaml"))
    assert code == 0, err
    plan = json.loads(out)
    assert all(e["time"]["frozen_s"] > 0 for e in plan["top"]), plan["top"]
    assert plan["winner"]["tokens_per_step"] == 2 * 8 * 256
    written = yaml.safe_load((tmp_path / "w.yaml").read_text())
    assert written["train"]["objective"] == "dpo" and "dpo" not in written, written
    code, out, err = run_main("plan", *common, "--objective", "dpo", "--precompute-reference", "--json")
    assert code == 0 and all(e["time"]["frozen_s"] == 0 for e in json.loads(out)["top"]), err

    est = ("estimate", "--model", "tiny", "--gpus", "1", "--seq-len", "256", "--global-batch-size", "8", "--time",
           "--json")
    times = {}
    for teacher in ("tiny", "125m"):
        code, out, err = run_main(*est, "--objective", "distill", "--teacher", teacher)
        assert code == 0, err
        times[teacher] = json.loads(out)["time"]["frozen_compute_s"]
    from disttrain.models import flops as F
    from disttrain.models.registry import MODEL_SHAPES

    ratio = F.model_flops_per_token(MODEL_SHAPES["125m"], 256) / F.model_flops_per_token(MODEL_SHAPES["tiny"], 256)
    assert times["125m"] / times["tiny"] == pytest.approx(ratio, rel=1e-12)

    for args, needle in ((("--objective", "distill"), "--objective=distill: --teacher is required"),
                         (("--objective", "simpo", "--precompute-reference"), "--precompute-reference goes with"),
                         (("--teacher", "tiny"), "go with --objective")):
        code, _, err = run_main(*est, *args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_main("plan", "--model", "tiny", "--cluster", "2xa100-80g", "--objective", "dpo")
    assert code == 2 and "with --cluster" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_main("plan", *common, "--objective", "distill", "--teacher", "tiny", "--verify", "1")
    assert code == 2 and "--verify with --objective=distill" in err and len(err.strip().splitlines()) == 1, err
