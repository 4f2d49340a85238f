"""Mixture of experts: the layer on one device (grouped GEMM against the per-expert loop, tied scores under
activation checkpointing, the balancing loss's gradient, evaluation, capacity, padding), the export of the
built-in family as transformers' Qwen2-MoE, the config's refusals, and
expert parallelism, with context parallelism too, against one process (fp64 at 1e-10: losses, every
parameter, the balancing bias, tokens per expert) plus a checkpoint saved at ep=2 resumed on one process
and at ep=4 over dp_shard=2 x cp=2 (fp32, 1e-5)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from disttrain.config.load import load_config
from disttrain.core.errors import UserError
from disttrain.models.moe import MoEFeedForward, MoERouting
from disttrain.models.moe.experts import GroupedExperts
from disttrain.models.registry import model_spec
from disttrain.models.spec import build_model
from disttrain.config.resolve import resolve_run
from hf_models import save_tiny
from helpers import (EXACT, FP64, LR, SMALL_CHUNKS, WHOLE_LOGITS, assert_losses_close, assert_params_close,
                     assert_params_exact, final_params, losses, records, run_main, train_many)

STEPS = 3  # the bias moves twice before the last step; the resumed runs compare one step after step 2
COMMON = (f"train.steps={STEPS}", "train.global_batch_size=4", "model.name=debug-moe", "checkpoint.save_final=true",
          "metrics.sync_check_every=2", "model.moe.aux_loss_coef=0.01", "model.moe.bias_update_rate=0.001",
          SMALL_CHUNKS)


def _layer(routing=MoERouting(), experts=8, top_k=2, scoring="softmax", dtype=torch.float64) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(16, experts, top_k, 8, 0, scoring, routing)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    layer.router.reset_buffers()
    return layer.to(dtype)


def test_grouped_gemm_matches_the_per_expert_loop():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    rows = torch.randn(11, 16, requires_grad=True)
    counts = torch.tensor([3, 0, 6, 2])
    upstream = torch.randn(11, 16)
    results = []
    for grouped in (True, False):
        experts.grouped_gemm = grouped
        out = experts(rows, counts)
        grads = torch.autograd.grad(out, [rows, *experts.parameters()], upstream)
        results.append((out, grads))
    (a, ga), (b, gb) = results
    # fp32 sums in another order: each element within 1e-6 of its tensor's largest magnitude (an element-wise
    # relative bound fails on elements that nearly cancel, 40 seeds measured: at most 4.7e-8 of the largest)
    for x, y in zip((a, *ga), (b, *gb)):
        assert (x - y).abs().max() <= 1e-6 * y.abs().max()


def test_grouped_gemm_runs_in_the_autocast_dtype():
    """grouped_mm is on no autocast list: under bf16 autocast the experts cast as F.linear would, so the grouped
    path computes in bf16 (what the planner counts) and equals the per-expert loop, which autocast casts itself."""
    experts = GroupedExperts(4, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    rows, counts = torch.randn(11, 16), torch.tensor([3, 0, 6, 2])
    outs = []
    for grouped in (True, False):
        experts.grouped_gemm = grouped
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(experts(rows, counts))
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_transformers_experts_run_in_the_autocast_dtype():
    """transformers' fused experts (models/hf/moe.py) cast under autocast as the built-in ones do: bf16 rows and
    weights, equal to a per-expert F.linear loop that autocast casts itself, the weights cast once per step."""
    from transformers import AutoModelForCausalLM

    from disttrain.models.hf.moe import hf_moe_layers
    from hf_models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    layer = next(iter(hf_moe_layers(model, MoERouting()).values()))
    experts = layer.experts
    rows, counts = torch.randn(13, 64), torch.tensor([3, 0, 6, 2, 0, 1, 1, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer.compute_experts(rows, counts, None)
        again = layer.compute_experts(rows, counts, None)
        expected = []
        for e, x in enumerate(torch.split(rows, counts.tolist())):
            gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            expected.append(torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e]))
    assert out.dtype == torch.bfloat16 and layer.autocast_weights.entry[1][0].dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.cat(expected), rtol=0, atol=0)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    layer.finish_step(updated=True)
    assert layer.autocast_weights.entry is None


def test_autocast_copies_are_made_once_for_all_micro_batches():
    """Like autocast's cache for F.linear: the experts' bf16 weights are cast once and shared by every
    micro-batch's graph until the optimizer step, with the gradients of a cast per micro-batch; under
    activation checkpointing every call casts (no copy outlives a checkpointed forward)."""
    experts = GroupedExperts(4, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    batches = [(torch.randn(11, 16), torch.tensor([3, 0, 6, 2])), (torch.randn(7, 16), torch.tensor([1, 2, 2, 2]))]

    def grads(shared: bool):
        experts.zero_grad(set_to_none=True)
        copies = set()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = []
            for rows, counts in batches:
                if not shared:
                    experts.release_compute_copies()
                outs.append(experts(rows, counts))
                copies.add(experts.compute_copies[1][0])
        for out in outs:  # separate backwards, as a pipeline's micro-batches
            out.float().square().sum().backward()
        experts.release_compute_copies()
        return len(copies), [p.grad for p in experts.parameters()]

    (once, shared), (each, separate) = grads(True), grads(False)
    assert (once, each) == (1, 2)
    for a, b in zip(shared, separate):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        checkpoint(experts, *batches[0], use_reentrant=False).float().sum().backward()
    assert experts.compute_copies is None


def test_tied_scores_route_the_same_under_recomputation():
    """A zero router ties every score: the lowest expert indices win, in the forward and in activation
    checkpointing's recompute, whose gradients equal the plain run's; the step counts each token once."""
    layer = _layer(MoERouting(aux_loss_coef=0.1))
    torch.nn.init.zeros_(layer.router.gate.weight)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    weights, experts, _ = layer.router(x.reshape(-1, 16))
    assert experts.tolist() == [[0, 1]] * 10
    grads = []
    for recompute in (False, True):
        out = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        grads.append(torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
        layer.finish_step(updated=False)
        assert layer.step_summary()["tokens_per_expert"] == [10, 10, 0, 0, 0, 0, 0, 0]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_balancing_loss_gradient_is_the_switch_loss():
    """The attached gradient equals autograd of coef * E * sum_e f_e * P_e over the batch (f detached)."""
    coef, e = 0.5, 8
    layer = _layer(MoERouting(aux_loss_coef=coef), scoring="sigmoid")
    x = torch.randn(12, 16, dtype=torch.float64)
    out = layer(x)
    (with_aux,) = torch.autograd.grad(out.sum(), [layer.router.gate.weight])
    layer.eval()
    (without,) = torch.autograd.grad(layer(x).sum(), [layer.router.gate.weight])
    _, experts, probs = layer.router(x)
    load = torch.bincount(experts.reshape(-1), minlength=e).double() / experts.numel()
    (reference,) = torch.autograd.grad(coef * e * (load * probs.mean(0)).sum(), [layer.router.gate.weight])
    torch.testing.assert_close(with_aux - without, reference, rtol=1e-12, atol=1e-15)
    layer.train()
    layer.finish_step(updated=True)
    assert layer.step_summary()["aux_loss"] == pytest.approx(float(coef * e * (load * probs.detach().mean(0)).sum()), rel=1e-12)


def test_evaluation_counts_nothing_and_leaves_the_bias():
    layer = _layer(MoERouting(bias_update_rate=0.1))
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(8, 16, dtype=torch.float64))
    layer.finish_step(updated=True)
    assert layer.step_summary() is None and not layer.router.expert_bias.any()
    layer.train()
    layer(torch.randn(8, 16, dtype=torch.float64))
    layer.finish_step(updated=True)
    counts = torch.tensor(layer.step_summary()["tokens_per_expert"], dtype=torch.float64)
    expected = 0.1 * torch.sign(counts.mean() - counts)
    assert torch.equal(layer.router.expert_bias, expected)


def test_padding_reaches_no_expert():
    """Padding (an end token right after an end token: how chat data pads) is left out of the routing: the
    other rows' outputs, every gradient (the balancing loss's included), the loads and the bias move equal
    those of a batch holding the other rows alone, and padding rows get zeros (fp64)."""
    from disttrain.models.moe.padding import padding

    tokens = torch.tensor([[5, 7, 3, 3, 3, 3], [9, 3, 4, 8, 3, 3]])  # 3: the end token; row 1 packs two documents
    pad = padding(tokens, 3)
    assert pad.tolist() == [[False, False, False, True, True, True], [False] * 5 + [True]]
    keep = (~pad).reshape(-1).nonzero().squeeze(1)
    layer = _layer(MoERouting(aux_loss_coef=0.1, bias_update_rate=0.1))
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    results = []
    for padded in (True, False):
        inp = (x if padded else x.reshape(-1, 16)[keep]).clone().requires_grad_()
        layer.routed_rows, layer.routed_rows_of = (keep, 12) if padded else (None, 0)
        out = layer(inp)
        grads = torch.autograd.grad(out.square().sum(), [inp, *layer.parameters()])
        layer.finish_step(updated=True)
        flat = out.reshape(-1, 16)
        results.append((flat[keep] if padded else flat, grads[0].reshape(-1, 16)[keep] if padded else grads[0],
                        grads[1:], layer.step_summary(), layer.router.expert_bias.clone()))
        if padded:
            assert not flat[pad.reshape(-1)].any()
        layer.router.reset_buffers()
    (out_a, gx_a, g_a, sum_a, bias_a), (out_b, gx_b, g_b, sum_b, bias_b) = results
    assert sum(sum_a["tokens_per_expert"]) == 2 * len(keep) and sum_a == sum_b and bias_a.any()
    torch.testing.assert_close(out_a, out_b, rtol=1e-12, atol=0)
    torch.testing.assert_close(gx_a, gx_b, rtol=1e-12, atol=0)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert torch.equal(bias_a, bias_b)


def test_capacity_drops_overflow_and_reports_it():
    layer = _layer(MoERouting(capacity_factor=1.0), experts=4, top_k=1)
    torch.nn.init.zeros_(layer.router.gate.weight)  # every token to expert 0; its capacity is 12 / 4 = 3
    x = torch.randn(12, 16, dtype=torch.float64)
    out = layer(x)
    layer.finish_step(updated=False)
    assert layer.step_summary()["dropped_tokens"] == 9
    assert out[:3].abs().sum() > 0 and not out[3:].any()  # the first three tokens in order keep their expert


def test_model_counts_its_parameters():
    cfg = load_config(None, ["model.name=debug-moe", "model.moe.first_k_dense_replace=1", "model.moe.scoring_func=sigmoid"])
    spec = model_spec(cfg.model)
    model = build_model(spec, torch.device("cpu"), 0)
    assert sum(p.numel() for p in model.parameters()) == spec.shape.num_params()
    assert list(spec.moe_layers(model)) == ["layers.1.feed_forward"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "qwen3_next", "gpt_oss"])
def test_hf_moe_through_our_dispatch_equals_transformers(tmp_path, kind):
    """disttrain's dispatch on transformers' fused experts gives transformers' own logits and gradients (gpt-oss:
    transposed experts with biases and its clamped SwiGLU; DeepSeek-V3 and GLM: a dense first layer); a saved
    checkpoint (one matrix per expert) loads as transformers loads it."""
    from transformers import AutoModelForCausalLM

    from disttrain.models.hf.spec import hf_spec

    spec = hf_spec(str(save_tiny(kind, tmp_path / kind, weights_seed=1)))
    model = build_model(spec, torch.device("cpu"), 0, torch.float64)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / kind, local_files_only=True).state_dict()
    assert all(torch.equal(t.double(), model.state_dict()[name]) for name, t in theirs.items())
    model.set_experts_implementation("eager")  # transformers' per-expert loop (its grouped_mm refuses float64)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for ours in (False, True):
        if ours:
            blocks = [m for m in model.modules() if hasattr(getattr(m, "experts", None), "gate_up_proj")]
            assert len(spec.moe_layers(model)) == len(blocks) > 0  # installs the dispatch
        logits = model(tokens).logits
        results.append((logits, torch.autograd.grad(logits.square().mean(), list(model.parameters()))))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-14)


def test_builtin_moe_exports_as_qwen2_moe_with_equal_logits(tmp_path):
    """`--to hf` of the built-in family (a leading dense block, shared and routed experts): transformers'
    Qwen2-MoE loads it and gives the same logits; the names map back to the same parameters; sigmoid
    scoring is refused in one line."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from disttrain.models.llama import moe_hf_names as hf_names

    overrides = ["model.name=debug-moe", "model.moe.first_k_dense_replace=1", "model.n_layers=3"]
    spec = model_spec(load_config(None, overrides).model)
    model = build_model(spec, torch.device("cpu"), 0, torch.float64)
    state = model.state_dict()
    hf_state = spec.to_hf(state)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(spec.hf_config()))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float64)
    theirs.set_experts_implementation("eager")  # transformers' grouped_mm refuses float64
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = theirs(tokens).logits, model(tokens)
    # transformers' Qwen2-MoE takes its RMSNorm and router softmax in float32 even in a float64 model: the
    # logits agree to float32 rounding (measured 5.5e-8 at most), not to float64's; a wrong mapping (a swapped
    # w1/w3, the shared expert's scale, a dense layer routed) moves them by their own size
    assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    back = spec.from_hf(hf_state)
    assert back.keys() == {k for k in state if not k.endswith("expert_bias")}
    assert all(torch.equal(back[k], state[k]) for k in back)
    sigmoid = model_spec(load_config(None, [*overrides, "model.moe.scoring_func=sigmoid"]).model)
    with pytest.raises(UserError, match="model.moe.scoring_func=sigmoid has no transformers family"):
        sigmoid.hf_config()
    assert hf_names.hf_config(spec.shape)["mlp_only_layers"] == [0]


@pytest.mark.parametrize("overrides, message", [
    (("parallel.ep=3",), "parallel.ep=3 does not divide model.moe.num_experts=8"),
    (("parallel.ep=4", "model.moe.num_experts=4"), "parallel.ep=4 does not divide the data-parallel degree"),
    (("model.name=debug", "parallel.ep=2"), "parallel.ep=2 on a dense model"),
    (("model.moe.num_experts_per_tok=9",), "model.moe.num_experts_per_tok=9 exceeds model.moe.num_experts=8"),
    (("model.moe.capacity_factor=0.5",), "model.moe.capacity_factor=0.5: below 1 drops tokens"),
    (("parallel.ep=2", "engine=deepspeed"), "parallel.ep=2 with engine=deepspeed"),
    (("model.name=debug", "parallel.ep=2", "model.moe.num_experts=4"), "model.name=debug is dense; an MoE needs"),
    (("parallel.ep=4", "parallel.cp=2", "parallel.dp_shard=1"),
     "parallel.ep=4 does not divide parallel.dp_shard x parallel.cp = 1 x 2"),
])
def test_bad_moe_config_is_one_line(overrides, message):
    with pytest.raises(UserError) as err:
        resolve_run(load_config(None, ["model.name=debug-moe", *overrides]), 2, "cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


def _counts(run) -> list:
    return [r["moe_tokens_per_expert"] for r in records(run) if "moe_tokens_per_expert" in r]


def _routing_scalars(run) -> dict:
    """(step, key) -> each logged routing scalar: aux loss, router entropy, load imbalance, dropped tokens."""
    return {(r["step"], k): v for r in records(run) if "moe_tokens_per_expert" in r
            for k, v in r.items() if k.startswith("moe_") and k != "moe_tokens_per_expert"}


def _chat_data(root):
    """Chat data with one conversation per sequence of 128 (padded with the end token); how many tokens of
    the training split are not padding, read from its conversation ends (each cut to a row's 128 inputs)."""
    import numpy as np

    from chat_tokenizer import prepare, records, save_chat_tokenizer

    code, _, err = prepare(root, records(), save_chat_tokenizer(root / "tok"), "--seq-len", "128",
                           "--val-fraction", "0")
    assert code == 0, err
    ends = np.load(root / "out" / "train.ends.npy")
    lengths = np.diff(np.concatenate([[0], ends]))
    return root / "out", len(ends), int(np.minimum(lengths, 128).sum())


def test_expert_parallel_equals_one_process(tmp_path):
    """ep=2 on 2 ranks under DDP (with selective activation checkpointing, and without a balancing loss),
    ZeRO-1, ZeRO-2 with selective checkpointing, and ZeRO-3 with full over the context pair (cp=2, dp_shard=1: ep
    borrows the context ranks); transformers' Qwen3-MoE (DDP) and Mixtral (ZeRO-3, full checkpointing)
    through disttrain's dispatch; padded chat data (DDP), whose padding reaches no expert; on 4 ranks ZeRO-3
    with dp_shard=4 and selective checkpointing, pipeline pp=2 (GPipe), tensor parallel tp=2 (attention and
    shared experts split, routed experts whole), HSDP (2 x 2), and dp_shard=2 x cp=2 (ZeRO-2, document
    masking: ep over each context pair, experts sharded over the data-parallel pair) and ZeRO-1 (expert states
    on 2 ranks each), each with ep=2: one
    process's losses, parameters, balancing bias (a buffer in the checkpoint) and tokens per expert in fp64;
    then an fp32 run saved at ep=2 resumes on one process and at ep=4 on 4 ranks (dp_shard=2 x cp=2: experts
    split over data and context ranks) with an uninterrupted run's losses, and one saved at ep=2 under ZeRO-1
    on one process, and the ZeRO-3 one under ZeRO-1 on 4 ranks, with the losses and parameters after the
    resumed step (the optimizer states reshard)."""
    fp32 = ("optim.schedule=constant", "optim.warmup_steps=0")
    chat, conversations, real_tokens = _chat_data(tmp_path / "chat")
    jobs = {
        "ddp_selective": ("parallel.ep=2", "parallel.zero_stage=0", "parallel.activation_checkpointing=selective"),
        # ZeRO-3 with full checkpointing, ep=2 borrowing the context ranks (dp_shard=1, cp=2)
        "cp2_zero3_full": ("parallel.ep=2", "parallel.cp=2", "parallel.zero_stage=3",
                           "parallel.activation_checkpointing=full"),
        "zero2_selective": ("parallel.ep=2", "parallel.zero_stage=2", "parallel.activation_checkpointing=selective"),
        "save32": ("parallel.ep=2", "parallel.zero_stage=3", *fp32, "train.steps=2"),
        # ZeRO-1: dense optimizer states split over the ranks, expert states beside them (parallel/zero1.py)
        "zero1": ("parallel.ep=2", "parallel.zero_stage=1"),
        "save32_zero1": ("parallel.ep=2", "parallel.zero_stage=1", *fp32, "train.steps=2"),
        # no balancing loss: the routing statistics are reduced once per step, after the optimizer step
        "ddp_noaux": ("parallel.ep=2", "parallel.zero_stage=0", "model.moe.aux_loss_coef=0"),
        # every conversation in each step, padded to 128 tokens: the loads count its real tokens only; no
        # balancing bias, so that `convert --to hf` can write it as Qwen2-MoE (below), nor loss: the routing
        # statistics are reduced only when a logging step reads them
        "chat": ("parallel.ep=2", "parallel.zero_stage=0", "model.moe.bias_update_rate=0",
                 "model.moe.aux_loss_coef=0"),
    }
    chat_data = (f"data.source={chat}", "model.vocab_size=384", "data.seq_len=128",
                 f"train.global_batch_size={conversations}")
    hf = {kind: (f"model.hf={save_tiny(kind, tmp_path / kind)}", f"train.steps={STEPS}", "train.global_batch_size=4",
                 "checkpoint.save_final=true", "model.moe.aux_loss_coef=0.01", FP64, SMALL_CHUNKS)
          for kind in ("qwen3_moe", "mixtral")}
    jobs = {name: (*COMMON, *(() if name.startswith("save32") else (FP64,)), *(chat_data if name == "chat" else ()), *o)
            for name, o in jobs.items()}
    jobs.update({"hf_qwen3_moe": (*hf["qwen3_moe"], "parallel.ep=2", "parallel.zero_stage=0"),
                 "hf_mixtral": (*hf["mixtral"], "parallel.ep=2", "parallel.zero_stage=3",
                                "parallel.activation_checkpointing=full"),
                 # ZeRO-1's states: each dense one on one rank, each expert shard's on its rank (workers/)
                 "zero1_states": {"call": "zero1_experts:check"}})
    runs = train_many({name: o if isinstance(o, dict) else (tmp_path / name, o) for name, o in jobs.items()}, nproc=2)
    # 4 ranks (one sequence each): experts' gradients reduced over 2 ranks holding the same experts; 2 stages
    four = (*COMMON, FP64, "parallel.ep=2", "parallel.zero_stage=3")
    shutil.copytree(runs["save32"], tmp_path / "resume32_ep4")  # the same checkpoint, resumed at ep=4 on 4 ranks
    shutil.copytree(runs["save32"], tmp_path / "resume32_to_zero1")  # and under ZeRO-1 (dp_shard=4)
    # (dp_shard=2 x cp=2: ep spans the data-parallel and the context pairs)
    runs.update(train_many({"dp4": (tmp_path / "dp4", (*four, "parallel.activation_checkpointing=selective")),
                            "pp2": (tmp_path / "pp2", (*four, "parallel.pp=2", "parallel.pp_schedule=gpipe")),
                            "tp2": (tmp_path / "tp2", (*four, "parallel.tp=2")),
                            # ZeRO-1 with each expert shard on 2 ranks: its state replicated over them
                            "zero1_dp4": (tmp_path / "zero1_dp4", (*four, "parallel.zero_stage=1")),
                            "hsdp": (tmp_path / "hsdp", (*four, "parallel.dp_replicate=2", "parallel.dp_shard=2")),
                            # ep over each context pair, experts sharded over the 2 data-parallel ranks;
                            # documents masked across the context chunks
                            "cp2_dp2_docs": (tmp_path / "cp2_dp2_docs", (*COMMON, FP64, "parallel.ep=2",
                                                                         "parallel.cp=2", "parallel.dp_shard=2",
                                                                         "parallel.zero_stage=2",
                                                                         "data.document_masking=true")),
                            "resume32_ep4": (tmp_path / "resume32_ep4", (*COMMON, *fp32, "parallel.ep=4",
                                                                         "parallel.zero_stage=3", "parallel.cp=2",
                                                                         "parallel.dp_shard=2",
                                                                         "run.allow_changes=true")),
                            "resume32_to_zero1": (tmp_path / "resume32_to_zero1", (*COMMON, *fp32, "parallel.ep=2",
                                                                                   "parallel.zero_stage=1",
                                                                                   "run.allow_changes=true"))},
                           nproc=4))
    single = train_many({"one": (tmp_path / "one", (*COMMON, FP64, WHOLE_LOGITS)), "one32": (tmp_path / "one32", (*COMMON, *fp32)),
                         "one_noaux": (tmp_path / "one_noaux", (*COMMON, FP64, "model.moe.aux_loss_coef=0", WHOLE_LOGITS)),
                         "one_docs": (tmp_path / "one_docs", (*COMMON, FP64, "data.document_masking=true", WHOLE_LOGITS)),
                         "one_chat": (tmp_path / "one_chat", (*COMMON, FP64, *chat_data,
                                                              "model.moe.bias_update_rate=0",
                                                              "model.moe.aux_loss_coef=0", WHOLE_LOGITS)),
                         "hf_qwen3_moe_one": (tmp_path / "hf_qwen3_moe_one", (*hf["qwen3_moe"], WHOLE_LOGITS)),
                         "hf_mixtral_one": (tmp_path / "hf_mixtral_one", (*hf["mixtral"], WHOLE_LOGITS)),
                         "resume32": (runs["save32"], (*COMMON, *fp32, "run.allow_changes=true")),
                         "resume32_zero1": (runs["save32_zero1"], (*COMMON, *fp32, "run.allow_changes=true"))},
                        nproc=1)
    reference = final_params(single["one"], STEPS)
    assert losses(single["one_docs"])[STEPS] != losses(single["one"])[STEPS]  # the mask cuts documents
    assert any(name.endswith("expert_bias") and t.abs().sum() > 0 for name, t in reference.items())
    for name in ("ddp_selective", "cp2_zero3_full", "zero2_selective", "dp4", "pp2", "tp2", "hsdp", "hf_qwen3_moe",
                 "hf_mixtral", "ddp_noaux", "chat", "cp2_dp2_docs", "zero1", "zero1_dp4"):
        one = single[f"{name}_one" if name.startswith("hf_") else "one_noaux" if name == "ddp_noaux" else
                     "one_chat" if name == "chat" else "one_docs" if name == "cp2_dp2_docs" else "one"]
        assert_losses_close(losses(runs[name]), losses(one), rel=EXACT)
        assert_params_exact(final_params(runs[name], STEPS), final_params(one, STEPS))
        assert _counts(runs[name]) == _counts(one) and len(_counts(runs[name])) == STEPS
        if name.startswith("cp2"):  # statistics reduced over the context ranks too: the global batch's
            ours, theirs = _routing_scalars(runs[name]), _routing_scalars(one)
            assert ours.keys() == theirs.keys() and any(k.endswith("_router_entropy") for _, k in ours)
            assert all(ours[k] == pytest.approx(theirs[k], rel=EXACT) for k in ours), (ours, theirs)
    for step in _counts(runs["chat"]):  # top-2 of the real tokens, not of 128 per conversation
        assert sum(step["layers.1.feed_forward"]) == 2 * real_tokens < 2 * 128 * conversations
    # `disttrain convert --to hf` of the ep=2 ZeRO-3 Mixtral run: transformers loads every trained parameter
    from transformers import AutoModelForCausalLM

    from disttrain.checkpoint.export import export

    exported = export(runs["hf_mixtral"] / "checkpoints" / f"step_{STEPS:08d}", "hf", tmp_path / "mixtral_hf")
    loaded = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True, dtype=torch.float64).state_dict()
    trained = final_params(runs["hf_mixtral"], STEPS)
    assert trained.keys() <= loaded.keys()
    differ = [k for k, t in trained.items() if not torch.equal(loaded[k], t.to(torch.float32).double())]
    assert not differ, differ  # the export is float32
    # `disttrain convert --to hf` of the built-in family: transformers' Qwen2-MoE loads every trained parameter
    # (test_builtin_moe_exports_as_qwen2_moe_with_equal_logits checks the logits); a moved bias is refused
    from disttrain.models.llama.moe_hf_names import from_hf

    exported = export(runs["chat"] / "checkpoints" / f"step_{STEPS:08d}", "hf", tmp_path / "chat_hf")
    loaded = from_hf(AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).state_dict())
    trained = final_params(runs["chat"], STEPS)
    assert loaded.keys() == {k for k in trained if not k.endswith("expert_bias")}
    differ = [k for k, t in loaded.items() if not torch.equal(t, trained[k].to(torch.float32))]
    assert not differ, differ
    code, _, err = run_main("convert", str(runs["ddp_selective"] / "checkpoints" / f"step_{STEPS:08d}"), "--to",
                            "hf", "--out", str(tmp_path / "biased_hf"))
    assert code == 2 and err.count("\n") == 1 and "balancing bias has moved" in err, err
    assert not (tmp_path / "biased_hf").exists()
    # `disttrain report`'s expert-load heat map: layer x expert over steps, tokens over the mean
    from disttrain.observe.run_report import expert_loads, figures, load_records

    assert "expert_load.png" in figures(*load_records(runs["ddp_selective"]))
    counts = _counts(runs["ddp_selective"])
    steps, grid = expert_loads(records(runs["ddp_selective"]))["layers.1.feed_forward"]
    assert steps == list(range(1, STEPS + 1))
    assert grid[3][0] == pytest.approx(counts[0]["layers.1.feed_forward"][3] / (sum(counts[0]["layers.1.feed_forward"]) / 8))
    straight = losses(single["one32"])
    for resumed in (losses(single["resume32"]), losses(runs["resume32_ep4"]), losses(single["resume32_zero1"]),
                    losses(runs["resume32_to_zero1"])):
        assert sorted(resumed) == list(range(1, STEPS + 1))
        assert_losses_close({s: resumed[s] for s in range(3, STEPS + 1)}, {s: straight[s] for s in range(3, STEPS + 1)},
                            rel=1e-5)
    # the step after the resume moves parameters by the optimizer states the ZeRO-1 checkpoint held (expert
    # states included): a missing or misplaced state moves them by a sizeable fraction of lr
    for resumed in (single["resume32"], single["resume32_zero1"], runs["resume32_to_zero1"]):
        assert_params_close(final_params(resumed, STEPS), final_params(single["one32"], STEPS), rel=1e-5, lr=LR)
