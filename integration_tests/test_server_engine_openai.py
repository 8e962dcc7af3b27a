"""The OpenAI API on the real engine, through the official `openai` client.

The model has random weights: tests check shapes, counts, indexes, constraints and determinism.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import jsonschema
import openai
import pytest

MODEL = "tiny-llama"
LONG = {"ignore_eos": True}  # extra_body: random models hit EOS at random

CITY_SCHEMA: Any = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MESSAGES: Any = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


def _tool_by_name(name: str) -> Any:
    return {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[name]


# ------------------------------------------------------------------------------------- models


def test_models_lists_the_served_model(client: openai.OpenAI, server: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


# -------------------------------------------------------------------------------- completions


def test_completion_answers_text_and_usage(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, extra_body=LONG
    )
    choice = reply.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_completion_stream_with_usage_matches_the_plain_answer(client: openai.OpenAI) -> None:
    kwargs: Any = dict(model=MODEL, prompt="Streaming test:", max_tokens=8, temperature=0,
                       extra_body=LONG)  # fmt: skip
    plain = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_n_streamed_carries_every_choice_index(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=["first prompt", "second prompt"],
        max_tokens=5,
        n=3,
        temperature=1.0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == list(range(6))
    assert set(finished.values()) == {"length"}
    assert usage is not None and usage.completion_tokens == 6 * 5


def test_completion_logprobs_have_one_entry_per_token(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="logprobs:", max_tokens=5, temperature=0, logprobs=3, extra_body=LONG
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert logprobs.token_logprobs is not None and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == 5
    # Keys are token texts; distinct byte tokens may decode alike, so at most 3 keys.
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset == sorted(logprobs.text_offset)
    assert "".join(logprobs.tokens) == reply.choices[0].text


def test_completion_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI) -> None:
    prompt = "echo this prompt"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True,
        extra_body=LONG,
    )  # fmt: skip
    assert reply.choices[0].text.startswith(prompt)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert reply.usage is not None
    assert len(logprobs.token_logprobs) == reply.usage.prompt_tokens + 2
    assert logprobs.token_logprobs[0] is None


def test_completion_takes_token_id_prompts(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, extra_body=LONG
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None and reply.usage.prompt_tokens == 5


def test_completion_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, seed=seed, extra_body=LONG
        )
        return reply.choices[0].text

    assert sample(11) == sample(11)


def test_completion_logit_bias_forces_a_token(client: openai.OpenAI, server: Any) -> None:
    token = 300
    reply = client.completions.create(
        model=MODEL,
        prompt="bias",
        max_tokens=4,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body=LONG,
    )
    expected = server.engine.tokenizer.decode([token] * 4)
    assert reply.choices[0].text == expected


def test_completion_regex_extra_body_constrains_the_text(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=8,
        temperature=1.0,
        extra_body={"regex": "(yes|no)"},
    )
    assert reply.choices[0].text in ("yes", "no")
    assert reply.choices[0].finish_reason == "stop"


# --------------------------------------------------------------------------------------- chat


def test_chat_answers_an_assistant_message(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=LONG
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 6


def test_chat_takes_content_parts_and_max_completion_tokens(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
        max_completion_tokens=3,
        temperature=0,
        extra_body=LONG,
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_chat_stream_with_usage_matches_the_plain_answer(client: openai.OpenAI) -> None:
    kwargs: Any = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                       extra_body=LONG)  # fmt: skip
    plain = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_n_streamed_carries_every_choice_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        n=3,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    roles: set[int] = set()
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.add(choice.index)
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 12


def test_chat_logprobs_and_top_logprobs_have_their_shapes(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3, extra_body=LONG,
    )  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    content = logprobs.content
    assert content is not None and len(content) == 4
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_chat_streamed_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body=LONG,
    )  # fmt: skip
    entries = [
        e for c in stream for ch in c.choices if ch.logprobs and ch.logprobs.content
        for e in ch.logprobs.content
    ]  # fmt: skip
    assert len(entries) == 5
    assert all(len(e.top_logprobs) == 2 for e in entries)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_response_format_validates(client: openai.OpenAI, stream: bool) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY_SCHEMA},
    }
    kwargs: Any = dict(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=1.0, seed=3,
                       response_format=response_format)  # fmt: skip
    if stream:
        chunks = client.chat.completions.create(**kwargs, stream=True)
        text = ""
        reasons = []
        for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reasons.append(choice.finish_reason)
        assert reasons[-1] == "stop"
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), CITY_SCHEMA)


def test_chat_required_tool_call_has_parseable_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather or time in Paris?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        max_tokens=96,
        temperature=1.0,
        seed=5,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls: Any = choice.message.tool_calls
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        tool = _tool_by_name(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_chat_named_tool_call_calls_that_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Time in London?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64,
        temperature=0,
    )
    calls: Any = reply.choices[0].message.tool_calls
    assert calls and len(calls) == 1
    assert calls[0].function.name == "get_time"
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, TIME_TOOL["function"]["parameters"])


def test_chat_streamed_tool_call_deltas_assemble_into_a_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Tokyo?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    names: dict[int, str] = {}
    arguments: dict[int, str] = defaultdict(str)
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names[delta.index] = delta.function.name
                if delta.function and delta.function.arguments:
                    arguments[delta.index] += delta.function.arguments
    assert reasons[-1] == "tool_calls"
    assert names == {0: "get_weather"}
    jsonschema.validate(json.loads(arguments[0]), WEATHER_TOOL["function"]["parameters"])


def test_chat_tool_messages_render_through_the_template(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=96,
        temperature=0,
    )
    calls = first.choices[0].message.tool_calls
    assert calls
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'},
    ]
    follow_up = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=4,
        temperature=0,
        extra_body=LONG,
    )
    assert follow_up.choices[0].message.tool_calls is None
    assert follow_up.usage is not None and first.usage is not None
    assert follow_up.usage.prompt_tokens > first.usage.prompt_tokens
