"""Document masking: a token's computation does not depend on the documents packed before it."""

from __future__ import annotations

import pytest
import torch

from disttrain.config.load import load_config
from disttrain.models.documents import block_causal_mask, document_positions
from disttrain.models.registry import model_spec
from disttrain.models.spec import build_model
from helpers import DEBUG_CONFIG
from hf_models import save_tiny

EOS = 0


def test_positions_restart_after_each_end_of_document_token():
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, EOS, 9]])
    positions, documents = document_positions(tokens, EOS)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    mask = block_causal_mask(documents)[0, 0]
    assert mask[3].tolist() == [False, False, True, True, False, False, False]
    assert mask[6].tolist() == [False] * 6 + [True]


def _model(tmp_path, *overrides):
    cfg = load_config(DEBUG_CONFIG, [f"run.dir={tmp_path}", *overrides])
    spec = model_spec(cfg.model)
    model = build_model(spec, torch.device("cpu"), seed=0)
    masked = build_model(spec, torch.device("cpu"), seed=0)
    spec.mask_documents(masked, EOS)
    return spec, model.eval(), masked.eval()


@pytest.mark.parametrize("family", ["builtin", "hf-llama"])
def test_logits_do_not_depend_on_the_previous_document(tmp_path, family):
    overrides = [f"model.hf={save_tiny('llama', tmp_path / 'hf')}"] if family == "hf-llama" else []
    spec, plain, masked = _model(tmp_path, *overrides)
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(1, 256, (1, 12), generator=gen)
    before = [torch.randint(1, 256, (1, n), generator=gen) for n in (5, 9)]
    eos = torch.tensor([[EOS]])
    with torch.no_grad():
        alone = spec.logits(plain(doc))
        packed = [spec.logits(masked(torch.cat([b, eos, doc], dim=1)))[:, -doc.shape[1]:] for b in before]
        unmasked = spec.logits(plain(torch.cat([before[0], eos, doc], dim=1)))[:, -doc.shape[1]:]
    for logits in packed:  # what came before (another length, other tokens) changes nothing
        torch.testing.assert_close(logits, alone)
    assert (unmasked - alone).abs().max() > 1e-2  # without masking it does
