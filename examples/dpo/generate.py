"""Answers from the example's models, greedy: the fine-tuned model (DPO's starting point), DPO's adapter loaded
on it by `peft` and DPO's merged weights (the same answers: the script stops if they differ), and the distilled
student beside its teacher.

    python examples/dpo/generate.py WORK_DIR ["What is two plus three?" ...]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from disttrain.observe.quiet import quiet_third_party

quiet_third_party()  # before transformers and peft import torchao: its kernel-loading noise, dropped

import torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sft"))
from generate import answer  # noqa: E402  (the fine-tuning example's greedy answer through the chat template)

transformers_logging.disable_progress_bar()
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def load(directory: Path):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def main(work: Path, questions: list[str]) -> None:
    tok = AutoTokenizer.from_pretrained(work / "dpo-merged")
    sft = load(work / "sft-merged")
    before = {q: answer(sft, tok, q) for q in questions}
    adapted = PeftModel.from_pretrained(sft, work / "dpo-adapter").eval()
    merged, student = load(work / "dpo-merged"), load(work / "distilled")
    for q in questions:
        via_peft, via_merged = answer(adapted, tok, q), answer(merged, tok, q)
        print(f"user: {q}\n  fine-tuned:               {before[q]!r}\n  after DPO (adapter):      {via_peft!r}\n"
              f"  after DPO (merged):       {via_merged!r}\n  distilled student:        {answer(student, tok, q)!r}")
        if via_peft != via_merged:
            sys.exit(f"the adapter and the merged weights answer differently: {via_peft!r} vs {via_merged!r}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0] if args else "runs/dpo-example"), args[1:] or ["What is two plus three?",
                                                                     "What is seven plus one?"])
