"""Answers from the fine-tuned model, both ways it leaves disttrain: the base with the PEFT adapter loaded
by `peft`, and the merged weights loaded by transformers alone. Greedy decoding, so both give the same
text; the base model's own answer is printed beside them.

    python examples/sft/generate.py WORK_DIR ["What is two plus three?" ...]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

transformers_logging.disable_progress_bar()  # three tiny models load in milliseconds
# peft reads transformers' deprecated `is_gradient_checkpointing` when wrapping a model: nothing to act on here
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def answer(model, tok, question: str, tokens: int = 16) -> str:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main(work: Path, questions: list[str]) -> None:
    tok = AutoTokenizer.from_pretrained(work / "merged")
    base = AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.float32).eval()
    before = {q: answer(base, tok, q) for q in questions}
    adapted = PeftModel.from_pretrained(base, work / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(work / "merged", dtype=torch.float32).eval()
    for q in questions:
        via_peft, via_merged = answer(adapted, tok, q), answer(merged, tok, q)
        print(f"user: {q}\n  base model:         {before[q]!r}\n  base + adapter:     {via_peft!r}\n"
              f"  merged weights:     {via_merged!r}")
        if via_peft != via_merged:
            sys.exit(f"the adapter and the merged weights answer differently: {via_peft!r} vs {via_merged!r}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0] if args else "runs/sft-example"),
         args[1:] or ["What is two plus three?", "What is seven plus one?", "Spell 42:"])
