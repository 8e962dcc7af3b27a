"""TokenizerInfo: a vocabulary as bytes, stop tokens and an exact encoder, built locally."""

from __future__ import annotations

import bisect
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

VocabType = Literal["byte_level", "byte_fallback", "raw"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # SentencePiece's "▁" stands for a space
# An anchor put before text that must not get the prefix space a SentencePiece tokenizer adds.
_ANCHOR = "\n"
_ENCODE_CACHE = 8192


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-printable-character map, inverted (character -> byte)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _decode_token(token: str, vocab_type: VocabType) -> bytes:
    if vocab_type == "byte_level":
        if all(c in _BYTE_LEVEL for c in token):
            return bytes(_BYTE_LEVEL[c] for c in token)
        return token.encode("utf-8")
    if vocab_type == "byte_fallback":
        match = _BYTE_TOKEN.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
    return token.replace(_SPIECE_SPACE, " ").encode("utf-8")


def _detect_vocab_type(tokenizer: Any, vocab: dict[str, int]) -> VocabType:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        described = json.dumps(json.loads(backend.to_str()).get("decoder") or {})
        if '"ByteLevel"' in described:
            return "byte_level"
        if '"ByteFallback"' in described:
            return "byte_fallback"
        if '"Metaspace"' in described or _SPIECE_SPACE in described:
            return "raw"
    if "<0x0A>" in vocab:
        return "byte_fallback"
    if "Ġ" in vocab or "Ċ" in vocab:
        return "byte_level"
    return "raw"


class TokenizerInfo:
    """What grammar backends need to know about a tokenizer, backend-neutral and immutable.

    - `vocab_size`: the model's vocabulary size (the bitmask width); ids the tokenizer does not
      define (padding of the model's embedding) are never allowed.
    - `token_bytes[i]`: the bytes token `i` stands for, or None for special and undefined ids
      (never allowed inside a grammar; stop tokens are handled apart).
    - `stop_token_ids`: the tokens that end a generation where the grammar allows it to end.
    - `add_prefix_space`: the tokenizer puts a space before the text it encodes (SentencePiece).

    Build it with `from_hf` (a local Hugging Face tokenizer) or `from_vocab` (any vocabulary).
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes | None],
        *,
        stop_token_ids: Iterable[int],
        vocab_type: VocabType = "raw",
        add_prefix_space: bool = False,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        self._token_bytes: tuple[bytes | None, ...] = tuple(b if b else None for b in token_bytes)
        self._stop = tuple(dict.fromkeys(int(i) for i in stop_token_ids))
        if not self._stop:
            raise ValueError("TokenizerInfo needs at least one stop token id (the EOS token)")
        for i in self._stop:
            if not 0 <= i < len(self._token_bytes):
                raise ValueError(f"stop token id {i} is outside the vocabulary")
        self.vocab_type: VocabType = vocab_type
        self.add_prefix_space = add_prefix_space
        self._encode = encode
        self._anchor_ids: list[int] | None = None
        self._sorted: tuple[list[bytes], list[int]] | None = None
        self._extensions: dict[int, tuple[list[int], list[int]]] = {}
        self._encoded: OrderedDict[str, list[int] | None] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    @property
    def token_bytes(self) -> tuple[bytes | None, ...]:
        return self._token_bytes

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def can_encode(self) -> bool:
        """Whether an encoder was given (needed to retokenize jump-forward text)."""
        return self._encode is not None

    @classmethod
    def from_hf(
        cls,
        tokenizer: Any,
        vocab_size: int | None = None,
        *,
        stop_token_ids: Iterable[int] | None = None,
    ) -> TokenizerInfo:
        """From a local Hugging Face tokenizer (byte-level BPE, SentencePiece with or without
        byte fallback, or plain vocabularies). `vocab_size` is the model's (its lm_head rows)
        when it differs from the tokenizer's; stop tokens default to the EOS token. Nothing is
        downloaded."""
        vocab: dict[str, int] = tokenizer.get_vocab()
        size = max(len(vocab), max(vocab.values(), default=-1) + 1)
        vocab_size = size if vocab_size is None else int(vocab_size)
        vocab_type = _detect_vocab_type(tokenizer, vocab)
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
        special |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
        table: list[bytes | None] = [None] * vocab_size
        for token, i in vocab.items():
            if i >= vocab_size or i in special:
                continue
            if i in added:  # added tokens hold their text as is, not in the vocabulary's code
                table[i] = str(getattr(added[i], "content", token)).encode("utf-8")
            else:
                table[i] = _decode_token(token, vocab_type)
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = eos if isinstance(eos, list) else [eos]

        fast = getattr(tokenizer, "backend_tokenizer", None)

        def encode(text: str) -> list[int]:
            if fast is not None:  # the Rust tokenizer itself: ~10x less overhead per call
                return list(fast.encode(text, add_special_tokens=False).ids)
            out = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
            return list(out["input_ids"])

        info = cls(table, stop_token_ids=stop_token_ids, vocab_type=vocab_type, encode=encode)
        info.add_prefix_space = info._detect_prefix_space()
        return info

    @classmethod
    def from_vocab(
        cls,
        tokens: Sequence[bytes | str | None],
        *,
        stop_token_ids: Iterable[int],
        vocab_size: int | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> TokenizerInfo:
        """From decoded tokens (bytes, or str taken as UTF-8; None for special ids). Without
        `encode` jump-forward has no tokenizer to retokenize with and stays off."""
        table: list[bytes | None] = [t.encode("utf-8") if isinstance(t, str) else t for t in tokens]
        if vocab_size is not None:
            table = (table + [None] * vocab_size)[:vocab_size]
        info = cls(table, stop_token_ids=stop_token_ids, encode=encode)
        info.add_prefix_space = info._detect_prefix_space()
        return info

    def _detect_prefix_space(self) -> bool:
        if self._encode is None:
            return False
        return self.decode_bytes(self._encode("a")).startswith(b" ")

    def decode_bytes(self, token_ids: Iterable[int]) -> bytes:
        """The bytes of ordinary tokens joined (special tokens contribute nothing)."""
        table = self._token_bytes
        return b"".join(table[i] or b"" for i in token_ids if 0 <= i < len(table))

    def encode_exact(self, text: str) -> list[int] | None:
        """The tokenizer's tokens for `text` as a piece of running output (no prefix space, no
        special tokens), or None when they do not spell `text` back exactly or there is no
        encoder. Recent answers are remembered: forced JSON keys recur across requests."""
        if self._encode is None:
            return None
        with self._lock:
            if text in self._encoded:
                self._encoded.move_to_end(text)
                found = self._encoded[text]
                return None if found is None else list(found)
        ids = self._encode_uncached(text)
        with self._lock:
            self._encoded[text] = ids
            if len(self._encoded) > _ENCODE_CACHE:
                self._encoded.popitem(last=False)
        return None if ids is None else list(ids)

    def _encode_uncached(self, text: str) -> list[int] | None:
        assert self._encode is not None
        if not self.add_prefix_space:
            ids = self._encode(text)
        else:
            if self._anchor_ids is None:
                self._anchor_ids = self._encode(_ANCHOR)
            anchored = self._encode(_ANCHOR + text)
            if anchored[: len(self._anchor_ids)] != self._anchor_ids:
                return None
            ids = anchored[len(self._anchor_ids) :]
        if any(not 0 <= i < self.vocab_size or self._token_bytes[i] is None for i in ids):
            return None
        return ids if self.decode_bytes(ids) == text.encode("utf-8") else None

    def extensions(self, token_id: int, longer_than: int = 0) -> list[int]:
        """Ordinary tokens whose bytes start with token `token_id`'s bytes and are longer than
        it and than `longer_than` bytes; longest first."""
        found = self._extensions.get(token_id)
        if found is None:
            table = self._token_bytes
            ids = sorted(self._find_extensions(token_id), key=lambda t: -len(table[t] or b""))
            found = self._extensions[token_id] = (ids, [-len(table[t] or b"") for t in ids])
        ids, negative_lengths = found
        return ids[: bisect.bisect_left(negative_lengths, -longer_than)]

    def tokens_starting_with(self, prefix: bytes) -> list[int]:
        """Ordinary tokens whose bytes start with `prefix` (all of them for b"")."""
        keys, ids = self._sorted_vocab()
        start = bisect.bisect_left(keys, prefix)
        # Every key with the prefix sorts before the prefix's successor (its last byte below
        # 0xff raised by one); a prefix of 0xff bytes only is followed by the end.
        head = prefix.rstrip(b"\xff")
        if not head:
            return ids[start:] if prefix else list(ids)
        end = bisect.bisect_left(keys, head[:-1] + bytes([head[-1] + 1]), start)
        return ids[start:end]

    def _find_extensions(self, token_id: int) -> list[int]:
        prefix = self._token_bytes[token_id]
        if prefix is None:
            return []
        table = self._token_bytes
        return [t for t in self.tokens_starting_with(prefix) if table[t] != prefix]

    def _sorted_vocab(self) -> tuple[list[bytes], list[int]]:
        if self._sorted is None:
            with self._lock:
                if self._sorted is None:
                    pairs = sorted((b, i) for i, b in enumerate(self._token_bytes) if b is not None)
                    self._sorted = ([b for b, _ in pairs], [i for _, i in pairs])
        return self._sorted

    def __repr__(self) -> str:
        return (
            f"TokenizerInfo(vocab_size={self.vocab_size}, vocab_type={self.vocab_type!r}, "
            f"stop_token_ids={list(self._stop)}, add_prefix_space={self.add_prefix_space})"
        )
