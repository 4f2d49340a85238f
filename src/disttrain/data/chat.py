"""Chat and instruction records -> token ids plus a per-token loss mask, rendered by the tokenizer's own
chat template through transformers.

Chat records carry `messages` (a list of {role, content}); instruction records carry `prompt` and
`completion`. Only assistant turns (or the completion) carry loss. A template with `{% generation %}`
markers gives the mask itself (transformers' `return_assistant_tokens_mask`); without them each assistant
turn is found by rendering the conversation up to it (with the generation prompt) and up to its end, and
taking the difference: the characters in between carry loss, and so do the tokens that start there.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


class TemplateError(ValueError):
    """The chat template cannot give a loss mask (the message names what to fix)."""


def record_kind(record: dict) -> str | None:
    """'chat', 'instruction', or None for a record that is neither."""
    if isinstance(record.get("messages"), list):
        return "chat"
    if "prompt" in record and "completion" in record:
        return "instruction"
    return None


def has_chat_template(directory: str | Path) -> bool:
    """Whether a Hugging Face tokenizer directory ships a chat template (tokenizer_config.json or
    chat_template.jinja)."""
    return ChatRenderer(directory).template is not None


class ChatRenderer:
    """Renders records with the template of a Hugging Face tokenizer directory."""

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.directory = str(directory)
        self.tok = AutoTokenizer.from_pretrained(self.directory)
        try:
            self.template = self.tok.get_chat_template()
        except ValueError:  # transformers: "Cannot use chat template functions because ... not set"
            self.template = None
        self.markers = self.template is not None and GENERATION_MARKER.search(self.template) is not None
        self.how = "generation markers" if self.markers else "turn-by-turn difference"

    def encode(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, loss mask uint8) of one chat or instruction record."""
        if record_kind(record) == "chat":
            return self._chat([_message(m) for m in record["messages"]])
        prompt, completion = str(record["prompt"]), str(record["completion"])
        if self.template is not None:
            return self._chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}])
        return self._plain(prompt, completion)

    def prompt_ids(self, text: str) -> list[int]:
        """`text` as one user turn, followed by the template's generation prompt (for sampling)."""
        out = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def _chat(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        if self.template is None:
            raise TemplateError(f"--tokenizer={self.directory} has no chat template (tokenizer_config.json "
                                "'chat_template' or chat_template.jinja); chat records ('messages') need one")
        if self.markers:
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            return np.asarray(out["input_ids"], np.int64), np.asarray(out["assistant_masks"], np.uint8)
        text = self.tok.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) \
                if i else ""
            upto = self.tok.apply_chat_template(messages[:i + 1], tokenize=False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise TemplateError(f"the chat template of {self.directory} renders a conversation's start "
                                    "differently once later turns follow (e.g. it drops earlier turns' reasoning), "
                                    "so assistant turns cannot be found turn by turn; add {% generation %} ... "
                                    "{% endgeneration %} markers around assistant content")
            spans.append((len(before), len(upto)))
        return self._masked(text, spans)

    def _plain(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        """No template: prompt and completion as one text; the completion and an end token carry loss."""
        ids, mask = self._masked(prompt + completion, [(len(prompt), len(prompt) + len(completion))])
        if self.tok.eos_token_id is not None:
            ids, mask = np.append(ids, self.tok.eos_token_id), np.append(mask, 1).astype(np.uint8)
        return ids, mask

    def _masked(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.asarray([a for a, _ in enc["offset_mapping"]], np.int64)
        mask = np.zeros(len(starts), np.uint8)
        for lo, hi in spans:
            mask |= ((starts >= lo) & (starts < hi)).astype(np.uint8)
        return np.asarray(enc["input_ids"], np.int64), mask


def _message(m) -> dict:
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise ValueError(f"a message is {str(m)[:60]!r} (allowed: an object with 'role' and 'content')")
    return {"role": str(m["role"]), "content": "" if m["content"] is None else m["content"]}
