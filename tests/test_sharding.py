"""Sharded data parallel (ZeRO 1-3, HSDP, offload, activation checkpointing): parity in fp64 to 1e-10, memory,
resharding."""

from __future__ import annotations


import pytest
import torch

from disttrain.models.registry import MODEL_SHAPES
from helpers import PARITY, REPO, assert_parity, final_params, losses, train, train_many
from workers import model_states, probes

SHARDED = ("train.micro_batch_size=1", "checkpoint.every_steps=10")  # 2 micro-batches per rank on 2 ranks
# A job of the loop that writes, after the last step, how the run's FSDP units were built (tests/workers/probes.py)
WRAPPER_PROBE = f"train.callbacks=[{REPO / 'tests' / 'workers' / 'probes.py'}:WrapperProbe]"
LAYOUTS = {
    "zero3": ("parallel.zero_stage=3", WRAPPER_PROBE),
    "zero1": ("parallel.zero_stage=1",),
    "zero2 + selective recompute": ("parallel.zero_stage=2", "parallel.activation_checkpointing=selective"),
    "zero3 + full recompute": ("parallel.zero_stage=3", "parallel.activation_checkpointing=full"),
    "zero3 + cpu offload": ("parallel.zero_stage=3", "parallel.cpu_offload=true", WRAPPER_PROBE),
    # each micro-batch's gradients reduce-scattered into the host's sharded ones (parallel.gradient_accumulation)
    "zero2 + offload, sharded accumulation": ("parallel.zero_stage=2", "parallel.cpu_offload=true",
                                              "parallel.gradient_accumulation=sharded"),
    "hsdp 2x1": ("parallel.zero_stage=3", "parallel.dp_replicate=2", "parallel.dp_shard=1"),
    # two micro-batches a rank, each reduced across the replicas too (4 ranks would leave one micro-batch each)
    "hsdp 2x1, sharded accumulation": ("parallel.zero_stage=3", "parallel.dp_replicate=2", "parallel.dp_shard=1",
                                       "parallel.gradient_accumulation=sharded"),
    "zero2 bf16 params": ("parallel.zero_stage=2", "precision.compute_dtype=fp32", "precision.param_dtype=bf16",
                          "precision.reduce_dtype=fp32"),  # against the fp32 reference: what users run
}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Every 2-rank layout of this module, and the model-state measurement of ZeRO stages 0-3 on 2 ranks
    (tests/workers/model_states.py), in one launch of 2 real processes."""
    root = tmp_path_factory.mktemp("two")
    jobs = {name: (root / name.replace(" ", "_"), (*PARITY, *SHARDED, *extra)) for name, extra in LAYOUTS.items()}
    return train_many({**jobs, "model states": model_states.job(root / "states")}, nproc=2)


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory, two_rank_runs):
    """Global batch 4 on 4 ranks (one sequence each): ZeRO-3, HSDP 2x2 (shards within pairs, replicates
    across them), ZeRO-3 resumed from the 2-rank ZeRO-3 checkpoint of step 10, and the model-state
    measurement on 4 ranks; one launch."""
    root = tmp_path_factory.mktemp("four")
    ckpt = two_rank_runs["zero3"] / "checkpoints" / "step_00000010"
    return train_many({
        "zero3": (root / "zero3", (*PARITY, "parallel.zero_stage=3")),
        "hsdp 2x2": (root / "hsdp", (*PARITY, "parallel.zero_stage=3", "parallel.dp_replicate=2",
                                     "parallel.dp_shard=2")),
        "resumed": (root / "resumed", (*PARITY, "parallel.zero_stage=3", f"checkpoint.resume={ckpt}")),
        "model states": model_states.job(root / "states"),
    }, nproc=4)


@pytest.fixture(scope="module")
def model_state_rows(two_rank_runs, four_rank_runs, tmp_path_factory):
    """nproc -> every rank's model-state rows at ZeRO stages 0-3; one process through the benchmarks' own
    launcher (`disttrain.bench.model_states.launch`, torchrun running the module), which this keeps tested."""
    from disttrain.bench.model_states import launch

    return {1: launch(1, tmp_path_factory.mktemp("one")), 2: model_states.rows(two_rank_runs["model states"]),
            4: model_states.rows(four_rank_runs["model states"])}


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "zero2 bf16 params"])
def test_two_rank_layouts_match_single_process(layout, two_rank_runs, debug_reference):
    assert_parity(two_rank_runs[layout], debug_reference)


@pytest.mark.parametrize("layout", ["zero3", "hsdp 2x2"])
def test_four_rank_layouts_match_single_process(layout, four_rank_runs, debug_reference):
    assert_parity(four_rank_runs[layout], debug_reference)


def test_cpu_offload_reaches_every_fsdp_unit(two_rank_runs):
    """parallel.cpu_offload=true (its parity is above) reached FSDP2, read inside the run by a job of its loop:
    every unit (each block and the root) holds a CPUOffloadPolicy and every one of its parameters is marked to
    offload, unpinned (pinning needs an accelerator); the same ZeRO-3 run without it has the default policy. On
    this CPU-only machine the shards live on the CPU either way: the policy is what tells the two apart."""
    units = MODEL_SHAPES["debug"].n_layers + 1
    for rank in (0, 1):
        offloaded = probes.read(two_rank_runs["zero3 + cpu offload"], "wrapper", rank)
        assert offloaded == {"wrapper": "FSDPTransformer", "fsdp": {
            "units": units, "offload_policies": ["CPUOffloadPolicy"], "cpu_offload": [True],
            "params_offload_to_cpu": [True], "pin_memory": [False], "shard_devices": ["cpu"]}}, offloaded
        kept = probes.read(two_rank_runs["zero3"], "wrapper", rank)["fsdp"]
        assert (kept["units"], kept["offload_policies"], kept["params_offload_to_cpu"]) == \
            (units, ["OffloadPolicy"], [False]), kept


def test_stage3_checkpoint_resumes_on_other_layouts(two_rank_runs, four_rank_runs, tmp_path):
    """Saved by ZeRO-3 on 2 ranks; resumed by a single process and by ZeRO-3 on 4 ranks: steps 11-20 give the
    uninterrupted run's losses, gradient norms and learning rates, and its final parameters, to EXACT (fp64)."""
    run = two_rank_runs["zero3"]
    single = train(tmp_path / "single", *PARITY, f"checkpoint.resume={run / 'checkpoints' / 'step_00000010'}")
    assert_parity(single, run, after=10)
    assert_parity(four_rank_runs["resumed"], run, after=10)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_model_state_bytes_match_the_planner(nproc, model_state_rows):
    """What each rank allocates for parameters, gradients and Adam states at ZeRO stages 0-3 equals
    the planner's runtime accounting (`disttrain estimate`), within 5% (ZeRO-1 assigns whole
    tensors to ranks, so its optimizer shards are only roughly even)."""
    from disttrain.layout.layout import Layout
    from disttrain.plan.memory import model_state_bytes

    shape = MODEL_SHAPES["tiny"]
    psi = shape.num_params()
    root = 2 * shape.vocab_size * shape.dim + shape.dim  # embeddings, output, final norm
    rows = model_state_rows[nproc]
    assert len(rows) == 4 * nproc
    for row in rows:
        stage = row["stage"]
        assert row["micro_batches"] >= 2, row  # the engine's step accumulates on every rank, so it is measured
        layout = Layout(dp_shard=nproc, zero_stage=stage, param_dtype="fp32",  # CPU: fp32 (param_dtype auto)
                        global_batch_size=row["micro_batches"] * nproc)
        predicted = model_state_bytes(psi, layout, "runtime")
        for key in ("params", "grads", "optimizer"):
            assert row[key] == pytest.approx(getattr(predicted, key), rel=0.05), (row, key, predicted)
        # Between forward and backward: stage <= 2 holds every parameter whole; stage 3 only the
        # root module's (kept gathered for backward) plus the blocks' shards.
        gathered = 4 * psi if stage <= 2 else 4 * ((psi - root) / nproc + root)
        assert row["params_after_forward"] == pytest.approx(gathered, rel=0.05), row
        # Accumulating micro-batches: FSDP (stages 2-3) holds every parameter's gradient unsharded, fp32;
        # DDP accumulates into its buckets (the gradients above) and holds nothing beside them.
        assert predicted.unsharded_grads == (4 * psi if stage >= 2 else 0)
        assert row["unsharded_grads"] == predicted.unsharded_grads, row


def test_activation_checkpointing_recomputes():
    """Count ops over one forward+backward: SiLU runs once per block forward (so it counts block
    forwards, recomputations included); matmuls show whether recomputation redoes them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from disttrain.models.llama import llama_spec
    from disttrain.models.spec import build_model
    from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.silu = self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.silu += func is torch.ops.aten.silu.default
            self.mm += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    x = torch.randint(0, 256, (2, 16))
    counts, grads = {}, {}
    for mode in ("none", "full", "selective"):
        model = build_model(llama_spec(MODEL_SHAPES["debug"]), torch.device("cpu"), seed=0)
        apply_activation_checkpointing(model.layers, mode)
        with CountOps() as ops:
            model(x).float().logsumexp(-1).mean().backward()
        counts[mode] = ops
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    blocks = MODEL_SHAPES["debug"].n_layers
    assert counts["none"].silu == blocks
    assert counts["full"].silu == 2 * blocks and counts["selective"].silu == 2 * blocks  # each block re-runs
    assert counts["full"].mm > counts["none"].mm  # full recomputation redoes the matmuls in backward
    assert counts["selective"].mm == counts["none"].mm  # selective saved them
    for mode in ("full", "selective"):
        for a, b in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # recomputation is exact


def test_bf16_param_policy_keeps_fp32_master_weights(two_rank_runs, debug_reference_fp32):
    ref, low = losses(debug_reference_fp32), losses(two_rank_runs["zero2 bf16 params"])
    diffs = [abs(low[s] - ref[s]) / ref[s] for s in ref]
    # bf16 compute really ran (not bitwise fp32) and stays within half of bf16's unit roundoff (2^-8).
    assert 0 < max(diffs) <= 2e-3, diffs
    params = final_params(two_rank_runs["zero2 bf16 params"])
    assert all(t.dtype == torch.float32 for t in params.values())  # the sharded master copy stays fp32
