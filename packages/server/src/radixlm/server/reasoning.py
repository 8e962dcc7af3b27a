"""Reasoning sections in model output (`<think>...</think>`): split off, whole or streamed.

Two formats, named as SGLang's `--reasoning-parser` names them:

- `qwen3`: the output may open with `<think>`; text up to `</think>` is the reasoning, the rest
  the answer. When the rendered prompt ends with an open `<think>` (templates of thinking-only
  models), the output starts inside the reasoning. With
  `chat_template_kwargs: {"enable_thinking": false}` there is no reasoning: all is content.
- `deepseek-r1`: the template opened `<think>`, so the output starts inside the reasoning and
  it ends at `</think>`; a leading `<think>` in the output is accepted too.

The whole-text `split` and the incremental `ReasoningStream` follow one rule, so the streamed
deltas always add up to the split: whitespace around the reasoning and before the answer is
dropped; reasoning never closed (a truncated output) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.server.config import REASONING_PARSERS

THINK_START = "<think>"
THINK_END = "</think>"


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class ReasoningFormat:
    """Where a reasoning section is in one request's output.

    `opens_inside`: the output starts inside the reasoning (the prompt opened `<think>`);
    otherwise a reasoning section exists only when the output starts with `<think>`.
    """

    opens_inside: bool
    start_tag: str = THINK_START
    end_tag: str = THINK_END

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a finished output; reasoning is None when there is no
        reasoning section, and "" when the section is empty."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            body = stripped[len(self.start_tag) :]
        elif self.opens_inside:
            body = text
        else:
            return None, text
        end = body.find(self.end_tag)
        if end < 0:
            return body.strip(), ""
        return body[:end].strip(), body[end + len(self.end_tag) :].lstrip()

    def stream(self) -> ReasoningStream:
        """A fresh incremental parser for one choice's output."""
        return ReasoningStream(self)


class ReasoningStream:
    """Splits one output arriving in text deltas; `feed` returns (reasoning, content) deltas.

    Text that may still turn out to be a tag (`<thi` at the end of a delta), and whitespace
    that the split would drop if the output ended there, are held back until the next delta
    decides them, or until `final`.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = "start"  # start -> reasoning -> content_lead -> content
        self._pending = ""
        self._reasoning_sent = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Add `delta` (text new since the last call); returns the reasoning and content text
        that can be shown now. `final`: the output is complete; nothing stays held back."""
        self._pending += delta
        reasoning = content = ""
        if self._state == "start":
            self._decide_start(final)
        if self._state == "reasoning":
            reasoning = self._reasoning(final)
        if self._state == "content_lead":
            stripped = self._pending.lstrip()
            self._pending = ""
            if stripped:
                self._state = "content"
                content = stripped
        elif self._state == "content":
            content, self._pending = self._pending, ""
        return reasoning, content

    def _decide_start(self, final: bool) -> None:
        tag = self.fmt.start_tag
        stripped = self._pending.lstrip()
        if stripped.startswith(tag):
            self._pending = stripped[len(tag) :]
            self._state = "reasoning"
        elif tag.startswith(stripped) and not final:
            return  # possibly the start tag, still arriving
        else:
            self._state = "reasoning" if self.fmt.opens_inside else "content"

    def _reasoning(self, final: bool) -> str:
        tag = self.fmt.end_tag
        end = self._pending.find(tag)
        if end >= 0:
            shown = self._pending[:end].rstrip()
            self._pending = self._pending[end + len(tag) :]
            self._state = "content_lead"
        elif final:
            shown, self._pending = self._pending.rstrip(), ""
        else:
            safe = len(self._pending) - _held_back(self._pending, tag)
            shown = self._pending[:safe].rstrip()
            self._pending = self._pending[len(shown) :]
        if not self._reasoning_sent:
            shown = shown.lstrip()
            if not shown and self._state == "reasoning":
                self._pending = self._pending.lstrip()  # leading whitespace is dropped
            self._reasoning_sent = bool(shown)
        return shown


def reasoning_format(
    parser: str | None, prompt: str, template_kwargs: dict[str, Any] | None
) -> ReasoningFormat | None:
    """The reasoning format of one chat request's output; None when its output has no
    reasoning section to split off (no parser, or qwen3 with thinking disabled)."""
    if parser is None:
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}")
    if parser == "deepseek-r1":
        return ReasoningFormat(opens_inside=True)
    if (template_kwargs or {}).get("enable_thinking") is False:
        return None
    # Templates of thinking-only models end the generation prompt with an open `<think>`.
    return ReasoningFormat(opens_inside=prompt.rstrip().endswith(THINK_START))
