"""What the router matches prefixes on.

The key of a request is its prompt as token ids wherever a tokenizer is at hand: the same
tokens the replica's radix cache sees (an OpenAI chat arrives tokenized, its chat template
applied by the server; a `/generate` text prompt is encoded with the model's tokenizer as the
engine encodes it). Without a tokenizer (a router in front of remote replicas that does not
load one) the key is the prompt text's UTF-8 bytes: prefixes of the text are prefixes of the
bytes, so affinity still holds, only measured in bytes rather than tokens. The HTTP router
(`radixlm-router`) has no tokenizer: `body_key` keys a request body by its text's bytes, a
chat by its messages rendered to a stable string (`chat_text`).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple


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


class BodyKey(NamedTuple):
    """The routing key of an HTTP request body, and the namespace it lives in (token ids and
    text bytes are kept apart; a LoRA adapter's prompts too)."""

    key: list[int]
    namespace: Hashable | None


def chat_text(messages: Any) -> str:
    """A chat's messages as one stable string, for a router without the chat template: each
    message's role, then its content (text parts as they are, other parts as sorted JSON),
    then any other fields (tool calls) as sorted JSON. A chat that extends another (its next
    turn) renders to a string that starts with the other's."""
    out: list[str] = []
    for message in messages if isinstance(messages, list) else [messages]:
        if not isinstance(message, dict):
            out.append(_stable(message))
            continue
        out.append(f"<|{message.get('role', '')}|>\n{_content_text(message.get('content'))}")
        rest = {k: v for k, v in message.items() if k not in ("role", "content")}
        out.append(f"{_stable(rest) if rest else ''}\n")
    return "".join(out)


def body_key(route: str, body: Any) -> BodyKey:
    """The key of a `/generate`, `/v1/completions` or `/v1/chat/completions` body as an HTTP
    router without a tokenizer sees it: a text prompt's UTF-8 bytes, token ids as they are, a
    chat's `chat_text` bytes; a batch by its first prompt. An empty key (route by load alone)
    for anything else."""
    if not isinstance(body, dict):
        return BodyKey([], None)
    if route.endswith("/chat/completions"):
        prompt: Any = chat_text(body.get("messages"))
    elif route.endswith("/completions"):
        prompt = body.get("prompt")
    else:
        prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch
    adapter = body.get("lora_path")
    adapter = adapter if isinstance(adapter, str) else None
    if isinstance(prompt, str):
        return BodyKey(text_key(prompt), adapter)
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        return BodyKey(list(prompt), ("ids", adapter))
    return BodyKey([], None)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part["text"])
            if isinstance(part, dict) and part.get("type") == "text" and "text" in part
            else _stable(part)
            for part in content
        )
    return _stable(content)


def _stable(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
