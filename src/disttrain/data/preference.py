"""Preference records -> a pair of sequences (prompt + chosen, prompt + rejected), each with a mask that covers
its completion only, rendered by the tokenizer's chat template (data/chat.py) as fine-tuning data is.

The record conventions are those of Hugging Face's preference datasets (TRL's):
- explicit prompt: `{"prompt": ..., "chosen": ..., "rejected": ...}`, where the prompt is a string or a list of
  messages and each completion a string or a list of (assistant) messages;
- implicit prompt: `{"chosen": ..., "rejected": ...}` holding whole conversations (or whole texts) that share
  their prompt: the prompt is their longest common leading part (whole messages; for texts, characters, with a
  space at the cut moved into the completions);
- `messages` may stand for `prompt`.

The completion's tokens are those the template renders after the prompt and its generation prompt (its end of
turn included, as in fine-tuning): the mask starts where the rendered prompt ends. Without a chat template,
plain texts are joined and an end token carries loss after the completion, as instruction records are.
"""

from __future__ import annotations

import numpy as np

from disttrain.data.chat import ChatRenderer, TemplateError, _message


class RecordError(ValueError):
    """A preference record that cannot be a pair (the message names the record's key)."""


def is_preference(record) -> bool:
    return isinstance(record, dict) and "chosen" in record and ("rejected" in record or "prompt" in record
                                                                or "messages" in record)


def split_record(record: dict) -> tuple[object, object, object]:
    """(prompt, chosen, rejected), each a string or a list of messages; RecordError on a bad record."""
    if "rejected" not in record:
        raise RecordError("has 'chosen' but no 'rejected' (a preference record needs both)")
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record.get("prompt", record.get("messages"))
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, (str, list)):
            raise RecordError(f"'{key}' is {type(value).__name__} (allowed: a string or a list of messages)")
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise RecordError("'chosen' and 'rejected' differ in kind (allowed: both strings or both message lists)")
    if prompt is None:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected)
    elif isinstance(prompt, list) and isinstance(chosen, str):
        chosen, rejected = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    elif not isinstance(prompt, (str, list)):
        raise RecordError(f"'prompt' is {type(prompt).__name__} (allowed: a string or a list of messages)")
    if chosen == rejected:
        raise RecordError("'chosen' and 'rejected' are identical (a pair needs two different completions)")
    return prompt, chosen, rejected


def _implicit_prompt(chosen, rejected):
    """The shared leading part of two whole conversations (messages) or texts, and what follows it in each."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and n and chosen[n - 1] == " ":
        n -= 1  # the completion starts with its word's space
    if n == 0:
        raise RecordError("has no 'prompt' and 'chosen' and 'rejected' share no leading part to take it from "
                          "(allowed: an explicit 'prompt', or whole conversations that start alike)")
    return chosen[:n], chosen[n:], rejected[n:]


class PreferenceRenderer:
    """Renders pairs with the template of a Hugging Face tokenizer directory (ChatRenderer's)."""

    def __init__(self, chat: ChatRenderer):
        self.chat = chat

    def encode(self, record: dict) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """((chosen ids, mask), (rejected ids, mask)): int64 ids, uint8 masks over each completion."""
        prompt, chosen, rejected = split_record(record)
        return self._one(prompt, chosen, "chosen"), self._one(prompt, rejected, "rejected")

    def _one(self, prompt, completion, key: str) -> tuple[np.ndarray, np.ndarray]:
        chat = self.chat
        text = completion if isinstance(completion, str) else "".join(
            str(_message(m)["content"]) for m in completion)
        if not text.strip():
            raise RecordError(f"'{key}' is empty (a completion needs some text)")
        if isinstance(completion, list) or (chat.template is not None and isinstance(prompt, list)):
            head = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            messages = [_message(m) for m in (*head, *completion)]
            before = chat.tok.apply_chat_template([_message(m) for m in head], tokenize=False,
                                                  add_generation_prompt=True)
            return self._masked(chat.tok.apply_chat_template(messages, tokenize=False), before, key)
        if chat.template is not None:  # plain texts through the template: one user turn, one assistant turn
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            before = chat.tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
            return self._masked(chat.tok.apply_chat_template(messages, tokenize=False), before, key)
        return chat._plain(prompt, completion)

    def _masked(self, text: str, before: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        if not text.startswith(before):
            raise TemplateError(f"the chat template of {self.chat.directory} renders the prompt differently once a "
                                "completion follows, so the completion's tokens cannot be found")
        ids, mask = self.chat._masked(text, [(len(before), len(text))])
        if not mask.any():
            raise RecordError(f"'{key}' renders to no token after the prompt (an empty completion)")
        return ids, mask
