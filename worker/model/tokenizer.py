"""Tokenizers: bytes (presets, folders without tokenizer.json) or a Hugging Face tokenizer.json.

decode never raises on a cut in the middle of a UTF-8 character: the streaming engine decodes
what it has so far, and a half character shows as U+FFFD until its other bytes arrive.

token_bytes gives one token's own bytes, for logprobs (OpenAI's `bytes`): a byte-level BPE token's
bytes through GPT-2's byte-to-character table, a SentencePiece piece with "▁" as a space and
`<0xNN>` as its byte, a special token's text as it is written (`<|im_end|>`). Joined in order, the
bytes of a text's tokens decode to the text (special tokens aside).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Protocol

from .config import CheckpointError


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class ByteTokenizer:
    """Token id = byte value (0..255); ids from 256 up (end-of-text) decode to nothing."""

    def __init__(self, eos_token_id: int = 256):
        if eos_token_id < 256:
            raise ValueError(f"byte tokenizer: eos_token_id {eos_token_id} collides with a byte value")
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # bytes carry no special tokens

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""


class HFTokenizer:
    """A `tokenizer.json` through the tokenizers library (BPE, SentencePiece-converted, ...)."""

    def __init__(self, path_or_tokenizer, eos_token_id: int):
        """A tokenizer.json path, or a `tokenizers.Tokenizer` already built (from a GGUF file)."""
        from tokenizers import Tokenizer as _Tokenizer

        if isinstance(path_or_tokenizer, _Tokenizer):
            self._tok = path_or_tokenizer
        else:
            self._tok = _Tokenizer.from_file(str(path_or_tokenizer))
        self.eos_token_id = eos_token_id

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Special tokens the tokenizer's post-processor adds (e.g. Llama's BOS) are part of a prompt;
        # text that continues a sequence of token ids goes without them.
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        # Byte-level decoders replace incomplete UTF-8 with U+FFFD rather than failing.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes_of(int(token_id))

    @functools.cached_property
    def _bytes_of(self):
        """token id -> its bytes (memoized: a request's logprobs ask for the same tokens again and again)."""
        added = {i: t.content.encode() for i, t in self._tok.get_added_tokens_decoder().items()}
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        table = {c: b for b, c in _gpt2_byte_chars().items()}

        @functools.lru_cache(maxsize=1 << 16)
        def bytes_of(token_id: int) -> bytes:
            if token_id in added:
                return added[token_id]
            piece = self._tok.id_to_token(token_id)
            if piece is None:
                return b""
            if "ByteLevel" in kinds and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            if "ByteFallback" in kinds and (byte := _BYTE_PIECE.fullmatch(piece)):
                return bytes([int(byte.group(1), 16)])
            if "Replace" in kinds:  # SentencePiece: "▁" stands for a space
                return piece.replace("\u2581", " ").encode()
            return self._tok.decode([token_id], skip_special_tokens=False).encode()

        return bytes_of


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's table of byte -> the printable character a byte-level BPE writes it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def load_tokenizer(folder: str | Path, eos_token_id: int, vocab_size: int) -> Tokenizer:
    """tokenizer.json when the folder has one, else bytes (which need a vocab of at least 256 + eos)."""
    path = Path(folder) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path, eos_token_id)
    if vocab_size < 257 or eos_token_id < 256 or eos_token_id >= vocab_size:
        raise CheckpointError(
            f"{folder}: no tokenizer.json, and the byte tokenizer does not fit this model "
            f"(vocab_size={vocab_size}, eos_token_id={eos_token_id}; needs ids 0..255 for bytes and eos >= 256)")
    return ByteTokenizer(eos_token_id)
