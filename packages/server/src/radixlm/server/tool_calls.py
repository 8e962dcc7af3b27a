"""Tool calls in model output: parsers for the Hermes/Qwen and Llama-3 formats, the constrained
formats of `tool_choice` required / named, and the streaming differ that turns growing output
into OpenAI tool-call deltas.

Every format is read by one function `view(text, final)` that splits the output seen so far into
the content safe to show and the tool calls found (name once complete, raw argument text so
far). Streaming sends the difference between successive views; a non-streamed answer is the
final view. Parsing is done on the whole text each time: outputs are short, and a re-parse can
never drift out of step with the text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixlm.server.openai_models import NamedToolChoice, Tool

_WS = " \t\r\n"


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Index after the JSON string starting at `pos` (a quote), or None if unfinished."""
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == '"':
            return pos + 1
        pos += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """Index after the JSON value starting at `pos`, or None if it is not finished yet.

    Structural only: it finds where a value ends, it does not validate it.
    """
    if pos >= len(text):
        return None
    if text[pos] == '"':
        return _string_end(text, pos)
    if text[pos] in "{[":
        depth = 0
        while pos < len(text):
            char = text[pos]
            if char == '"':
                end = _string_end(text, pos)
                if end is None:
                    return None
                pos = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return pos + 1
            pos += 1
        return None
    # A scalar: ends at a delimiter (unfinished if the text ends first).
    start = pos
    while pos < len(text) and text[pos] not in ",}]" + _WS:
        pos += 1
    return pos if pos < len(text) and pos > start else None


@dataclass
class CallView:
    """A tool call as far as it has been generated."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class OutputView:
    """What the output so far holds: content safe to show, and tool calls."""

    content: str = ""
    calls: list[CallView] = field(default_factory=list)


def scan_call(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[CallView, int | None]:
    """Read a `{"name": ..., "<argument key>": {...}}` object starting at `pos`.

    Returns the call as far as it goes and the index after the object (None if unfinished).
    """
    call = CallView()
    pos = _skip_ws(text, pos)
    if pos >= len(text) or text[pos] != "{":
        return call, None
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return call, None
        if text[pos] == "}":
            call.complete = call.name is not None
            return call, pos + 1
        if text[pos] == ",":
            pos += 1
            continue
        if text[pos] != '"':
            return call, None
        key_end = _string_end(text, pos)
        if key_end is None:
            return call, None
        key = json.loads(text[pos:key_end])
        pos = _skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            return call, None
        start = _skip_ws(text, pos + 1)
        end = value_end(text, start)
        if key == "name":
            if end is None:
                return call, None
            try:
                name = json.loads(text[start:end])
            except json.JSONDecodeError:
                return call, None
            call.name = name if isinstance(name, str) else None
        elif key in argument_keys:
            call.arguments = text[start : len(text) if end is None else end]
            if end is None:
                return call, None
        elif end is None:
            return call, None
        pos = end


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def hermes_view(text: str, final: bool) -> OutputView:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the rest is content."""
    start_tag, end_tag = "<tool_call>", "</tool_call>"
    view = OutputView()
    pos = 0
    while True:
        begin = text.find(start_tag, pos)
        if begin < 0:
            rest = text[pos:]
            view.content += rest if final else rest[: len(rest) - _held_back(rest, start_tag)]
            break
        view.content += text[pos:begin]
        body_start = begin + len(start_tag)
        close = text.find(end_tag, body_start)
        body = text[body_start : len(text) if close < 0 else close]
        if close < 0 and not final:  # the end tag may be arriving
            body = body[: len(body) - _held_back(body, end_tag)]
        call, end = scan_call(body, 0, ("arguments", "parameters"))
        if close >= 0:
            call.complete = call.complete and end is not None and not body[end:].strip()
        else:
            call.complete = False
        if call.name is None and (close >= 0 or final):
            # A block that names no function is not a call: it is shown as it came.
            view.content += text[begin : len(text) if close < 0 else close + len(end_tag)]
        else:
            view.calls.append(call)
        if close < 0:
            break
        pos = close + len(end_tag)
    return view


def llama3_view(text: str, final: bool) -> OutputView:
    """Llama-3's JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`. Output not starting with `{` is content."""
    tag = "<|python_tag|>"
    stripped = text.lstrip()
    if stripped.startswith(tag):
        stripped = stripped[len(tag) :].lstrip()
        if not stripped and not final:
            return OutputView()  # the tag alone: its call is still arriving
    elif not final and tag.startswith(stripped):
        return OutputView()  # possibly the tag, still arriving
    if not stripped.startswith("{"):
        return OutputView(content=text)
    view = OutputView()
    pos = 0
    while True:
        call, end = scan_call(stripped, pos, ("parameters", "arguments"))
        if call.name is None and end is not None:
            break  # an object naming no function ends the calls
        view.calls.append(call)
        if end is None:
            break
        pos = _skip_ws(stripped, end)
        if pos < len(stripped) and stripped[pos] == ";":
            pos += 1
            if _skip_ws(stripped, pos) < len(stripped):
                continue
        break
    if final and not any(call.name is not None for call in view.calls):
        return OutputView(content=text)  # JSON that names no function is plain content
    return view


def named_view(name: str, text: str, final: bool) -> OutputView:
    """`tool_choice` naming a function: the whole output is that function's arguments."""
    return OutputView(calls=[CallView(name=name, arguments=text, complete=final)])


def required_view(text: str, final: bool) -> OutputView:
    """`tool_choice: "required"`: a JSON array of `{"name": ..., "parameters": {...}}`."""
    view = OutputView()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        return view
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos >= len(text) or text[pos] == "]":
            return view
        call, end = scan_call(text, pos, ("parameters", "arguments"))
        view.calls.append(call)
        if end is None:
            return view
        pos = end


PARSERS = {"hermes": hermes_view, "qwen": hermes_view, "qwen25": hermes_view, "llama3": llama3_view}


def tool_call_constraint(
    tools: list[Tool], choice: str | NamedToolChoice, parallel: bool
) -> str | None:
    """The JSON schema that enforces `tool_choice` required / named; None for none / auto."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return json.dumps(tool.function.parameters or {"type": "object"})
    if choice != "required":
        return None
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


class ToolCallReader:
    """Reads one choice's growing output in one format; gives OpenAI deltas or the final answer.

    `mode` is a parser name (`hermes`, `qwen`, `qwen25`, `llama3`), `required`, or `named`
    (with `function_name`). `max_calls` keeps only the first calls (1 for
    `parallel_tool_calls: false`).
    """

    def __init__(
        self, mode: str, function_name: str | None = None, max_calls: int | None = None
    ) -> None:
        if mode not in PARSERS and mode not in ("required", "named"):
            raise ValueError(f"unknown tool-call format {mode!r}")
        self.mode = mode
        self.function_name = function_name
        self.max_calls = max_calls
        self._content_sent = 0
        self._ids: list[str] = []
        self._names_sent: list[bool] = []
        self._args_sent: list[int] = []

    def view(self, text: str, final: bool) -> OutputView:
        if self.mode == "named":
            view = named_view(str(self.function_name), text, final)
        elif self.mode == "required":
            view = required_view(text, final)
        else:
            view = PARSERS[self.mode](text, final)
        if self.max_calls is not None:
            del view.calls[self.max_calls :]  # parallel_tool_calls: false keeps the first
        return view

    def _call_id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
            self._names_sent.append(False)
            self._args_sent.append(0)
        return self._ids[index]

    def result(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Content and tool calls of a finished output (OpenAI's `message` fields): exactly
        what `deltas` sends for the same output, however it arrives. A call's arguments are
        as generated (OpenAI's too may not be valid JSON, e.g. when cut by max_tokens);
        content is stripped of surrounding whitespace."""
        view = self.view(text, final=True)
        calls = [c for c in view.calls if c.name is not None]
        tool_calls = [
            {
                "id": self._call_id(i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments.strip()},
            }
            for i, c in enumerate(calls)
        ]
        return view.content.strip() or None, tool_calls

    def deltas(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content and tool-call deltas since the previous call, for cumulative `text`.

        Whitespace that would end the content (or a call's arguments) is held back until
        something follows it, so the deltas add up to `result(text)`."""
        view = self.view(text, final)
        shown = view.content.strip()
        content = shown[self._content_sent :]
        self._content_sent = max(self._content_sent, len(shown))
        out: list[dict[str, Any]] = []
        for index, call in enumerate(view.calls):
            if call.name is None:
                break
            call_id = self._call_id(index)
            delta: dict[str, Any] = {"index": index}
            if not self._names_sent[index]:
                self._names_sent[index] = True
                delta.update(id=call_id, type="function")
                delta["function"] = {"name": call.name, "arguments": ""}
            fresh = call.arguments.strip()[self._args_sent[index] :]
            if fresh:
                self._args_sent[index] += len(fresh)
                delta.setdefault("function", {})["arguments"] = fresh
            if "function" in delta:
                out.append(delta)
        return content, out

    @property
    def called(self) -> bool:
        """Whether any tool call has been sent in a delta."""
        return any(self._names_sent)
