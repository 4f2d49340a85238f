"""`disttrain prepare-data` on chat and instruction records: shards that keep, per token, whether it
carries loss (data/chat.py renders them), and the statistics to check before a long run.

Each conversation is stored whole, followed by the end-of-document token (which carries no loss), so
training can pad it alone into a sequence or pack several with document masking. A conversation longer
than --seq-len + 1 tokens is cut there (its end token kept) and counted; one left with no token that
carries loss is skipped and counted. A dataset whose mask is all zeros or all ones is refused: that is a
chat-template problem, not data to train on.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from jinja2 import TemplateError as JinjaError
from jinja2 import TemplateSyntaxError

from disttrain.data.chat import ChatRenderer, record_kind
from disttrain.data.readers import first_record, iter_records
from disttrain.data.shards import ShardWriter, is_val_document
from disttrain.data.tokenizer import HFTokenizer


def is_chat_input(paths: list[Path]) -> bool:
    """Whether the first record of the inputs is a chat or instruction record."""
    record = first_record(paths)
    return isinstance(record, dict) and record_kind(record) is not None


def write_chat(paths: list[Path], out: Path, tokenizer: str, val_fraction: float, seq_len: int) -> dict:
    """Render, mask and write every record into `out`; returns meta.json's content (with "chat" stats)."""
    if tokenizer in ("byte", "bpe") or not (Path(tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer={tokenizer}: chat and instruction records are rendered by a Hugging Face "
                         "tokenizer directory (tokenizer.json, and tokenizer_config.json with its chat template)")
    renderer = ChatRenderer(tokenizer)
    renderer.tok.save_pretrained(out)  # training renders sample prompts with the same template
    eos = HFTokenizer(out / "tokenizer.json").eos_id
    writer = ShardWriter(out, len(renderer.tok), "tokenizer.json", eos, masks=True)
    limit = seq_len + 1  # a sequence of seq_len inputs holds seq_len + 1 tokens
    counts: Counter = Counter()
    shares: list[float] = []
    try:
        for where, record in iter_records(paths):
            kind = record_kind(record) if isinstance(record, dict) else None
            if kind is None:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{where}: a record with neither 'messages' nor 'prompt'/'completion' (it has: "
                                 f"{keys}); allowed: chat records {{messages: [{{role, content}}, ...]}} or "
                                 "instruction records {prompt, completion}")
            counts[kind] += 1
            try:
                ids, mask = renderer.encode(record)
            except TemplateSyntaxError as exc:
                raise ValueError(f"--tokenizer={tokenizer}: its chat template does not parse ({exc})") from None
            except JinjaError as exc:  # e.g. raise_exception() on a role order the template refuses
                raise ValueError(f"{where}: the chat template of --tokenizer={tokenizer} refuses this record "
                                 f"({str(exc).splitlines()[0]})") from None
            mask = mask.copy()
            if len(ids):
                mask[0] = 0  # nothing before it: never a target
            counts["maskable"] += max(0, len(ids) - 1)
            counts["answer_tokens"] += int(mask.sum())
            if eos is not None and np.any(ids[:-1] == eos):
                counts["eos_inside"] += 1
            if eos is not None and (not len(ids) or ids[-1] != eos):
                ids, mask = np.append(ids, eos), np.append(mask, 0).astype(np.uint8)
            if len(ids) > limit:
                counts["truncated"] += 1
                ids, mask = ids[:limit].copy(), mask[:limit].copy()
                if eos is not None:
                    ids[-1], mask[-1] = eos, 0
            if not mask.any():
                counts["skipped"] += 1
                continue
            index = counts["written"]
            counts["written"] += 1
            writer.append("val" if is_val_document(index, val_fraction) else "train", ids, mask)
            counts["tokens"] += len(ids)
            counts["loss_tokens"] += int(mask.sum())
            shares.append(float(mask.mean()))
        _refuse_degenerate(counts, renderer, tokenizer)
        if writer.meta["splits"]["train"] == 0:
            raise ValueError(f"inputs {', '.join(map(str, paths))}: no record left for training "
                             f"({counts['written']} written, all to validation; lower --val-fraction)")
    except BaseException:
        writer.abort()
        raise
    q = np.quantile(shares, [0.0, 0.5, 1.0]) if shares else np.zeros(3)
    writer.meta["chat"] = {"mask_from": renderer.how, "seq_len": seq_len, "chat_records": counts["chat"],
                           "instruction_records": counts["instruction"], "written": counts["written"],
                           "skipped": counts["skipped"], "truncated": counts["truncated"],
                           "eos_inside": counts["eos_inside"], "tokens": counts["tokens"],
                           "loss_tokens": counts["loss_tokens"], "loss_share": counts["loss_tokens"] / counts["tokens"],
                           "loss_share_per_record": {"min": float(q[0]), "median": float(q[1]), "max": float(q[2])}}
    writer.close()
    return writer.meta


def _refuse_degenerate(counts: Counter, renderer: ChatRenderer, tokenizer: str) -> None:
    """A mask all zeros or all ones over the whole dataset is a template problem: one line saying which."""
    records = counts["chat"] + counts["instruction"]
    if records == 0:
        raise ValueError("the inputs hold no records")
    if counts["answer_tokens"] == 0:
        raise ValueError(f"--tokenizer={tokenizer}: the loss mask is all zeros (no record has a token that carries "
                         f"loss, mask from {renderer.how}): the chat template marks no assistant tokens; its "
                         "{% generation %} markers must wrap the assistant content, or the records have no "
                         "assistant turns")
    if counts["answer_tokens"] >= counts["maskable"]:
        raise ValueError(f"--tokenizer={tokenizer}: the loss mask is all ones (every token carries loss, mask from "
                         f"{renderer.how}): the chat template's {{% generation %}} markers wrap whole conversations, "
                         "so prompts would be trained on; they must wrap only the assistant content")


def describe(meta: dict) -> list[str]:
    """The lines prepare-data prints about chat data: what carries loss, what was cut or skipped."""
    c = meta["chat"]
    per = c["loss_share_per_record"]
    read = c["chat_records"] + c["instruction_records"]
    lines = [f"{read:,} records read ({c['chat_records']:,} chat, {c['instruction_records']:,} instruction), "
             f"{c['written']:,} written; mask from the chat template's {c['mask_from']}",
             f"loss on {c['loss_share']:.1%} of tokens ({c['loss_tokens']:,} of {c['tokens']:,}); per record: "
             f"min {per['min']:.1%}, median {per['median']:.1%}, max {per['max']:.1%}"]
    if c["truncated"]:
        lines.append(f"warning: {c['truncated']:,} records were longer than --seq-len {c['seq_len']} and were cut "
                     "to it (their later turns carry no loss)")
    if c["skipped"]:
        lines.append(f"warning: {c['skipped']:,} records were skipped: no token carrying loss (no assistant turn, "
                     "or none left after the cut)")
    if c["eos_inside"]:
        lines.append(f"warning: {c['eos_inside']:,} records hold the end-of-document token inside (the chat template "
                     "ends turns with it): data.packing=true cannot keep them apart, train them with packing off")
    return lines
