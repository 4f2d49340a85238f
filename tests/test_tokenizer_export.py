"""A Hugging Face model directory's tokenizer trains and exports with the model: model.hf's tokenizer wins
over a config file's `data.tokenizer` (named in a warning), the start line names the tokenizer and the
layout, each checkpoint save is a console line, and `convert --to hf` writes what `AutoTokenizer` and
`GenerationConfig` load, every file readable by everyone."""

from __future__ import annotations

import logging
import stat

import pytest

from disttrain.config.load import load_config
from disttrain.data.corpus import builtin_splits
from disttrain.config.resolve import resolve_run
from helpers import REPO, events

DEMO = REPO / "configs" / "demo.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved by transformers with its own BPE tokenizer (400 tokens, end-of-text 0) and a
    generation config, as a downloaded model directory holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(builtin_splits()["train"][:20], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(directory)
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=512, max_position_embeddings=128, bos_token_id=0,
                eos_token_id=0).save_pretrained(directory)
    GenerationConfig(eos_token_id=0, max_new_tokens=7, do_sample=False).save_pretrained(directory)
    return directory


def test_the_models_tokenizer_wins_over_a_config_files_byte(model_dir):
    cfg = load_config(DEMO, [f"model.hf={model_dir}"])  # configs/demo.yaml pins data.tokenizer: byte
    assert resolve_run(cfg, 1, "cpu").tokenizer == str(model_dir / "tokenizer.json")
    assert cfg.warnings == [f"data.tokenizer=byte from {DEMO} is not used: model.hf={model_dir} has its own "
                            f"tokenizer ({model_dir / 'tokenizer.json'}), which trains instead; give "
                            "data.tokenizer=byte on the command line to keep it"]
    pinned = load_config(DEMO, [f"model.hf={model_dir}", "data.tokenizer=byte"])  # the command line decides
    assert resolve_run(pinned, 1, "cpu").tokenizer == "byte" and pinned.warnings == []


def test_a_run_with_the_models_tokenizer_exports_it(model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from disttrain.checkpoint.export import export
    from disttrain.cli import main

    handlers = logging.getLogger("disttrain").handlers[:]
    try:
        main(["train", str(DEMO), f"model.hf={model_dir}", f"run.dir={tmp_path}", "train.steps=2",
              "data.seq_len=32", "train.global_batch_size=2", "train.micro_batch_size=2", "train.eval_every=0",
              "train.sample_tokens=4", "optim.warmup_steps=0", "checkpoint.every_steps=1", "metrics.log_every=1",
              "metrics.comm_profile_every=0"])
    finally:
        for handler in logging.getLogger("disttrain").handlers:
            handler.close()
        logging.getLogger("disttrain").handlers[:] = handlers
    out = capsys.readouterr().out.splitlines()
    run = tmp_path / "demo"
    assert out[0].startswith(f"model {model_dir}: ") and out[0].endswith(
        f"| world 1: dp=1 zero=0 on cpu/gloo | tokenizer {model_dir / 'tokenizer.json'} | 64 tokens per step"), out
    assert out[1] == f"warning: data.tokenizer=byte from {DEMO} is not used: model.hf={model_dir} has its own " \
                     f"tokenizer ({model_dir / 'tokenizer.json'}), which trains instead; give data.tokenizer=byte " \
                     "on the command line to keep it"
    saves = [line for line in out if line.startswith("checkpoint: ")]
    assert [s.split(" saved to ")[0] for s in saves] == ["checkpoint: step 1", "checkpoint: step 2"], out
    assert saves[1].split(" saved to ")[1].startswith(f"{run / 'checkpoints' / 'step_00000002'} (")
    assert [e["message"] for e in events(run, "warning")] == [out[1][len("warning: "):]]

    hf = export(run, "hf", tmp_path / "hf")
    text = "The quick brown fox, and a tokenizer."
    theirs, ours = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(hf)
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and ours.eos_token_id == theirs.eos_token_id == 0
    assert GenerationConfig.from_pretrained(hf).to_dict() == GenerationConfig.from_pretrained(model_dir).to_dict()
    assert AutoModelForCausalLM.from_pretrained(hf).config.vocab_size == 512
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in hf.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes
