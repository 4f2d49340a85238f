"""The inputs of the preference and distillation example, made from the fine-tuning example's conversations:

- `pairs.jsonl`: each conversation's last question with its right answer preferred over a wrong one
  (`{"prompt": [...], "chosen": [...], "rejected": [...]}`, the conventions of Hugging Face's preference data);
- `student/`: a Hugging Face Llama smaller than the example's base (2 layers, hidden 32, random weights), the
  student the fine-tuned model teaches.

    python examples/dpo/make_pairs.py WORK_DIR      (after examples/sft/make_assets.py WORK_DIR)
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sft"))
from make_assets import save_base  # noqa: E402  (the fine-tuning example's model, made smaller)


def make_pairs(chats: list[dict], seed: int = 0) -> list[dict]:
    """One pair per conversation whose last answer is a sum: that answer chosen, the same with a wrong sum
    rejected."""
    rng = random.Random(seed)
    pairs = []
    for record in chats:
        messages = record.get("messages")
        if not messages or messages[-1]["role"] != "assistant":
            continue
        *prompt, answer = messages
        found = re.search(r"is (\d+)\.$", answer["content"])
        if not found:
            continue
        right = int(found.group(1))
        wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])
        rejected = answer["content"][:found.start(1)] + f"{wrong}."
        pairs.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": rejected}]})
    return pairs


def save_student(directory: Path, vocab_size: int) -> Path:
    """The fine-tuning example's Llama made smaller: 2 layers, hidden 32."""
    return save_base(directory, vocab_size, seed=1, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)


def main(work: Path) -> None:
    chats = [json.loads(line) for line in (work / "chats.jsonl").read_text().splitlines()]
    pairs = make_pairs(chats)
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    save_student(work / "student", vocab_size=384)
    print(f"wrote {work}/pairs.jsonl ({len(pairs)} pairs), {work}/student")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/dpo-example"))
