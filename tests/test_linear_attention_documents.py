"""Document masking on the Gated DeltaNet families (Qwen3-Next, Qwen3.5): each linear-attention layer computes
every packed document as if it were alone (its convolution reads nothing before the document, its recurrent state
starts from zero), in one process (each document's logits and the gradients equal the documents' alone, fp64 to
EXACT) and under data, tensor and context parallelism (the losses and parameters of one process with document
masking)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import EXACT, FP64, assert_parity, losses, train_many
from hf_models import save_tiny

KINDS = ("qwen3_next", "qwen3_5_text")
EOS = 0
LENGTHS = (20, 70, 9)  # the second crosses the recurrence's 64-token chunks and starts inside one


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("linear_documents")
    return {kind: save_tiny(kind, root / kind) for kind in KINDS}


def _models(directory):
    """(spec, a plain fp64 model, the same model with document masking)."""
    from disttrain.models.hf.spec import hf_spec
    from disttrain.models.spec import build_model

    spec = hf_spec(str(directory))
    plain, masked = (build_model(spec, torch.device("cpu"), 0, torch.float64).eval() for _ in range(2))
    spec.mask_documents(masked, EOS)
    return spec, plain, masked


def _documents():
    gen = torch.Generator().manual_seed(0)
    return [torch.cat([torch.randint(1, 256, (1, n - 1), generator=gen), torch.tensor([[EOS]])], dim=1)
            for n in LENGTHS]


def _packed(docs, order):
    return torch.cat([docs[i] for i in order], dim=1)


ORDERS = ((0, 1, 2), (2, 1, 0))  # two rows: each document at another place in each


def _logits_and_grads(spec, model, rows, weights):
    """Each row's logits, and the parameters' gradients of sum(logits x weights) over the rows."""
    model.zero_grad()
    logits = spec.logits(model(input_ids=rows))
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_each_packed_document_computes_as_if_alone(kind, dirs):
    """Logits to EXACT per document; the gradients of a weighted sum of the packed logits equal the sum of the
    documents' own (the documents are independent)."""
    spec, plain, masked = _models(dirs[kind])
    docs = _documents()
    rows = torch.cat([_packed(docs, order) for order in ORDERS])
    weights = torch.randn(*rows.shape, spec.shape.vocab_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    packed, grads = _logits_and_grads(spec, masked, rows, weights)
    expected = {n: torch.zeros_like(g) for n, g in grads.items()}
    for row, order in enumerate(ORDERS):
        start = 0
        for i in order:
            window = slice(start, start + LENGTHS[i])
            alone, alone_grads = _logits_and_grads(spec, plain, docs[i], weights[row:row + 1, window])
            torch.testing.assert_close(packed[row:row + 1, window], alone, rtol=EXACT, atol=EXACT)
            for n, g in alone_grads.items():
                expected[n] += g
            start += LENGTHS[i]
    for n, g in grads.items():
        torch.testing.assert_close(g, expected[n], rtol=EXACT, atol=EXACT, msg=lambda m, n=n: f"d{n}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("leak", ["convolution", "state"])
def test_without_either_reset_a_document_reads_the_ones_before(kind, leak, dirs):
    """The documents are long enough that each reset matters: with transformers' own convolution (or recurrence)
    in place of the document-aware one, the later documents' logits move far (beyond EXACT) from their own."""
    from disttrain.models.hf import linear_kernels

    spec, plain, masked = _models(dirs[kind])
    original = dict(zip(("convolution", "state"), linear_kernels.kernels(linear_kernels.layers(plain)[0])))
    for layer in linear_kernels.layers(masked):
        conv, rule = linear_kernels.kernels(layer)
        linear_kernels.replace(layer, original["convolution"] if leak == "convolution" else conv,
                               original["state"] if leak == "state" else rule)
    docs = _documents()
    with torch.no_grad():
        packed = spec.logits(masked(input_ids=_packed(docs, ORDERS[0])))
        alone = spec.logits(plain(input_ids=docs[1]))
    moved = (packed[:, LENGTHS[0]:LENGTHS[0] + LENGTHS[1]] - alone).abs().max().item()
    assert moved > 1e-5, moved  # a hundred thousand times EXACT


# Training, fp64, every layout against one process that masks the same documents: packed chat data (several
# conversations per sequence, each ended by the end token; packing turns document masking on), and for Qwen3-Next
# under context parallelism the built-in text with document masking (a context shard does not see whole rows, so
# chat padding reaches its experts there but not in one process: docs/parallelism.md, "Padding").
SEQ, CHAT_SEQ = 64, 128  # cp2: chunks of 16 and 32 (the convolution reaches 3 back)
COMMON = ("train.steps=4", "train.global_batch_size=4", "optim.lr=3e-3", "checkpoint.save_final=true", FP64)
CP = {"cp2": ("parallel.cp=2", "parallel.cp_method=allgather"),
      "cp2-ulysses": ("parallel.cp=2", "parallel.cp_method=ulysses"),
      "cp2-ring": ("parallel.cp=2", "parallel.cp_method=ring"),
      "cp2-ep2-zero3": ("parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=3")}  # experts over the cp ranks
RUNS = {"qwen3_next chat ddp": ("qwen3_next", "chat", ()),
        **{f"qwen3_next text {name}": ("qwen3_next", "text", o) for name, o in CP.items()},
        "qwen3_5_text chat ddp": ("qwen3_5_text", "chat", ()),
        "qwen3_5_text chat cp2-ring": ("qwen3_5_text", "chat", CP["cp2-ring"]),
        "qwen3_5_text chat tp2": ("qwen3_5_text", "chat", ("parallel.tp=2",))}  # each rank its heads' documents


@pytest.fixture(scope="module")
def sources(dirs, tmp_path_factory):
    """Each "{kind} {data}" -> its overrides: packed chat data (prepared with tests/chat_tokenizer.py's tokenizer, the
    families at its vocabulary) and the built-in text with document masking, and without."""
    import json

    from chat_tokenizer import VOCAB, records, save_chat_tokenizer
    from hf_models import family_config

    from disttrain.cli import main

    root = tmp_path_factory.mktemp("chat")
    tok = save_chat_tokenizer(root / "tok")
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    main(["prepare-data", str(root / "records.jsonl"), "--out", str(root / "data"), "--tokenizer", str(tok),
          "--seq-len", str(CHAT_SEQ), "--val-fraction", "0.25"])
    data = {}
    for kind in KINDS:
        config = family_config(kind)
        config.vocab_size = VOCAB
        config.save_pretrained(root / kind)
        data[f"{kind} chat"] = (f"data.source={root / 'data'}", "data.packing=true", f"data.seq_len={CHAT_SEQ}",
                                f"model.hf={root / kind}")
        data[f"{kind} text"] = ("data.document_masking=true", f"data.seq_len={SEQ}", f"model.hf={dirs[kind]}")
        data[f"{kind} text plain"] = (f"data.seq_len={SEQ}", f"model.hf={dirs[kind]}")
    return data


def test_the_packed_rows_hold_several_documents(sources):
    """What the training parity below masks: most packed rows hold a conversation starting after another's end."""
    from disttrain.data.source import load_samples

    data = sources[f"{KINDS[0]} chat"][0].removeprefix("data.source=")
    tok, samples, _ = load_samples(data, "auto", CHAT_SEQ, True)
    x = torch.as_tensor(samples.batch(np.arange(len(samples)))[0])
    starts = ((x[:, :-1] == tok.eos_id) & (x[:, 1:] != tok.eos_id)).sum(dim=1)  # not padding: a real token
    assert (starts >= 1).double().mean() > 0.5, starts


@pytest.fixture(scope="module")
def references(sources, tmp_path_factory):
    """One process on each kind's data; the built-in text also without masking (to show masking changes it)."""
    root = tmp_path_factory.mktemp("ref")
    names = {f"{kind} {data}" for kind, data, _ in RUNS.values()} | {"qwen3_next text plain"}
    return train_many({n: (root / n.replace(" ", "_"), (*COMMON, *sources[n])) for n in names}, nproc=1)


@pytest.fixture(scope="module")
def two_rank_runs(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    return train_many({n: (root / n.replace(" ", "_"), (*COMMON, *sources[f"{kind} {data}"], *o))
                       for n, (kind, data, o) in RUNS.items()}, nproc=2)


@pytest.mark.parametrize("name", list(RUNS))
def test_document_masking_trains_like_one_process(name, two_rank_runs, references):
    kind, data, _ = RUNS[name]
    assert_parity(two_rank_runs[name], references[f"{kind} {data}"], rel=EXACT, step=4)
    masked, plain = losses(references["qwen3_next text"]), losses(references["qwen3_next text plain"])
    assert max(abs(masked[s] - plain[s]) / plain[s] for s in plain) > 1e-4  # the text has documents to mask
