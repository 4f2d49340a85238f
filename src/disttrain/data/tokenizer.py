"""Tokenizers: raw UTF-8 bytes by default, or any Hugging Face `tokenizers` tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; byte 0 (never in text) doubles as end-of-document."""

    name = "byte"
    vocab_size = 256
    eos_id = 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8").replace(b"\x00", b"")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


def byte_level_tokenizer():
    """ByteTokenizer as a `tokenizers` Tokenizer, so that exports of byte-level runs load with AutoTokenizer: token id
    b is byte b. A BPE with no merges over the 256 characters of the ByteLevel pre-tokenizer's alphabet (GPT-2's
    byte-to-character table, spelled out below because `tokenizers` exposes the alphabet only as an unordered set)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers

    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = {}, 0
    for b in range(256):
        chars[b] = chr(b) if b in printable else chr(256 + shifted)
        shifted += b not in printable
    tok = _Tok(models.BPE({c: b for b, c in chars.items()}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok, chars[ByteTokenizer.eos_id]


class HFTokenizer:
    """A `tokenizers` tokenizer.json (BPE, WordPiece, ...), e.g. one written by `prepare-data`."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        self.name = str(self.path)
        self._tok = _Tok.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((self._tok.token_to_id(t) for t in EOS_CANDIDATES
                            if self._tok.token_to_id(t) is not None), None)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class ChatTokenizer(HFTokenizer):
    """The tokenizer of a chat shard directory (prepare-data saved it whole, template included): a sample
    prompt is sent as a user turn through the chat template."""

    def __init__(self, directory: str | Path):
        super().__init__(Path(directory) / "tokenizer.json")
        self.directory = Path(directory)

    def chat_prompt(self, text: str) -> list[int]:
        from disttrain.data.chat import ChatRenderer

        renderer = ChatRenderer(self.directory)
        return renderer.prompt_ids(text) if renderer.template is not None else self.encode_batch([text])[0]

    @property
    def stop_id(self) -> int | None:
        """Where a sample ends: the tokenizer's own end token (often the end of an assistant turn)."""
        from disttrain.data.chat import ChatRenderer

        own = ChatRenderer(self.directory).tok.eos_token_id
        return self.eos_id if own is None else own


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte` or a path to a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
