"""A prompt's length in characters against the context, checked before it is tokenized.

Tokenizing megabytes of text takes seconds to minutes; a text longer than
`context_length * max_token_chars(tokenizer)` characters cannot fit in the context whatever its
tokens, so it is refused at once. Torch-free, and duck-typed on a Hugging Face tokenizer.

Why the bound holds. Tokenization normalizes the text, pre-tokenizes it and cuts it into pieces
of the vocabulary; every token covers at most as many characters of the normalized text as its
piece has:

- byte-level BPE (GPT-2, Llama 3, Qwen): each piece character stands for one byte of UTF-8, and a
  character is at least one byte, so a piece of k characters covers at most k characters;
- sentencepiece-style BPE or Unigram (Llama 2, Mistral, Gemma): a piece is the text it covers
  with spaces written as U+2581; byte-fallback pieces (`<0xE2>`) cover one byte;
- added and special tokens cover their own content.

So a text of n normalized characters needs at least n / (longest piece) tokens. A normalizer
that composes characters (NFC, NFKC) can shrink a text, by at most `NFC_MAX_COMPOSED`
characters into one, and a `Replace` of a longer string by a shorter one by their ratio; the
bound is multiplied by that. Where a text can shrink without limit the bound does not hold, and
`max_token_chars` says UNBOUNDED (nothing is refused): normalizers that drop characters
(`Strip`, `StripAccents`, BERT's, sentencepiece's precompiled maps, regex replacements),
pre-tokenizers that drop whitespace, models whose one unknown token stands for a whole run or
word (WordPiece, WordLevel, Unigram or fused-unknown BPE without byte fallback), added tokens
that swallow the whitespace beside them (`lstrip` / `rstrip`), and tokenizers whose pipeline
cannot be read (slow tokenizers, stand-ins without `backend_tokenizer`).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from radixlm.sampling.errors import InvalidRequest

#: What `max_token_chars` returns when no bound holds; `check_text_fits` refuses nothing then.
UNBOUNDED = sys.maxsize

#: The most characters NFC or NFKC compose into one: U+1F82 (GREEK SMALL LETTER ALPHA WITH
#: PSILI AND VARIA AND YPOGEGRAMMENI) is alpha and three combining marks. A unit test recomputes
#: it from Python's Unicode tables.
NFC_MAX_COMPOSED = 4

# Normalizers after which a text has at least as many characters as before.
_GROWING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
# Pre-tokenizers that keep every character (they split, map bytes, or write spaces as U+2581).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits"})


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of input text one token of `tokenizer` can stand for, or UNBOUNDED.

    `tokenizer` is a Hugging Face fast tokenizer (anything with `get_vocab()` and a
    `backend_tokenizer` whose `to_str()` is the tokenizer.json text); None and other objects
    give UNBOUNDED. The value is the longest piece of the vocabulary, added and special tokens
    included, times what the normalizer can shrink a text by (see the module docstring for
    why it holds and where it does not). It reads the whole vocabulary (a few hundred
    milliseconds for 150,000 pieces): compute it once per tokenizer, at startup, and keep it.
    """
    if tokenizer is None or not callable(getattr(tokenizer, "get_vocab", None)):
        return UNBOUNDED
    backend = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if not callable(to_str):
        return UNBOUNDED
    spec = json.loads(to_str())
    if not isinstance(spec, dict):
        return UNBOUNDED
    added = [t for t in spec.get("added_tokens") or [] if isinstance(t, dict)]
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return UNBOUNDED
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if (
        shrink is None
        or not _pre_tokenizer_keeps(spec.get("pre_tokenizer"))
        or not _model_bounded(spec.get("model"))
    ):
        return UNBOUNDED
    pieces = [str(piece) for piece in tokenizer.get_vocab()]
    pieces += [str(t.get("content", "")) for t in added]
    longest = max((len(piece) for piece in pieces), default=0)
    return math.ceil(longest * shrink) if longest else UNBOUNDED


def check_text_fits(text: str | int, context_length: int, max_token_chars: int, field: str) -> None:
    """Raise InvalidRequest(field, ...) when a text of this length (a str, or its length in
    characters) cannot fit in `context_length` tokens of a tokenizer whose tokens cover at most
    `max_token_chars` characters each; nothing otherwise. It does not tokenize, so a text that
    passes may still be too long once tokenized (the tokenizing side checks that)."""
    length = text if isinstance(text, int) else len(text)
    if max_token_chars >= UNBOUNDED or context_length <= 0:
        return
    limit = context_length * max_token_chars
    if length > limit:
        raise InvalidRequest(
            field,
            f"the prompt is {length:,} characters long, but no more than {limit:,} characters "
            f"fit in the model's context of {context_length:,} tokens (a token of this "
            f"tokenizer covers at most {max_token_chars} characters); shorten it",
        )


def _normalizer_shrink(node: Any) -> float | None:
    """How many characters of input one character of the normalized text can stand for at
    most; None when there is no such bound."""
    if node is None:
        return 1.0
    if not isinstance(node, dict):
        return None
    kind = node.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in node.get("normalizers") or []:
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind in ("NFC", "NFKC"):
        return float(NFC_MAX_COMPOSED)
    if kind in _GROWING_NORMALIZERS:
        return 1.0
    if kind == "Replace":
        pattern = (node.get("pattern") or {}).get("String")
        content = node.get("content")
        if isinstance(pattern, str) and pattern and isinstance(content, str) and content:
            return max(1.0, len(pattern) / len(content))
    return None  # regex replacements, Strip, StripAccents, BERT's, Precompiled, Nmt, unknown


def _pre_tokenizer_keeps(node: Any) -> bool:
    """Whether the pre-tokenizer keeps every character of the normalized text."""
    if node is None:
        return True
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(part) for part in node.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return node.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _model_bounded(node: Any) -> bool:
    """Whether each token of the model covers no more than its piece (no unknown token that
    stands for a run of characters or a whole word)."""
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if kind == "BPE":
        fused_unknown = node.get("unk_token") is not None and node.get("fuse_unk")
        return not fused_unknown or bool(node.get("byte_fallback"))
    if kind == "Unigram":  # unknown characters in a row become one unknown token
        return bool(node.get("byte_fallback"))
    return False  # WordPiece, WordLevel: one unknown token stands for a word of any length
