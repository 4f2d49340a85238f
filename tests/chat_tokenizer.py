"""What the chat-data tests share: a tiny byte-level BPE tokenizer with a ChatML-style chat template,
trained offline, saved as a Hugging Face tokenizer directory (transformers' own save_pretrained), built as
examples/sft builds its own (make_assets.py), so these tests check that piece too; a few conversations;
prepare-data run in-process; transformers' own masks; the textbook first-fit rule."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from helpers import run_main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft"


def example_module(name: str):
    """A script of examples/sft, imported by path (the example is not a package)."""
    spec = importlib.util.spec_from_file_location(f"sft_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = example_module("make_assets")

VOCAB = 320  # 256 bytes, the special tokens and a few merges: fits model.vocab_size=384

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three plus three?"},
     {"role": "assistant", "content": "Six, of course."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Say hello to the world in a long friendly sentence please."},
     {"role": "assistant", "content": "Hello, world! It is a fine day to train a small model on chats."}],
    [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One two three four five."}],
]

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def records(n: int = 24) -> list[dict]:
    """`n` chat records of one to three exchanges (answers of different lengths) and every sixth an
    instruction record: the number of targets that carry loss differs widely between records."""
    out = []
    for i in range(n):
        if i % 6 == 5:
            out.append({"prompt": f"Spell {i}:", "completion": " " + " ".join(WORDS[int(d)] for d in str(i))})
            continue
        messages = [{"role": "system", "content": "You are terse."}] if i % 2 else []
        for turn in range(1 + i % 3):
            a, b = (i + turn) % 10, (3 * i + turn) % 10
            messages += [{"role": "user", "content": f"What is {WORDS[a]} plus {WORDS[b]}?"},
                         {"role": "assistant", "content": f"{WORDS[a]} plus {WORDS[b]} is {a + b}." * (1 + turn)}]
        out.append({"messages": messages})
    return out


def as_messages(record: dict) -> list[dict]:
    """An instruction record as the user and assistant turns the template renders it as."""
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def template(markers: bool) -> str:
    return example.chat_template(markers)


def save_chat_tokenizer(directory: Path, markers: bool = True, chat: bool = True) -> Path:
    """A tokenizer directory; `chat=False` leaves the chat template out."""
    texts = [m["content"] for c in CONVERSATIONS + [as_messages(r) for r in records()] for m in c]
    return example.train_tokenizer(texts * 4, directory, VOCAB, template(markers) if chat else None)


def save_tokenizers(root: Path) -> dict[str, Path]:
    """With generation markers, without them, and without a chat template."""
    return {"markers": save_chat_tokenizer(root / "markers", markers=True),
            "plain": save_chat_tokenizer(root / "plain", markers=False),
            "none": save_chat_tokenizer(root / "none", chat=False)}


def prepare(tmp_path: Path, data: list[dict], tokenizer, *extra: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `disttrain prepare-data` run in this process, into tmp_path / "out"."""
    src = tmp_path / "records.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in data))
    return run_main("prepare-data", str(src), "--out", str(tmp_path / "out"), "--tokenizer", str(tokenizer), *extra)


def reference_masks(tokenizer_dir, data):
    """transformers' own (ids, assistant mask) per record, from the template with generation markers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = [tok.apply_chat_template(as_messages(r), tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
           for r in data]
    return [(np.asarray(o["input_ids"]), np.asarray(o["assistant_masks"])) for o in out]


def naive_first_fit(lengths, capacity):
    """Each item into the first bin with room, by scanning every bin."""
    bins, room = [], []
    for i, n in enumerate(lengths):
        b = next((b for b, r in enumerate(room) if r >= n), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= n
    return bins
