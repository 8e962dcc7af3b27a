"""`/v1/responses` (OpenAI's Responses API), driven by the official `openai` client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import server_fake_engine as fake  # loaded by conftest.py
from starlette.testclient import TestClient

from radixlm.sampling import GenerateChunk
from radixlm.server import ServerConfig, create_app
from radixlm.server.response_store import ResponseStore, StoredResponse

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def say(text: str) -> str:
    """An input that makes the toy engine answer `text`."""
    return f"<<say:{text}:say>>"


def prompt_of(engine: Any) -> str:
    return str(engine.tokenizer.decode(engine.received[-1].input_ids))


def test_string_input_answers_with_one_message(client: openai.OpenAI, engine: Any) -> None:
    result = client.responses.create(model="toy", input=say("Hello there"))
    assert result.object == "response" and result.id.startswith("resp_")
    assert result.status == "completed" and result.model == "toy"
    assert result.output_text == "Hello there"
    [item] = result.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert prompt_of(engine).startswith("<|im_start|>user\n<<say:Hello there")


def test_usage_counts_input_and_output_tokens(client: openai.OpenAI, engine: Any) -> None:
    result = client.responses.create(model="toy", input="Hi", max_output_tokens=3)
    assert result.usage is not None
    assert result.usage.output_tokens == 3
    assert result.usage.input_tokens == len(engine.received[-1].input_ids)
    assert result.usage.total_tokens == result.usage.input_tokens + 3
    assert result.usage.input_tokens_details.cached_tokens == result.usage.input_tokens // 2


def test_item_input_follows_the_instructions(client: openai.OpenAI, engine: Any) -> None:
    client.responses.create(
        model="toy",
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "First"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Reply"}]},
            {"type": "message", "role": "user", "content": "Second"},
        ],
    )
    assert prompt_of(engine) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nFirst<|im_end|>\n"
        "<|im_start|>assistant\nReply<|im_end|>\n<|im_start|>user\nSecond<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_max_output_tokens_cut_makes_the_response_incomplete(
    client: openai.OpenAI, engine: Any
) -> None:
    result = client.responses.create(model="toy", input="Hi", max_output_tokens=4)
    assert engine.received[-1].params.max_new_tokens == 4
    assert result.status == "incomplete"
    assert result.incomplete_details is not None
    assert result.incomplete_details.reason == "max_output_tokens"
    assert result.output_text == "The quick brown fox"


def test_sampling_fields_reach_the_engine_and_are_echoed(
    client: openai.OpenAI, engine: Any
) -> None:
    result = client.responses.create(
        model="toy", input="Hi", temperature=0.5, top_p=0.75, metadata={"k": "v"}, user="u1"
    )
    params = engine.received[-1].params
    assert params.temperature == 0.5 and params.top_p == 0.75
    assert (result.temperature, result.top_p) == (0.5, 0.75)
    assert result.metadata == {"k": "v"} and result.user == "u1"


def test_streamed_events_come_in_order_and_deltas_add_up(client: openai.OpenAI) -> None:
    with client.responses.stream(model="toy", input=say("Streamed words here")) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert len(deltas) > 1
    assert "".join(e.delta for e in deltas) == "Streamed words here" == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.status == "completed" and final.usage is not None


def test_raw_stream_names_each_event_in_an_event_line(http: httpx.Client) -> None:
    body = {"model": "toy", "input": say("ok"), "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert (
            event_line.removeprefix("event: ")
            == json.loads(data_line.removeprefix("data: "))["type"]
        )
    assert (
        json.loads(blocks[-1].split("\n")[1][6:])["response"]["output"][0]["content"][0]["text"]
        == "ok"
    )


def test_stream_create_reports_an_incomplete_response(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model="toy", input="Hi", max_output_tokens=2, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details is not None
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.status == "incomplete"


def test_json_schema_text_format_constrains_the_output(client: openai.OpenAI, engine: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"],
    }
    result = client.responses.create(
        model="toy",
        input="The capital of France as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    assert json.loads(str(engine.received[-1].params.json_schema)) == schema
    value = json.loads(result.output_text)
    assert isinstance(value["name"], str) and isinstance(value["population"], int)
    assert result.text is not None and result.text.format is not None
    assert result.text.format.type == "json_schema"


def test_json_object_text_format_asks_for_an_object(client: openai.OpenAI, engine: Any) -> None:
    client.responses.create(model="toy", input="Hi", text={"format": {"type": "json_object"}})
    assert json.loads(str(engine.received[-1].params.json_schema)) == {"type": "object"}


def test_function_tools_give_function_call_items(client: openai.OpenAI, engine: Any) -> None:
    result = client.responses.create(
        model="toy",
        input=say(f"Let me check.{CALL}"),
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
    )
    assert "<tools>" in prompt_of(engine)
    message, call = result.output
    assert message.type == "message" and result.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and str(call.id).startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert result.tools[0].type == "function" and result.tool_choice == "auto"


def test_named_tool_choice_constrains_to_the_arguments(client: openai.OpenAI, engine: Any) -> None:
    result = client.responses.create(
        model="toy",
        input="Weather?",
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert json.loads(str(engine.received[-1].params.json_schema)) == WEATHER_TOOL["parameters"]
    [call] = result.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}


def test_streamed_function_call_arguments_add_up(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="toy",
        input=say(CALL),
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call"
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"city": "Paris"}
    assert final.output[0].type == "function_call"
    assert final.output[0].arguments == arguments


def test_function_call_output_items_render_as_tool_results(
    client: openai.OpenAI, engine: Any
) -> None:
    client.responses.create(
        model="toy",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        max_output_tokens=2,
    )
    prompt = prompt_of(engine)
    assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>sunny" in prompt


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, engine: Any
) -> None:
    first = client.responses.create(model="toy", input=say("Nice to meet you"), instructions="X")
    second = client.responses.create(
        model="toy", input="And now?", previous_response_id=first.id, max_output_tokens=2
    )
    prompt = prompt_of(engine)
    assert "<<say:Nice to meet you:say>>" in prompt
    assert "<|im_start|>assistant\nNice to meet you<|im_end|>" in prompt
    assert prompt.index("Nice to meet you<|im_end|>") < prompt.index("And now?")
    assert "X<|im_end|>" not in prompt  # instructions are not carried over
    assert second.previous_response_id == first.id


def test_streamed_responses_are_stored_too(client: openai.OpenAI, engine: Any) -> None:
    events = list(client.responses.create(model="toy", input=say("streamed"), stream=True))
    response_id = events[-1].response.id
    assert client.responses.retrieve(response_id).output_text == "streamed"
    client.responses.create(model="toy", input="more", previous_response_id=response_id)
    assert "<|im_start|>assistant\nstreamed<|im_end|>" in prompt_of(engine)


def test_function_calls_chain_through_previous_response_id(
    client: openai.OpenAI, engine: Any
) -> None:
    first = client.responses.create(
        model="toy",
        input=say(CALL),
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
    )
    call = first.output[0]
    assert call.type == "function_call"
    client.responses.create(
        model="toy",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rainy"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
    )
    prompt = prompt_of(engine)
    assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>rainy" in prompt


def test_retrieve_returns_the_stored_response(client: openai.OpenAI) -> None:
    created = client.responses.create(model="toy", input=say("kept"))
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == "kept"


def test_unstored_response_cannot_be_continued(client: openai.OpenAI) -> None:
    created = client.responses.create(model="toy", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model="toy", input="More", previous_response_id=created.id)
    assert created.id in str(raised.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_unknown_previous_response_is_404(http: httpx.Client) -> None:
    response = http.post(
        "/v1/responses", json={"model": "toy", "input": "Hi", "previous_response_id": "resp_x"}
    )
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Previous response with id 'resp_x' not found."
    assert response.json()["error"]["param"] == "previous_response_id"


def test_deleted_response_is_gone(client: openai.OpenAI) -> None:
    created = client.responses.create(model="toy", input="Hi", max_output_tokens=1)
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_the_store_keeps_only_the_latest(make_server: Any) -> None:
    live, _ = make_server(ServerConfig(response_store_size=2))
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    ids = [
        client.responses.create(model="default", input="Hi", max_output_tokens=1).id for _ in "abc"
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[2]).id == ids[2]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "frobnicate": 1}, "frobnicate"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "Hi", "background": True}, "background"),
        (
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
        ),
        ({"input": "Hi", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "Hi", "temperature": -1}, "temperature"),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/responses", json={"model": "toy", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_another_model_name_is_refused(http: httpx.Client) -> None:
    response = http.post("/v1/responses", json={"model": "gpt-5", "input": "Hi"})
    assert response.status_code in (400, 404)
    assert response.json()["error"]["param"] == "model"


def test_response_store_size_flag_reaches_the_config() -> None:
    from radixlm.server.cli import build_parser, server_config

    args = build_parser().parse_args(["--response-store-size", "7"])
    assert server_config(args).response_store_size == 7
    assert server_config(build_parser().parse_args([])).response_store_size == 1024


def test_response_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(2)
    for name in "abc":
        if name == "c":
            assert store.get("a") is not None  # a is now more recent than b
        store.put(name, StoredResponse({"id": name}, ()))
        store.check_invariants()
    assert [n for n in "abc" if store.get(n) is not None] == ["a", "c"]
    assert store.delete("a") and not store.delete("a")
    empty = ResponseStore(0)
    empty.put("x", StoredResponse({}, ()))
    assert empty.get("x") is None


def test_reasoning_comes_first_as_a_reasoning_item(make_server: Any) -> None:
    live, _ = make_server(ServerConfig(reasoning_parser="qwen3"))
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    result = client.responses.create(model="default", input=say("<think>hmm</think>Answer"))
    reasoning, message = result.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text.strip() == "hmm"
    assert message.type == "message" and result.output_text.strip() == "Answer"
    with client.responses.stream(model="default", input=say("<think>hmm</think>Answer")) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text.strip() == "Answer"


def test_constraint_clashes_name_the_responses_fields(http: httpx.Client) -> None:
    body = {
        "model": "toy",
        "input": "Hi",
        "text": {"format": {"type": "json_object"}},
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
    }
    error = http.post("/v1/responses", json=body).json()["error"]
    assert error["param"] == "tool_choice" and "text.format" in error["message"]


class FailingEngine(fake.FakeEngine):  # type: ignore[misc]
    """Fails after its first streamed chunk."""

    async def generate(self, request: Any) -> AsyncIterator[GenerateChunk]:
        async for chunk in super().generate(request):
            yield chunk
            raise RuntimeError("the GPU caught fire")


def test_an_engine_failure_mid_stream_sends_error_then_failed(tokenizer: Any) -> None:
    app = create_app(FailingEngine(tokenizer), ServerConfig(served_model_name="toy"))
    body = {"model": "toy", "input": say("some words"), "stream": True}
    with (
        TestClient(app) as test_client,
        test_client.stream("POST", "/v1/responses", json=body) as response,
    ):
        text = response.read().decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "the GPU caught fire" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed"
    assert app.state.radixlm.responses.get(events[-1]["response"]["id"]) is None
