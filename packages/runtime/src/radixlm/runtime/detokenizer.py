"""Tokenizer loading and incremental detokenization (torch-free)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

_REPLACEMENT = "\ufffd"


def load_tokenizer(path: str | Path) -> Any:
    """A Hugging Face tokenizer from a local directory (never downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


#: The transformers modules whose `decode` / `_decode` only call the Rust tokenizer's decode
#: (and clean-up, which the decoder never asks for).
_PLAIN_DECODE_MODULES = frozenset(
    {
        "transformers.tokenization_utils_base",
        "transformers.tokenization_utils_tokenizers",
        "transformers.tokenization_utils_fast",
    }
)


def backend_decode(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """The fast tokenizer's own `decode` (the `tokenizers` library's, special tokens kept), when
    `tokenizer.decode` would only call it: it skips the Python layers around it, which cost
    most of a short decode, and a stream decodes twice per token. None for a slow tokenizer or
    one whose class decodes its own way."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    cls = type(tokenizer)
    for name in ("decode", "_decode"):
        method = getattr(cls, name, None)
        if getattr(method, "__module__", None) not in _PLAIN_DECODE_MODULES:
            return None

    def decode(ids: list[int]) -> str:
        return str(backend.decode(ids, skip_special_tokens=False))

    return decode


class TextDecoder:
    """`decode(ids)` with SGLang/vLLM semantics for special tokens.

    `skip_special_tokens` drops the tokenizer's special tokens; otherwise, with
    `spaces_between_special_tokens`, a special token is separated from its neighbours by a space.
    Tokenization-space clean-up is never applied (it would break incremental decoding).
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._backend = backend_decode(tokenizer)

    def hidden_special_texts(self) -> tuple[str, ...]:
        """The texts of the special tokens this decoder leaves out of the text (none when it
        keeps them)."""
        if not self.skip_special_tokens:
            return ()
        tokens = getattr(self.tokenizer, "all_special_tokens", ()) or ()
        return tuple(str(t) for t in tokens if t)

    def raw(self, ids: Sequence[int]) -> str:
        """The text of `ids` with every special token written out."""
        return self._plain(ids)

    def _plain(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend(list(ids))
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def __call__(self, ids: Sequence[int]) -> str:
        special = self.special_ids
        if not special or special.isdisjoint(ids):
            return self._plain(ids)
        parts: list[str] = []
        run: list[int] = []
        for token in ids:
            if token not in special:
                run.append(token)
                continue
            if self.skip_special_tokens:
                continue
            if run:
                parts.append(self._plain(run))
                run = []
            parts.append(self._plain([token]))
        if run:
            parts.append(self._plain(run))
        separator = (
            " " if self.spaces_between_special_tokens and not self.skip_special_tokens else ""
        )
        return separator.join(parts)


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoded a few tokens at a time.

    Each `append` decodes only a short window: the tokens since the last settled point plus
    the ones before it (so merges and leading spaces come out as in a full decode). Text that
    ends in an incomplete UTF-8 character is held back until the character completes. `text`
    always equals the full decode of `ids` up to the held-back tail; `flush()` settles the rest.
    `text_end(k)` is how much of `text` the first `k` ids had settled.
    """

    def __init__(self, decoder: TextDecoder) -> None:
        self.decoder = decoder
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is settled in `text`
        self._ends: list[int] = []  # len(text) once each id was appended

    def text_end(self, num_ids: int) -> int:
        """Length of the part of `text` settled by the first `num_ids` ids (a prefix of
        their full decode; 0 for none)."""
        if num_ids <= 0 or not self._ends:
            return 0
        return min(self._ends[min(num_ids, len(self._ends)) - 1], len(self.text))

    def append(self, ids: Iterable[int]) -> str:
        """Add tokens; return the newly settled text (possibly empty)."""
        before = len(self.ids)
        self.ids.extend(ids)
        new = self._append()
        self._ends.extend([len(self.text)] * (len(self.ids) - before))
        return new

    def _append(self) -> str:
        if len(self.ids) == self._read:
            return ""
        window = self.ids[self._prefix :]
        before = self.decoder(self.ids[self._prefix : self._read])
        full = self.decoder(window)
        if full.endswith(_REPLACEMENT):
            return ""  # an incomplete character: wait for its remaining bytes
        if not full.startswith(before):
            # The window decodes differently in context (rare normalisations): redo it all.
            return self._resync()
        new = full[len(before) :]
        self.text += new
        self._prefix = self._read
        self._read = len(self.ids)
        return new

    def flush(self) -> str:
        """Settle everything, including a trailing incomplete character; return the new text."""
        if self._read == len(self.ids):
            return ""
        new = self._resync()
        if self._ends:
            self._ends[-1] = len(self.text)
        return new

    def rollback(self, num_tokens: int) -> None:
        """Drop the last `num_tokens` ids (text is recomputed from what remains)."""
        if num_tokens <= 0:
            return
        del self.ids[len(self.ids) - num_tokens :]
        del self._ends[len(self.ids) :]
        self.text = self.decoder(self.ids)
        if self.text.endswith(_REPLACEMENT):
            # Keep the settled point before an incomplete character, as `append` would.
            self.text = self.text.rstrip(_REPLACEMENT)
        self._read = len(self.ids)
        self._prefix = max(0, self._read - 4)
        self._ends = [min(end, len(self.text)) for end in self._ends]

    def _resync(self) -> str:
        full = self.decoder(self.ids)
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        self._read = len(self.ids)
        self._prefix = max(0, self._read - 4)
        return new
