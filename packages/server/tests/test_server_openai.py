"""The OpenAI routes, driven by the official `openai` client against a live server."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import openai
import pytest
import server_fake_engine as fake  # loaded by conftest.py

from radixlm.server import ServerConfig

USER = [{"role": "user", "content": "Hello"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def say(text: str) -> list[dict[str, str]]:
    """A user message that makes the toy engine answer `text`."""
    return [{"role": "user", "content": f"<<say:{text}:say>>"}]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["toy"]
    assert client.models.retrieve("toy").id == "toy"


def test_retrieving_another_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_completion_returns_text_and_usage(client: openai.OpenAI, engine: Any) -> None:
    result = client.completions.create(model="toy", prompt="Hello", max_tokens=4)
    assert result.object == "text_completion" and result.model == "toy"
    assert result.choices[0].text == "The quick brown fox"
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 4
    assert engine.received[-1].params.max_new_tokens == 4


def test_completion_indexes_choices_by_prompt_then_sequence(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="toy", prompt=["<<say:a:say>>", "<<say:b:say>>"], n=2, max_tokens=4
    )
    assert [(c.index, c.text) for c in result.choices] == [(0, "a"), (1, "a"), (2, "b"), (3, "b")]


def test_completion_takes_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode("<<say:from ids:say>>")
    result = client.completions.create(model="toy", prompt=ids, max_tokens=8)
    assert result.choices[0].text == "from ids"
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)


def test_completion_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    result = client.completions.create(model="toy", prompt="Say: ", echo=True, max_tokens=2)
    assert result.choices[0].text == "Say: The quick"


def test_completion_logprobs_have_openai_shape(client: openai.OpenAI) -> None:
    result = client.completions.create(model="toy", prompt="Hi", max_tokens=3, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 3
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.token_logprobs is not None and all(lp < 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len("".join(logprobs.tokens[:2]))]


def test_completion_echo_with_logprobs_scores_the_prompt(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    prompt = "Paris is the capital of France"
    result = client.completions.create(
        model="toy", prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == len(tokenizer.encode(prompt))
    assert logprobs.token_logprobs[0] is None
    assert result.choices[0].text == prompt


def test_streamed_completion_adds_up_to_the_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="toy", prompt="Hi", max_tokens=6).choices[0].text
    chunks = list(
        client.completions.create(
            model="toy",
            prompt="Hi",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_sampling_extras_in_extra_body_reach_the_engine(client: openai.OpenAI, engine: Any) -> None:
    client.completions.create(
        model="toy",
        prompt="Hi",
        max_tokens=3,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=["zzz"],
        logit_bias={"5": 1.5},
        presence_penalty=0.1,
        frequency_penalty=0.2,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 1,
            "stop_token_ids": [3],
        },
    )
    params = engine.received[-1].params
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.5, 0.9, 7, ["zzz"])
    assert params.logit_bias == {5: 1.5}
    assert (params.presence_penalty, params.frequency_penalty) == (0.1, 0.2)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.05, 1.1)
    assert params.ignore_eos and params.min_new_tokens == 1 and params.stop_token_ids == [3]


def test_strict_constraint_extra_reaches_the_engine_on_both_routes(
    client: openai.OpenAI, engine: Any
) -> None:
    client.completions.create(
        model="toy",
        prompt="Hi",
        max_tokens=2,
        extra_body={"regex": "a+", "strict_constraint": True},
    )
    params = engine.received[-1].params
    assert (params.regex, params.strict_constraint) == ("a+", True)
    client.chat.completions.create(
        model="toy",
        messages=USER,
        max_tokens=2,
        response_format={"type": "json_object"},
        extra_body={"strict_constraint": False},
    )
    params = engine.received[-1].params
    assert params.json_schema is not None and params.strict_constraint is False
    client.completions.create(model="toy", prompt="Hi", max_tokens=2)
    assert engine.received[-1].params.strict_constraint is None  # the server's default


def test_unsent_fields_keep_the_engine_defaults(client: openai.OpenAI, engine: Any) -> None:
    client.completions.create(model="toy", prompt="Hi", max_tokens=2)
    assert engine.received[-1].params.model_fields_set == {"max_new_tokens"}


def test_chat_answers_with_an_assistant_message(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="toy", messages=USER)
    assert result.object == "chat.completion"
    message = result.choices[0].message
    assert message.role == "assistant" and message.content == fake.DEFAULT_TEXT
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None and result.usage.prompt_tokens > 0


def test_chat_prompt_is_the_rendered_template(
    client: openai.OpenAI, engine: Any, tokenizer: Any
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    client.chat.completions.create(model="toy", messages=messages, max_tokens=2)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert engine.received[-1].input_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_max_completion_tokens_limits_the_answer(client: openai.OpenAI, engine: Any) -> None:
    result = client.chat.completions.create(model="toy", messages=USER, max_completion_tokens=2)
    assert result.choices[0].finish_reason == "length"
    assert engine.received[-1].params.max_new_tokens == 2


def test_streamed_chat_with_n_keeps_choices_apart(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="toy",
        messages=USER,
        n=2,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    text: dict[int, str] = defaultdict(str)
    roles: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert finish == {0: "length", 1: "length"}
    assert text[0] == "The quick brown fox" and text[1] != text[0]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 8


def test_chat_logprobs_have_openai_shape(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="toy", messages=USER, max_tokens=3, logprobs=True, top_logprobs=2
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 3
    for entry in logprobs.content:
        assert entry.logprob < 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
    assert "".join(e.token for e in logprobs.content) == result.choices[0].message.content


def test_streamed_chat_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="toy", messages=USER, max_tokens=5, logprobs=True, stream=True
    )
    entries = [e for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(entries) == 5


def test_json_schema_response_format_is_enforced(client: openai.OpenAI, engine: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"],
    }
    result = client.chat.completions.create(
        model="toy",
        messages=[{"role": "user", "content": "The capital of France as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    value = json.loads(str(result.choices[0].message.content))
    assert isinstance(value["name"], str) and isinstance(value["population"], int)
    assert json.loads(str(engine.received[-1].params.json_schema)) == schema


def test_json_object_response_format_asks_for_an_object(client: openai.OpenAI, engine: Any) -> None:
    client.chat.completions.create(
        model="toy", messages=USER, response_format={"type": "json_object"}
    )
    assert json.loads(str(engine.received[-1].params.json_schema)) == {"type": "object"}


def test_text_response_format_adds_no_constraint(client: openai.OpenAI, engine: Any) -> None:
    client.chat.completions.create(model="toy", messages=USER, response_format={"type": "text"})
    assert engine.received[-1].params.constraint is None


def test_auto_tool_call_is_parsed_from_hermes_output(client: openai.OpenAI, engine: Any) -> None:
    output = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    result = client.chat.completions.create(model="toy", messages=say(output), tools=[WEATHER_TOOL])
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert engine.received[-1].params.constraint is None
    assert "<tools>" in engine.tokenizer.decode(engine.received[-1].input_ids)


def test_required_tool_choice_sends_a_constraint_and_gives_calls(
    client: openai.OpenAI, engine: Any
) -> None:
    result = client.chat.completions.create(
        model="toy", messages=USER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required"
    )
    schema = json.loads(str(engine.received[-1].params.json_schema))
    assert schema["type"] == "array" and schema["minItems"] == 1
    calls = result.choices[0].message.tool_calls or []
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def test_named_tool_choice_constrains_to_the_function_arguments(
    client: openai.OpenAI, engine: Any
) -> None:
    result = client.chat.completions.create(
        model="toy",
        messages=USER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert (
        json.loads(str(engine.received[-1].params.json_schema))
        == WEATHER_TOOL["function"]["parameters"]
    )
    call = (result.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] == "Paris"  # type: ignore[union-attr]


def test_tool_choice_none_leaves_tools_out(client: openai.OpenAI, engine: Any) -> None:
    output = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    result = client.chat.completions.create(
        model="toy", messages=say(output), tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert result.choices[0].message.content == output
    assert not result.choices[0].message.tool_calls
    assert "<tools>" not in engine.tokenizer.decode(engine.received[-1].input_ids)


def collect_tool_deltas(stream: Any) -> tuple[str, dict[int, dict[str, Any]], list[str]]:
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finishes = []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, calls, finishes


def test_streamed_tool_call_deltas_add_up(client: openai.OpenAI) -> None:
    output = (
        'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    stream = client.chat.completions.create(
        model="toy", messages=say(output), tools=[WEATHER_TOOL, TIME_TOOL], stream=True
    )
    content, calls, finishes = collect_tool_deltas(stream)
    assert content == "Let me check."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert all(call["id"].startswith("call_") for call in calls.values())
    assert finishes == ["tool_calls"]


def test_streamed_required_tool_calls_add_up(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="toy", messages=USER, tools=[WEATHER_TOOL], tool_choice="required", stream=True
    )
    content, calls, finishes = collect_tool_deltas(stream)
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finishes == ["tool_calls"]


def test_llama3_parser_reads_json_calls(make_server: Any) -> None:
    live, _ = make_server(ServerConfig(tool_call_parser="llama3"))
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    output = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    result = client.chat.completions.create(
        model="toy/fake-model", messages=say(output), tools=[WEATHER_TOOL]
    )
    call = (result.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Rome"}  # type: ignore[union-attr]


def test_a_conversation_with_tool_results_renders(client: openai.OpenAI, engine: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    result = client.chat.completions.create(
        model="toy", messages=messages, tools=[WEATHER_TOOL], max_tokens=2
    )
    assert result.choices[0].finish_reason == "length"
    prompt = engine.tokenizer.decode(engine.received[-1].input_ids)
    assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>sunny" in prompt


def test_content_parts_are_joined(client: openai.OpenAI, engine: Any) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "<<say:"}, {"type": "text", "text": "ok:say>>"}],
        }
    ]
    result = client.chat.completions.create(model="toy", messages=messages)  # type: ignore[arg-type]
    assert result.choices[0].message.content == "ok"


def test_chat_template_flag_replaces_the_tokenizers(make_server: Any) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>"
    live, engine = make_server(ServerConfig(chat_template=template))
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="toy/fake-model", messages=USER, max_tokens=1)
    assert engine.tokenizer.decode(engine.received[-1].input_ids) == "[user] Hello\n>"


def test_parallel_tool_calls_false_keeps_one_call(client: openai.OpenAI) -> None:
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    result = client.chat.completions.create(
        model="toy", messages=say(call * 2), tools=[TIME_TOOL], parallel_tool_calls=False
    )
    assert len(result.choices[0].message.tool_calls or []) == 1


def test_ruled_out_alternatives_have_a_finite_logprob(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="toy", messages=USER, max_tokens=1, logprobs=True, top_logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert logprobs.content[0].top_logprobs[2].logprob == -9999.0
