"""Tool-call parsing: the formats, the constrained shapes, and the streamed deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixlm.server.openai_models import NamedToolChoice, Tool
from radixlm.server.tool_calls import (
    ToolCallReader,
    hermes_view,
    llama3_view,
    required_view,
    tool_call_constraint,
    value_end,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TOOLS = [
    Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ),
    Tool.model_validate({"type": "function", "function": {"name": "get_time"}}),
]


def stream(reader: ToolCallReader, text: str, step: int = 1) -> tuple[str, dict[int, dict]]:
    """Feed `text` in growing prefixes; return the content and the calls the deltas add up to."""
    content = ""
    calls: dict[int, dict] = {}
    for end in [*range(step, len(text), step), len(text)]:
        piece, deltas = reader.deltas(text[:end], final=end == len(text))
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in delta:
                assert call["id"] is None, "a call's id is sent once"
                call["id"] = delta["id"]
                call["name"] = delta["function"]["name"]
            call["arguments"] += delta["function"].get("arguments", "")
    return content, calls


@pytest.mark.parametrize(
    ("text", "end"),
    [('"a\\"b" tail', 6), ('{"a": [1, {"b": "}"}]} x', 22), ("12, 3", 2), ("[1, 2", None)],
)
def test_value_end_finds_where_a_json_value_ends(text: str, end: int | None) -> None:
    assert value_end(text, 0) == end


def test_hermes_view_splits_content_from_calls() -> None:
    view = hermes_view(f"Let me look.<tool_call>{WEATHER}</tool_call>", final=True)
    assert view.content == "Let me look."
    assert [(c.name, json.loads(c.arguments), c.complete) for c in view.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}, True)
    ]


def test_hermes_view_holds_back_a_partial_start_tag() -> None:
    assert hermes_view("Sure <tool_", final=False).content == "Sure "
    assert hermes_view("Sure <tool_", final=True).content == "Sure <tool_"


def test_hermes_result_reads_several_calls() -> None:
    text = f'<tool_call>{WEATHER}</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>'
    content, calls = ToolCallReader("hermes").result(text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_hermes_call_with_invalid_arguments_stays_a_call_as_streamed() -> None:
    # Streaming sends the call once it is named, so the answer keeps it too (OpenAI's
    # arguments may be invalid JSON as well); a block naming no function is content.
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    content, calls = ToolCallReader("qwen").result(text)
    assert content is None
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": }'}
    nameless = 'Hi <tool_call>{"city": "x"}</tool_call>'
    assert ToolCallReader("qwen").result(nameless) == (nameless, [])


def test_output_without_calls_is_content() -> None:
    assert ToolCallReader("hermes").result("Just text.") == ("Just text.", [])


def test_llama3_view_reads_json_calls_after_the_python_tag() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    view = llama3_view(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in view.calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]


def test_llama3_text_not_starting_with_a_brace_is_content() -> None:
    content, calls = ToolCallReader("llama3").result("The weather is fine.")
    assert (content, calls) == ("The weather is fine.", [])


def test_required_view_reads_the_constrained_array() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = ToolCallReader("required").result(text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert len(required_view(text[:30], final=False).calls) == 1


def test_named_reader_takes_the_whole_output_as_arguments() -> None:
    content, calls = ToolCallReader("named", "get_weather").result('{"city": "Lima"}')
    assert content is None
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_hermes_deltas_add_up_to_the_result(step: int) -> None:
    text = f"Checking.<tool_call>{WEATHER}</tool_call>"
    content, calls = stream(ToolCallReader("hermes"), text, step)
    assert content == "Checking."
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}


def test_streamed_deltas_send_arguments_before_the_call_closes() -> None:
    reader = ToolCallReader("hermes")
    partial = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    _, deltas = reader.deltas(partial, final=False)
    assert deltas[0]["function"]["name"] == "get_weather"
    assert deltas[0]["function"]["arguments"] == '{"city": "Pa'


def test_streamed_required_deltas_give_each_call() -> None:
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    _, calls = stream(ToolCallReader("required"), text, 2)
    assert [c["name"] for c in calls.values()] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["arguments"]) == {"city": "Oslo"}


def test_streamed_named_deltas_carry_the_arguments() -> None:
    _, calls = stream(ToolCallReader("named", "get_weather"), '{"city": "Kyiv"}', 4)
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Kyiv"}


def test_required_constraint_is_an_array_of_the_tools() -> None:
    schema = json.loads(str(tool_call_constraint(TOOLS, "required", parallel=False)))
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"]["required"] == ["city"]


def test_named_constraint_is_the_function_parameters() -> None:
    choice = NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}
    )
    schema = json.loads(str(tool_call_constraint(TOOLS, choice, parallel=True)))
    assert schema == TOOLS[0].function.parameters


def test_auto_and_none_need_no_constraint() -> None:
    assert tool_call_constraint(TOOLS, "auto", parallel=True) is None
    assert tool_call_constraint(TOOLS, "none", parallel=True) is None


def test_max_calls_keeps_only_the_first_call() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    _, calls = ToolCallReader("hermes", max_calls=1).result(text)
    assert len(calls) == 1


# Random outputs around tool calls: content, whitespace, named calls (valid, malformed,
# unclosed), blocks naming no function, partial tags; streamed in random pieces.
_PIECES = [
    "Sure.",
    " ",
    "\n",
    "  ",
    "Let me check",
    "<",
    "<tool",
    "ok</",
    " done",
    f"<tool_call>{WEATHER}</tool_call>",
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call> {"name": "get_time", "arguments": {"a": "x y "} } </tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
    '<tool_call>{"city": "Paris"}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"a": "cut ',
    '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    '<|python_tag|>{"name": "get_time", "parameters": {}}; ',
    '[{"name": "get_time", "parameters": {"x": 1}}',
    "]",
]


@settings(max_examples=400, deadline=None)
@example(  # the tag alone in a chunk: it was sent as content before its call arrived
    mode="llama3",
    pieces=['<|python_tag|>{"name": "get_time", "parameters": {}}; '],
    cuts=[14],
    one_call=False,
)
@given(
    mode=st.sampled_from(["hermes", "llama3", "required", "named"]),
    pieces=st.lists(st.sampled_from(_PIECES), max_size=7),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    one_call=st.booleans(),
)
def test_streamed_deltas_always_add_up_to_the_answer(
    mode: str, pieces: list[str], cuts: list[int], one_call: bool
) -> None:
    text = "".join(pieces)
    ends = sorted({c for c in cuts if 0 < c < len(text)} | {len(text)})
    name = "get_weather" if mode == "named" else None
    limit = 1 if one_call else None
    streamed = ToolCallReader(mode, name, limit)
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for end in ends:
        piece, deltas = streamed.deltas(text[:end], final=end == len(text))
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            function = delta.get("function", {})
            if "id" in delta:
                call["name"] = function["name"]
            call["arguments"] += function.get("arguments", "")
    answer, answer_calls = ToolCallReader(mode, name, limit).result(text)
    assert content == (answer or ""), text
    expected = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in answer_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected, text
