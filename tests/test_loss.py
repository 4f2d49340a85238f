"""The loss is the mean cross-entropy over the *valid* targets of the whole global batch: targets -100 carry
no loss and the divisor is their global count over ranks and micro-batches. On data whose samples mask very
different numbers of targets (tests/data/masked_tokens.py), every layout gives one process's losses and
parameters (fp64, 1e-10), and the logged loss equals independent computations: PyTorch's mean cross-entropy
over the global batch, and transformers' own causal-LM loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_models import save_tiny
from helpers import EXACT, FP64, REPO, WHOLE_LOGITS, assert_parity, losses, train_many

SOURCE = f"data.source=py:{REPO / 'tests' / 'data' / 'masked_tokens.py'}:splits"
# 8 sequences per step: 2 micro-batches of 2 per rank on 2 ranks, whose valid-target counts differ widely.
COMMON = ("train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.lr=3e-3",
          "checkpoint.save_final=true", "train.eval_every=6", "train.eval_batches=1", SOURCE, FP64,
          "train.loss_chunk_tokens=24")  # the references take whole logits
LAYOUTS = {
    "ddp": (),
    "zero3": ("parallel.zero_stage=3",),
    "tp2": ("parallel.tp=2",),
    "pp2": ("parallel.pp=2", "parallel.pp_schedule=gpipe"),
    "uneven 3:1": ("parallel.balance_weights=[3,1]", "train.micro_batch_size=1"),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama", weights_seed=0)


@pytest.fixture(scope="module")
def references(tmp_path_factory, hf_dir):
    """One process, the whole global batch in one micro-batch: the built-in debug model and an HF Llama."""
    root = tmp_path_factory.mktemp("ref")
    return train_many({"builtin": (root / "builtin", (*COMMON, "train.micro_batch_size=8", WHOLE_LOGITS)),
                       "hf": (root / "hf", (*COMMON, "train.micro_batch_size=8", f"model.hf={hf_dir}", WHOLE_LOGITS))},
                      nproc=1)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, hf_dir):
    root = tmp_path_factory.mktemp("two")
    jobs = {name: (root / name.replace(" ", "_").replace(":", "-"), (*COMMON, *extra)) for name, extra in LAYOUTS.items()}
    jobs["hf zero3"] = (root / "hf_zero3", (*COMMON, f"model.hf={hf_dir}", "parallel.zero_stage=3"))
    return train_many(jobs, nproc=2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masked_targets_give_one_process_loss_on_every_layout(layout, two_rank_runs, references):
    assert_parity(two_rank_runs[layout], references["builtin"], step=6)
    _assert_same_validation(two_rank_runs[layout], references["builtin"])


def test_masked_targets_on_a_hugging_face_model(two_rank_runs, references):
    assert_parity(two_rank_runs["hf zero3"], references["hf"], step=6)


def _assert_same_validation(run, reference):
    from helpers import events

    ours, theirs = events(run, "eval"), events(reference, "eval")
    assert len(ours) == len(theirs) == 1
    assert abs(ours[0]["val_loss"] - theirs[0]["val_loss"]) <= EXACT * theirs[0]["val_loss"]


def _first_global_batch(seed: int = 0, size: int = 8):
    """Step 1's sequences (the sampler fixes them from the seed, the step and the global batch size)."""
    import importlib.util

    from disttrain.data.loader import DatasetSamples
    from disttrain.data.sampling import GlobalBatchSampler

    spec = importlib.util.spec_from_file_location("masked_tokens", REPO / "tests" / "data" / "masked_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    samples = DatasetSamples(module.splits()["train"])
    return samples.batch(GlobalBatchSampler(len(samples), size, seed).indices(1))


def test_logged_loss_is_pytorchs_mean_over_valid_targets(references):
    """Step 1's logged loss (before any update) equals F.cross_entropy's mean with ignore_index=-100 over the
    whole global batch, computed here from the initial weights; counting masked targets would be far off."""
    from disttrain.models.llama import llama_spec
    from disttrain.models.registry import MODEL_SHAPES
    from disttrain.models.spec import build_model

    x, y = _first_global_batch()
    model = build_model(llama_spec(MODEL_SHAPES["debug"]), torch.device("cpu"), seed=0, dtype=torch.float64)
    with torch.no_grad():
        logits = model(x)
    expected = float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100))
    logged = losses(references["builtin"])[1]
    assert abs(logged - expected) <= 1e-12 * expected
    valid = int((y != -100).sum())
    assert valid <= 0.75 * y.numel()  # the batch really masks many targets (a quarter) ...
    counted = float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")) / y.numel()
    assert abs(counted - expected) > 0.2 * expected  # ... so a divisor that counts them would show


def test_logged_loss_is_transformers_own_loss(references, hf_dir):
    """The HF run's step-1 loss equals transformers' causal-LM loss of the same weights on the same batch
    (`shift_labels`: our targets are already the next tokens). transformers computes it in fp32 (it upcasts
    logits with .float()), hence 1e-6."""
    from transformers import AutoModelForCausalLM

    x, y = _first_global_batch()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    with torch.no_grad():
        expected = float(model(input_ids=x, labels=y, shift_labels=y).loss)
    logged = losses(references["hf"])[1]
    assert abs(logged - expected) <= 1e-6 * expected
