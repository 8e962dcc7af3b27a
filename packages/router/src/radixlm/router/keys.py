"""What the router matches prefixes on.

The key of a request is its prompt as token ids wherever a tokenizer is at hand: the same
tokens the replica's radix cache sees (an OpenAI chat arrives tokenized, its chat template
applied by the server; a `/generate` text prompt is encoded with the model's tokenizer as the
engine encodes it). Without a tokenizer (a router in front of remote replicas that does not
load one) the key is the prompt text's UTF-8 bytes: prefixes of the text are prefixes of the
bytes, so affinity still holds, only measured in bytes rather than tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def text_key(text: str) -> list[int]:
    """A text prompt as its UTF-8 bytes (the key when no tokenizer is at hand)."""
    return list(text.encode("utf-8"))


def prompt_key(
    input_ids: Sequence[int] | None = None, text: str | None = None, tokenizer: Any = None
) -> list[int]:
    """The routing key of one prompt: its token ids when given, else its text encoded with
    `tokenizer` (as the engine encodes it: `tokenizer.encode(text)`), else its text's bytes.
    An empty list for a request with neither (embeddings: it routes by load alone)."""
    if input_ids is not None:
        return list(input_ids)
    if text is None:
        return []
    if tokenizer is not None:
        return list(tokenizer.encode(text))
    return text_key(text)
