"""`disttrain prepare-data` on preference records: each pair written as two documents in a row (chosen, then
rejected) of the same split, each with its completion mask, and the statistics to check before a long run.

A sequence longer than --seq-len + 1 tokens is cut there (its end token kept): its completion's tail is lost and
the pair counted as truncated. A pair whose prompt leaves no completion token inside --seq-len is skipped and
counted. A bad record (no 'rejected', identical completions, an empty one) stops the run with one line naming it:
a dataset with such records is usually read with the wrong keys.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from jinja2 import TemplateError as JinjaError

from disttrain.data.chat import ChatRenderer
from disttrain.data.preference import PreferenceRenderer, RecordError, is_preference
from disttrain.data.readers import first_record, iter_records
from disttrain.data.shards import ShardWriter, is_val_document
from disttrain.data.tokenizer import HFTokenizer


def is_preference_input(paths: list[Path]) -> bool:
    return is_preference(first_record(paths))


def _fit(ids: np.ndarray, mask: np.ndarray, eos: int | None, limit: int):
    """(ids, mask, cut) of one sequence ended by the end token and cut to `limit` tokens; None when no completion
    token is left inside."""
    mask = mask.copy()
    mask[0] = 0  # nothing before it: never a target
    if eos is not None and ids[-1] != eos:
        ids, mask = np.append(ids, eos), np.append(mask, 0).astype(np.uint8)
    cut = len(ids) > limit
    if cut:
        ids, mask = ids[:limit].copy(), mask[:limit].copy()
        if eos is not None:
            ids[-1], mask[-1] = eos, 0
    return (ids, mask, cut) if mask.any() else None


def write_preference(paths: list[Path], out: Path, tokenizer: str, val_fraction: float, seq_len: int) -> dict:
    """Render, mask and write every pair into `out`; returns meta.json's content (with "preference" stats)."""
    if tokenizer in ("byte", "bpe") or not (Path(tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer={tokenizer}: preference records are rendered by a Hugging Face tokenizer "
                         "directory (tokenizer.json, and tokenizer_config.json with its chat template)")
    chat = ChatRenderer(tokenizer)
    renderer = PreferenceRenderer(chat)
    chat.tok.save_pretrained(out)  # training renders sample prompts with the same template
    eos = HFTokenizer(out / "tokenizer.json").eos_id
    writer = ShardWriter(out, len(chat.tok), "tokenizer.json", eos, masks=True)
    counts: Counter = Counter()
    try:
        for where, record in iter_records(paths):
            counts["read"] += 1
            if not is_preference(record):
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{where}: not a preference record (it has: {keys}); allowed: {{prompt, chosen, "
                                 "rejected}, or {chosen, rejected} whole conversations sharing their prompt")
            try:
                pair = renderer.encode(record)
            except RecordError as exc:
                raise ValueError(f"{where}: {exc}") from None
            except JinjaError as exc:
                raise ValueError(f"{where}: the chat template of --tokenizer={tokenizer} refuses this record "
                                 f"({str(exc).splitlines()[0]})") from None
            fitted = [_fit(ids, mask, eos, seq_len + 1) for ids, mask in pair]
            if any(f is None for f in fitted):
                counts["skipped"] += 1
                continue
            counts["truncated"] += any(cut for _, _, cut in fitted)
            counts["eos_inside"] += eos is not None and any(bool(np.any(ids[:-1] == eos)) for ids, _, _ in fitted)
            split = "val" if is_val_document(counts["written"], val_fraction) else "train"
            counts["written"] += 1
            for (ids, mask, _), side in zip(fitted, ("chosen", "rejected")):
                writer.append(split, ids, mask)
                counts["tokens"] += len(ids)
                counts[f"{side}_tokens"] += int(mask.sum())
        if counts["read"] == 0:
            raise ValueError("the inputs hold no records")
        if writer.meta["splits"]["train"] == 0:
            raise ValueError(f"inputs {', '.join(map(str, paths))}: no pair left for training ({counts['written']} "
                             f"written, {counts['skipped']} skipped: prompts longer than --seq-len {seq_len}?)")
    except BaseException:
        writer.abort()
        raise
    writer.meta["preference"] = {"seq_len": seq_len, "records": counts["read"], "written": counts["written"],
                                 "skipped": counts["skipped"], "truncated": counts["truncated"],
                                 "tokens": counts["tokens"], "chosen_tokens": counts["chosen_tokens"],
                                 "rejected_tokens": counts["rejected_tokens"],
                                 "eos_inside": counts["eos_inside"], "mask_from": "the chat template"
                                 if chat.template is not None else "joined texts (no chat template)"}
    writer.close()
    return writer.meta


def describe(meta: dict) -> list[str]:
    """The lines prepare-data prints about preference data."""
    p = meta["preference"]
    written = max(p["written"], 1)
    lines = [f"{p['records']:,} preference records read, {p['written']:,} pairs written; completions from "
             f"{p['mask_from']}",
             f"completion tokens per pair: chosen {p['chosen_tokens'] / written:.1f}, rejected "
             f"{p['rejected_tokens'] / written:.1f} on average"]
    if p["truncated"]:
        lines.append(f"warning: {p['truncated']:,} pairs were longer than --seq-len {p['seq_len']} and were cut to "
                     "it (the end of their completions carries no loss)")
    if p["skipped"]:
        lines.append(f"warning: {p['skipped']:,} pairs were skipped: the prompt leaves no completion token inside "
                     f"--seq-len {p['seq_len']}")
    if p.get("eos_inside"):
        lines.append(f"warning: {p['eos_inside']:,} pairs hold the end-of-document token inside (the chat template "
                     "ends turns with it): data.packing=true cannot keep them apart, train them with packing off")
    return lines
