"""Reasoning models: `--reasoning-parser`, `reasoning_content`, `separate_reasoning`,
`chat_template_kwargs` and the `<think>` parsers, streamed and whole."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import httpx
import openai
import pytest

from radixlm.server import ServerConfig
from radixlm.server.cli import build_parser, server_config
from radixlm.server.reasoning import ReasoningFormat, reasoning_format

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# Qwen3's shape: thinking disabled closes an empty think block in the prompt.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}"
)
# A thinking-only model's shape: the prompt opens the reasoning.
OPEN_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


def say(text: str) -> list[dict[str, str]]:
    """A user message that makes the toy engine answer `text`."""
    return [{"role": "user", "content": f"<<say:{text}:say>>"}]


def client_for(make_server: Any, **config: Any) -> tuple[openai.OpenAI, Any]:
    live, engine = make_server(ServerConfig(served_model_name="toy", **config))
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0), engine


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[tuple[str, str]], list[Any]]:
    """The (field, text) deltas of a streamed chat, in order, and the finish reasons."""
    deltas: list[tuple[str, str]] = []
    finishes = []
    for chunk in client.chat.completions.create(model="toy", stream=True, **kwargs):
        for choice in chunk.choices:
            thought = getattr(choice.delta, "reasoning_content", None)
            if thought:
                deltas.append(("reasoning", thought))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return deltas, finishes


def joined(deltas: list[tuple[str, str]], field: str) -> str:
    return "".join(text for name, text in deltas if name == field)


# The parsers.


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("opens_inside", [False, True])
def test_streamed_deltas_always_add_up_to_the_split(opens_inside: bool) -> None:
    pieces = ["<think>", "</think>", "<", "</", "<th", "</thi", "nk>", ">", " ", "\n", "a", "b"]
    fmt = ReasoningFormat(opens_inside)
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        reasoning, content = fmt.split(text)
        stream = fmt.stream()
        chunks = _chunks(text, rng)
        got = [stream.feed(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks)]
        assert "".join(r for r, _ in got) == (reasoning or ""), (text, chunks)
        assert "".join(c for _, c in got) == content, (text, chunks)


def test_split_separates_reasoning_from_the_answer() -> None:
    fmt = ReasoningFormat(opens_inside=False)
    assert fmt.split("<think>\nplan\n</think>\n\nanswer") == ("plan", "answer")
    assert fmt.split("just an answer") == (None, "just an answer")
    assert fmt.split("<think>cut off") == ("cut off", "")
    assert ReasoningFormat(opens_inside=True).split("plan</think>answer") == ("plan", "answer")
    assert ReasoningFormat(opens_inside=True).split("<think>plan</think>a") == ("plan", "a")


def test_partial_tags_are_held_back_across_chunks() -> None:
    stream = ReasoningFormat(opens_inside=False).stream()
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>pla") == ("pla", "")
    assert stream.feed("n </thi") == ("n", "")
    assert stream.feed("nk>\n") == ("", "")
    assert stream.feed("ans") == ("", "ans")
    assert stream.feed("wer", final=True) == ("", "wer")


def test_a_tag_prefix_that_is_not_a_tag_is_released() -> None:
    stream = ReasoningFormat(opens_inside=False).stream()
    assert stream.feed("<tr") == ("", "<tr")
    stream = ReasoningFormat(opens_inside=True).stream()
    assert stream.feed("a </th") == ("a", "")
    assert stream.feed("ere") == (" </there", "")


def test_qwen3_follows_the_prompt_and_enable_thinking() -> None:
    assert reasoning_format(None, "x", None) is None
    assert reasoning_format("qwen3", "assistant\n", None) == ReasoningFormat(opens_inside=False)
    assert reasoning_format("qwen3", "assistant\n<think>\n", None) == ReasoningFormat(True)
    assert reasoning_format("qwen3", "x", {"enable_thinking": False}) is None
    assert reasoning_format("deepseek-r1", "x", {"enable_thinking": False}) == ReasoningFormat(True)


def test_reasoning_parser_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["--reasoning-parser", "deepseek-r1"])
    assert server_config(args).reasoning_parser == "deepseek-r1"
    assert server_config(build_parser().parse_args([])).reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "o1"])
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="o1")


# The chat route.


def test_qwen3_answer_has_reasoning_content_apart(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="qwen3")
    result = client.chat.completions.create(
        model="toy", messages=say("<think>\nLet me think.\n</think>\n\nHello world")
    )
    message = result.choices[0].message
    assert getattr(message, "reasoning_content", None) == "Let me think."
    assert message.content == "Hello world"


def test_qwen3_output_without_think_is_all_content(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="qwen3")
    result = client.chat.completions.create(model="toy", messages=say("Hello world"))
    message = result.choices[0].message
    assert message.content == "Hello world"
    assert message.model_dump()["reasoning_content"] is None


def test_qwen3_stream_sends_reasoning_then_content(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="qwen3")
    deltas, finishes = streamed(client, messages=say("<think>\nHmm, ok.\n</think>\n\nHello world"))
    assert joined(deltas, "reasoning") == "Hmm, ok."
    assert joined(deltas, "content") == "Hello world"
    fields = [name for name, _ in deltas]
    assert fields == sorted(fields, key=lambda name: name == "content")  # reasoning first
    assert finishes == ["stop"]


def test_deepseek_r1_output_starts_inside_reasoning(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="deepseek-r1")
    for output in ("Hmm.</think>Hello", "<think>Hmm.</think>Hello"):
        message = client.chat.completions.create(model="toy", messages=say(output))
        assert getattr(message.choices[0].message, "reasoning_content", None) == "Hmm."
        assert message.choices[0].message.content == "Hello"
        deltas, _ = streamed(client, messages=say(output))
        assert (joined(deltas, "reasoning"), joined(deltas, "content")) == ("Hmm.", "Hello")


def test_truncated_reasoning_is_all_reasoning(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="deepseek-r1")
    result = client.chat.completions.create(
        model="toy", messages=say("The quick brown fox</think>Hello"), max_tokens=3
    )
    message = result.choices[0].message
    assert result.choices[0].finish_reason == "length"
    assert getattr(message, "reasoning_content", "") and not message.content


def test_separate_reasoning_false_keeps_the_raw_text(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="qwen3")
    output = "<think>Hmm.</think>Hello"
    result = client.chat.completions.create(
        model="toy", messages=say(output), extra_body={"separate_reasoning": False}
    )
    assert result.choices[0].message.content == output
    assert "reasoning_content" not in result.choices[0].message.model_dump()
    deltas, _ = streamed(client, messages=say(output), extra_body={"separate_reasoning": False})
    assert joined(deltas, "content") == output and not joined(deltas, "reasoning")


def test_without_a_parser_think_tags_stay_in_content(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="toy", messages=say("<think>Hmm.</think>Hi"))
    assert result.choices[0].message.content == "<think>Hmm.</think>Hi"
    assert "reasoning_content" not in result.choices[0].message.model_dump()


def test_enable_thinking_false_reaches_the_template_and_all_is_content(
    make_server: Any,
) -> None:
    client, engine = client_for(make_server, reasoning_parser="qwen3", chat_template=QWEN3_TEMPLATE)
    output = "<think>Hmm.</think>Hello"
    result = client.chat.completions.create(
        model="toy",
        messages=say(output),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    prompt = engine.tokenizer.decode(engine.received[-1].input_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert result.choices[0].message.content == output
    assert "reasoning_content" not in result.choices[0].message.model_dump()


def test_a_prompt_that_opens_think_makes_the_output_start_inside(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="qwen3", chat_template=OPEN_THINK_TEMPLATE)
    result = client.chat.completions.create(model="toy", messages=say("Hmm.\n</think>\n\nHello"))
    message = result.choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == ("Hmm.", "Hello")


def test_tool_calls_are_read_from_the_content_only(make_server: Any) -> None:
    client, _ = client_for(make_server, reasoning_parser="qwen3")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    output = f"<think>Maybe {call.replace('Paris', 'Rome')}? No.</think>\n\n{call}"
    result = client.chat.completions.create(model="toy", messages=say(output), tools=[WEATHER_TOOL])
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert "Rome" in getattr(choice.message, "reasoning_content", "")
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]

    arguments = ""
    thoughts = ""
    finishes = []
    stream = client.chat.completions.create(
        model="toy", messages=say(output), tools=[WEATHER_TOOL], stream=True
    )
    for chunk in stream:
        for streamed_choice in chunk.choices:
            delta = streamed_choice.delta
            thoughts += getattr(delta, "reasoning_content", None) or ""
            assert not delta.content
            for tool_call in delta.tool_calls or []:
                arguments += tool_call.function.arguments or ""  # type: ignore[union-attr]
            if streamed_choice.finish_reason is not None:
                finishes.append(streamed_choice.finish_reason)
    assert thoughts == getattr(choice.message, "reasoning_content", None)
    assert json.loads(arguments) == {"city": "Paris"} and finishes == ["tool_calls"]


def test_thinking_token_budget_reaches_the_engine(make_server: Any) -> None:
    client, engine = client_for(make_server, reasoning_parser="qwen3")
    client.chat.completions.create(
        model="toy", messages=say("Hi"), extra_body={"thinking_token_budget": 5}
    )
    assert engine.received[-1].params.thinking_token_budget == 5


# Structured output after the reasoning (the toy engine answers a constrained request that has
# `require_reasoning` with its `<<say:...:say>>` text as the thinking, then the schema's example).

CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}


def city(content: str | None) -> dict[str, Any]:
    """The content, which must be a JSON object with the schema's required fields."""
    value = json.loads(content or "")
    assert isinstance(value["name"], str) and isinstance(value["population"], int)
    return dict(value)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_response_format_constrains_the_answer_after_the_reasoning(
    make_server: Any, parser: str
) -> None:
    client, engine = client_for(make_server, reasoning_parser=parser)
    kwargs: dict[str, Any] = {"messages": say("Paris, I think."), "response_format": CITY_FORMAT}
    result = client.chat.completions.create(model="toy", **kwargs)
    assert engine.received[-1].require_reasoning is True
    message = result.choices[0].message
    assert getattr(message, "reasoning_content", None) == "Paris, I think."
    city(message.content)

    deltas, finishes = streamed(client, **kwargs)
    assert joined(deltas, "reasoning") == "Paris, I think."
    assert city(joined(deltas, "content")) == city(message.content)
    assert finishes == ["stop"]


def test_json_object_with_thinking_disabled_is_constrained_from_the_first_token(
    make_server: Any,
) -> None:
    client, engine = client_for(make_server, reasoning_parser="qwen3", chat_template=QWEN3_TEMPLATE)
    result = client.chat.completions.create(
        model="toy",
        messages=say("Hmm."),
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert engine.received[-1].require_reasoning is False
    assert json.loads(result.choices[0].message.content or "") == {}
    assert "reasoning_content" not in result.choices[0].message.model_dump()


def test_without_a_parser_a_constraint_applies_from_the_first_token(
    client: openai.OpenAI, engine: Any
) -> None:
    result = client.chat.completions.create(
        model="toy", messages=say("Hmm."), response_format=CITY_FORMAT
    )
    assert engine.received[-1].require_reasoning is False
    city(result.choices[0].message.content)


def test_generate_passes_require_reasoning_with_a_parser(make_server: Any) -> None:
    live, engine = make_server(ServerConfig(reasoning_parser="deepseek-r1"))
    body = {
        "text": "<<say:Paris.:say>>",
        "sampling_params": {"json_schema": json.dumps(CITY_SCHEMA)},
        "require_reasoning": True,
    }
    with httpx.Client(base_url=live.url) as http:
        out = http.post("/generate", json=body).json()
    assert engine.received[-1].require_reasoning is True
    reasoning, content = ReasoningFormat(opens_inside=True).split(out["text"])
    assert reasoning == "Paris." and city(content)


def test_generate_refuses_require_reasoning_without_a_parser(make_server: Any) -> None:
    live, _ = make_server(ServerConfig())
    body = {"text": "x", "sampling_params": {"regex": "[ab]+"}, "require_reasoning": True}
    with httpx.Client(base_url=live.url) as http:
        response = http.post("/generate", json=body)
    assert response.status_code == 400
    assert "require_reasoning" in response.text and "--reasoning-parser" in response.text
