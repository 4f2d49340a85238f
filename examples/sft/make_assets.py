"""The inputs of the fine-tuning example, made here with nothing downloaded:

- `chats.jsonl`: conversations about small sums, and instruction records that spell numbers out;
- `tokenizer/`: a byte-level BPE trained on them with the `tokenizers` library, saved by transformers
  with a ChatML chat template whose {% generation %} markers say which tokens are the assistant's;
- `base/`: a tiny Hugging Face Llama (random weights: it stands in for a released checkpoint).

    python examples/sft/make_assets.py WORK_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from disttrain.observe.quiet import quiet_third_party

quiet_third_party()  # before transformers and peft import torchao: its kernel-loading noise, dropped

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML. {G}/{E} become {% generation %} / {% endgeneration %} (or nothing) around each assistant answer
# and its end-of-turn token: exactly the tokens that carry loss.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{G}{{ m['content'] }}<|im_end|>{E}"
            "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def chat_template(markers: bool = True) -> str:
    g, e = ("{% generation %}", "{% endgeneration %}") if markers else ("", "")
    return TEMPLATE.replace("{G}", g).replace("{E}", e)


def train_tokenizer(texts: list[str], directory: Path, vocab_size: int, template: str | None) -> Path:
    """A byte-level BPE trained on `texts`, saved as a Hugging Face tokenizer directory (tokenizer.json,
    tokenizer_config.json with `template` as its chat template; None: no template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=template)
    fast.save_pretrained(directory)
    return directory


def make_records(n: int, seed: int = 0, max_turns: int = 2, instructions: float = 0.2) -> list[dict]:
    """`n` records: chats of one to `max_turns` questions about sums (about half with a system turn), and about
    a share `instructions` of instruction records (prompt + completion) that spell a number out."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if instructions and rng.random() < instructions:
            a, b = rng.randrange(10), rng.randrange(10)
            out.append({"prompt": f"Spell {a}{b}:", "completion": f" {WORDS[a]} {WORDS[b]}"})
            continue
        messages = [{"role": "system", "content": "You add numbers."}] if rng.random() < 0.5 else []
        for _ in range(rng.randrange(1, max_turns + 1)):
            a, b = rng.randrange(10), rng.randrange(10)
            messages += [{"role": "user", "content": f"What is {WORDS[a]} plus {WORDS[b]}?"},
                         {"role": "assistant", "content": f"{WORDS[a].capitalize()} plus {WORDS[b]} is {a + b}."}]
        out.append({"messages": messages})
    return out


def save_base(directory: Path, vocab_size: int, seed: int = 0, **sizes) -> Path:
    """A 4-layer Llama (hidden 64, grouped-query attention) written by transformers' save_pretrained; `sizes`:
    LlamaConfig keys that replace those dimensions (examples/dpo's smaller student)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one tiny shard: a bar says nothing
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2), **sizes}, vocab_size=vocab_size,
                         max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def main(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    records = make_records(1000)
    (work / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    texts = [m["content"] for r in records for m in r.get("messages", [])] + \
            [r[k] for r in records for k in ("prompt", "completion") if k in r]
    train_tokenizer(texts, work / "tokenizer", vocab_size=384, template=chat_template())
    save_base(work / "base", vocab_size=384)
    print(f"wrote {work}/chats.jsonl ({len(records)} records), {work}/tokenizer, {work}/base")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sft-example"))
