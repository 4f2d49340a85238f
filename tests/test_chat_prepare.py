"""prepare-data on chat and instruction records: rendered by the tokenizer's own chat template, masks equal
to transformers' assistant masks (from generation markers, or turn by turn without them), first-fit packing,
the statistics it prints, its input formats, and bad input refused in one line with nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from chat_tokenizer import naive_first_fit, prepare, records, reference_masks, save_tokenizers, template


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return save_tokenizers(tmp_path_factory.mktemp("tok"))


def test_turn_by_turn_masks_equal_transformers_generation_masks(tokenizers):
    """A template without {% generation %} markers: rendering turn by turn finds the same assistant tokens
    as transformers finds from the markers."""
    from disttrain.data.chat import ChatRenderer

    renderer = ChatRenderer(tokenizers["plain"])
    assert renderer.how == "turn-by-turn difference"
    for (ids, mask), record in zip(reference_masks(tokenizers["markers"], records()), records()):
        ours = renderer.encode(record)
        assert np.array_equal(ours[0], ids) and np.array_equal(ours[1], mask)


def test_instruction_records_without_a_template_train_on_the_completion(tokenizers):
    from transformers import AutoTokenizer

    from disttrain.data.chat import ChatRenderer

    ids, mask = ChatRenderer(tokenizers["none"]).encode({"prompt": "Spell 11:", "completion": " one one"})
    tok = AutoTokenizer.from_pretrained(tokenizers["none"])
    assert tok.decode(ids) == "Spell 11: one one<|endoftext|>"
    assert tok.decode(ids[mask == 1]) == " one one<|endoftext|>"


def test_first_fit_packs_like_the_textbook_rule():
    from disttrain.data.chat_samples import first_fit

    rng = np.random.default_rng(0)
    for capacity, n in [(129, 200), (16, 50), (7, 1), (64, 333)]:
        lengths = rng.integers(1, capacity + 1, n)
        assert first_fit(lengths, capacity) == naive_first_fit(lengths.tolist(), capacity)


def test_prepare_data_reports_the_mask_share_truncation_and_skipped_records(tmp_path, tokenizers):
    data = records() + [{"messages": [{"role": "user", "content": "no answer here"}]}]
    code, out, err = prepare(tmp_path, data, tokenizers["markers"], "--seq-len", "64", "--val-fraction", "0")
    assert code == 0, err
    ref = reference_masks(tokenizers["markers"], records())
    # cut at 65 tokens including the end token; the rest of each record plus its end token counted
    cut = [(ids[:64], mask[:64]) if len(ids) + 1 > 65 else (ids, mask) for ids, mask in ref]
    loss = sum(int(m[1:].sum()) for _, m in cut)
    tokens = sum(len(ids) + 1 for ids, _ in cut)
    assert f"loss on {loss / tokens:.1%} of tokens ({loss:,} of {tokens:,})" in out
    assert f"{len(data)} records read (21 chat, 4 instruction), {len(records())} written" in out
    truncated = sum(len(ids) + 1 > 65 for ids, _ in ref)
    assert truncated > 0 and f"warning: {truncated} records were longer than --seq-len 64" in err
    assert "warning: 1 records were skipped: no token carrying loss" in err


def test_parquet_and_saved_datasets_give_the_jsonl_shards(tmp_path, tokenizers):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from disttrain.cli import main

    data = records(12)
    chats = [r for r in data if "messages" in r]  # one schema per file, as such datasets ship
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "c.parquet")
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "c_saved"))
    written = {}
    for name in ("c.jsonl", "c.parquet", "c_saved"):
        main(["prepare-data", str(tmp_path / name), "--out", str(tmp_path / f"out_{name}"), "--tokenizer",
              str(tokenizers["plain"]), "--val-fraction", "0.25"])
        written[name] = [(tmp_path / f"out_{name}" / f).read_bytes() for f in
                         ("train.bin", "train.mask.bin", "train.ends.npy", "val.bin", "val.mask.bin")]
    assert written["c.jsonl"] == written["c.parquet"] == written["c_saved"]
    ref = [r for i, r in enumerate(reference_masks(tokenizers["markers"], chats)) if i % 4 != 3]
    mask = np.frombuffer(written["c.jsonl"][1], np.uint8)
    assert int(mask.sum()) == sum(int(m[1:].sum()) for _, m in ref)


BROKEN = {  # a template whose markers wrap nothing, or the whole conversation
    "zeros": template(False).replace("{{ m['content'] }}<|im_end|>{% else %}",
                                     "{% generation %}{% endgeneration %}{{ m['content'] }}<|im_end|>{% else %}"),
    "ones": "{% generation %}" + template(False) + "{% endgeneration %}",
    "refuses": "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
               + template(False),
}


@pytest.mark.parametrize("case,expected", [
    ("neither", "row 3: a record with neither 'messages' nor 'prompt'/'completion' (it has: text)"),
    ("first neither", "records.jsonl:1 has no 'text' field (use --text-key); chat and instruction records need "
                      "'messages', or 'prompt' and 'completion'"),
    ("no template", "has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); chat "
                    "records ('messages') need one"),
    ("zeros", "the loss mask is all zeros"),
    ("ones", "the loss mask is all ones (every token carries loss"),
    ("refuses", "records.jsonl:2: the chat template of --tokenizer="),
])
def test_bad_chat_input_is_one_line_and_writes_nothing(case, expected, tmp_path, tokenizers):
    data, tok = records(4), tokenizers["markers"]
    if case == "neither":
        data = data[:2] + [{"text": "plain"}] + data[2:]
    elif case == "first neither":
        data = [{"question": r.get("prompt", "")} for r in data]
    elif case == "no template":
        tok = tokenizers["none"]
    else:
        from transformers import AutoTokenizer

        broken = AutoTokenizer.from_pretrained(tok)
        broken.chat_template = BROKEN[case]
        tok = tmp_path / case
        broken.save_pretrained(tok)
    code, out, err = prepare(tmp_path, data, tok)
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected.replace("row 3", "") in err, err
    if case == "neither":
        assert "records.jsonl:3: a record" in err
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_packing_is_refused_where_conversations_cannot_be_kept_apart(tmp_path, tokenizers):
    """Packed conversations are kept apart at the end-of-document token: a template that ends turns with it
    gets a warning from prepare-data and a one-line refusal of data.packing, and of data.padding=none, which
    packs each micro-batch (text shards get one too)."""
    from transformers import AutoTokenizer

    from disttrain.config.load import load_config
    from disttrain.core.errors import UserError
    from disttrain.config.resolve import resolve_run
    from helpers import DEBUG_CONFIG

    tok = AutoTokenizer.from_pretrained(tokenizers["markers"])
    tok.chat_template = template(True).replace("<|im_end|>", "<|endoftext|>")
    tok.save_pretrained(tmp_path / "eos_turns")
    code, _, err = prepare(tmp_path, records(6), tmp_path / "eos_turns", "--val-fraction", "0")
    assert code == 0 and "warning: 6 records hold the end-of-document token inside" in err, err
    (tmp_path / "t.txt").write_text("some text\n\nmore text\n")
    from disttrain.cli import main

    main(["prepare-data", str(tmp_path / "t.txt"), "--out", str(tmp_path / "text"), "--val-fraction", "0"])
    for source, expected in [(tmp_path / "out", "6 conversations of"), (tmp_path / "text", "is not chat data")]:
        for setting, instead in (("data.packing=true", "data.packing=false"), ("data.padding=none",
                                                                             "data.padding=longest")):
            cfg = load_config(DEBUG_CONFIG, [f"data.source={source}", setting, "model.vocab_size=384"])
            with pytest.raises(UserError, match=rf"^{setting}: .*{expected}.*{instead}\)$"):
                resolve_run(cfg, 1, "cpu")
        resolve_run(load_config(DEBUG_CONFIG, [f"data.source={source}", "model.vocab_size=384"]), 1, "cpu")


# --- training: the loss over the answers, against transformers, and on every layout ----------------------
