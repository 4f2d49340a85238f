"""Hugging Face Hub ids where a directory is allowed (model.hf, prepare-data's --tokenizer and inputs), read offline
from a huggingface_hub cache laid out here as huggingface_hub writes it (refs/main naming the snapshot)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from chat_tokenizer import records, save_chat_tokenizer
from helpers import DEBUG_CONFIG, REPO, cli_env, losses, run_module
from hf_models import tiny_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _snapshot(hub: Path, kind: str, repo: str, files: Path) -> None:
    root = hub / f"{kind}s--{repo.replace('/', '--')}"
    shutil.copytree(files, root / "snapshots" / COMMIT)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """org/tiny-chat: a tiny Llama with weights and a chat tokenizer; org/chats: chat records in data/train.jsonl."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hub")
    model = root / "files" / "model"
    config = tiny_config("llama")
    config.vocab_size = 384  # the chat tokenizer's 320 ids fit
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    save_chat_tokenizer(model)
    data = root / "files" / "data"
    (data / "data").mkdir(parents=True)
    (data / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    _snapshot(root / "cache", "model", "org/tiny-chat", model)
    _snapshot(root / "cache", "dataset", "org/chats", data)
    return root


def _disttrain(hub: Path, *args: str) -> subprocess.CompletedProcess:
    """The command in its own process, where huggingface_hub is first imported (it reads HF_HUB_OFFLINE and the
    cache location then): the suite's pre-imported server does not import it."""
    env = {**cli_env(), "HF_HUB_CACHE": str(hub / "cache"), "HF_HUB_OFFLINE": "1"}
    return run_module("disttrain", args, env=env, cwd=REPO, timeout=300)


def test_a_hub_model_and_dataset_train_as_their_directories_do(hub, tmp_path):
    by_id = _disttrain(hub, "prepare-data", "org/chats", "--tokenizer", "org/tiny-chat", "--seq-len", "64",
                       "--out", str(tmp_path / "by_id"))
    assert by_id.returncode == 0, by_id.stderr
    files = hub / "files"
    by_dir = _disttrain(hub, "prepare-data", str(files / "data" / "data" / "train.jsonl"), "--tokenizer",
                        str(files / "model"), "--seq-len", "64", "--out", str(tmp_path / "by_dir"))
    assert by_dir.returncode == 0, by_dir.stderr
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "by_id" / name).read_bytes() == (tmp_path / "by_dir" / name).read_bytes(), name
    runs = {}
    for name, model, data in (("id", "org/tiny-chat", "by_id"), ("dir", str(files / "model"), "by_dir")):
        proc = _disttrain(hub, "train", str(DEBUG_CONFIG), f"model.hf={model}", f"data.source={tmp_path / data}",
                          "data.seq_len=64", "train.steps=3", f"run.dir={tmp_path}", f"run.name={name}")
        assert proc.returncode == 0, proc.stderr
        runs[name] = losses(tmp_path / name)
    assert runs["id"] == runs["dir"]  # the same weights, tokenizer and data


def test_a_revision_is_honoured(hub, tmp_path):
    """`org/name@revision`: the snapshot of that commit (here the only one); a revision the cache lacks is refused."""
    proc = _disttrain(hub, "estimate", str(DEBUG_CONFIG), f"model.hf=org/tiny-chat@{COMMIT}")
    assert proc.returncode == 0 and proc.stdout.startswith(f"Model: org/tiny-chat@{COMMIT}, "), proc.stderr
    proc = _disttrain(hub, "estimate", str(DEBUG_CONFIG), "model.hf=org/tiny-chat@v2")
    assert proc.returncode == 2 and "model.hf=org/tiny-chat@v2: no such directory, and not in the Hugging Face cache" \
        in proc.stderr, proc.stderr


def test_an_id_neither_cached_nor_reachable_is_one_line(hub, tmp_path):
    proc = _disttrain(hub, "train", str(DEBUG_CONFIG), "model.hf=org/not-cached", f"run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"disttrain: error: model.hf=org/not-cached: no such directory, and not in the Hugging Face cache "
        f"({hub / 'cache'}) while HF_HUB_OFFLINE=1 allows the cache only (allowed: a local folder written by "
        "save_pretrained, or a Hub id that is cached or reachable)"]
    assert not any(tmp_path.iterdir())
    proc = _disttrain(hub, "prepare-data", "org/no-such-data", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("disttrain: error: input=org/no-such-data: no such directory, and not in the "
                                  "Hugging Face cache"), proc.stderr
