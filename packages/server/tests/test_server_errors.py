"""Bad input gets a 4xx OpenAI error object naming the problem, and the server stays healthy."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from radixlm.server import ServerConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (route, body, status, the error's param (None: not checked)).
BAD_INPUT: dict[str, tuple[str, Any, int, str | None]] = {
    "generate: body not JSON": ("/generate", b"{not json", 400, None),
    "generate: body a list": ("/generate", [1, 2], 400, None),
    "generate: empty body": ("/generate", b"", 400, None),
    "generate: no prompt": ("/generate", {"sampling_params": {}}, 400, "text"),
    "generate: unknown field": ("/generate", {"text": "a", "txet": 1}, 400, "txet"),
    "generate: top_p out of range": (
        "/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, "sampling_params.top_p"
    ),
    "generate: temperature not a number": (
        "/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, 400, None
    ),
    "generate: unknown sampling field": (
        "/generate", {"text": "a", "sampling_params": {"top_kk": 1}}, 400, None
    ),
    "generate: two constraints": (
        "/generate", {"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
        400, None,
    ),
    "generate: regex that does not compile (engine grammar error)": (
        "/generate", {"text": "a", "sampling_params": {"regex": "(unclosed"}}, 400,
        "sampling_params.regex",
    ),
    "generate: token id outside the vocabulary": (
        "/generate", {"input_ids": [1, 10**6]}, 400, "input_ids"
    ),
    "generate: logit_bias id outside the vocabulary": (
        "/generate", {"text": "a", "sampling_params": {"logit_bias": {"999999": 1}}}, 400,
        "sampling_params.logit_bias",  # as the body holds it, like every sampling error
    ),
    "generate: token-id prompt longer than the context": (
        "/generate", {"input_ids": [5] * 600}, 400, "input_ids"
    ),
    "generate: text prompt longer than the context": (
        "/generate", {"text": "fox " * 600}, 400, "text"
    ),
    "generate: duplicate rids in a batch": (
        "/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, 400, "rid"
    ),
    "generate: custom logit processor that is not one": (
        "/generate", {"text": "a", "custom_logit_processor": "os:system"}, 400,
        "custom_logit_processor",
    ),
    "completions: unknown model": (
        COMPLETIONS, {"model": "gpt-9", "prompt": "a"}, 404, "model"
    ),
    "completions: no prompt": (COMPLETIONS, {"model": "toy"}, 400, "prompt"),
    "completions: unknown field": (COMPLETIONS, {"prompt": "a", "temprature": 1}, 400, "temprature"),
    "completions: n is 0": (COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n"),
    "completions: temperature negative": (
        COMPLETIONS, {"prompt": "a", "temperature": -1}, 400, "temperature"
    ),
    "completions: max_tokens negative": (
        COMPLETIONS, {"prompt": "a", "max_tokens": -5}, 400, "max_tokens"
    ),
    "completions: logprobs too many": (COMPLETIONS, {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    "completions: suffix": (COMPLETIONS, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    "completions: best_of above n": (COMPLETIONS, {"prompt": "a", "best_of": 3}, 400, "best_of"),
    "completions: stream_options without stream": (
        COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, 400,
        "stream_options",
    ),
    "completions: logit_bias key not an id": (
        COMPLETIONS, {"prompt": "a", "logit_bias": {"abc": 1}}, 400, "logit_bias"
    ),
    "completions: empty prompt list": (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    "completions: prompt longer than the context": (
        COMPLETIONS, {"prompt": [7] * 700}, 400, "prompt"
    ),
    "chat: no messages": (CHAT, {"messages": []}, 400, "messages"),
    "chat: unknown role": (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    "chat: user message without content": (CHAT, {"messages": [{"role": "user"}]}, 400, None),
    "chat: image content on a text-only model": (
        CHAT, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
        "messages.0.content.0",
    ),
    "chat: audio content": (
        CHAT, {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, 400,
        "messages.0.content.0",
    ),
    "generate: image_data on a text-only model": (
        "/generate", {"text": "a", "image_data": "data:image/png;base64,AA=="}, 400, "image_data"
    ),
    "chat: template refuses the conversation": (
        CHAT, {"messages": [{"role": "assistant", "content": "first"}]}, 400, "messages"
    ),
    "chat: tool_choice without tools": (
        CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"
    ),
    "chat: named tool not among the tools": (
        CHAT, {"messages": USER, "tools": [TOOL],
               "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
        "tool_choice",
    ),
    "chat: bad tool name": (
        CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        400, None,
    ),
    "chat: top_logprobs without logprobs": (
        CHAT, {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs"
    ),
    "chat: json_schema format without a schema": (
        CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400, None
    ),
    "chat: response_format and regex together": (
        CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "regex": "a"}, 400,
        "regex",
    ),
    "chat: required tools and response_format together": (
        CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": "required",
               "response_format": {"type": "json_object"}}, 400, "tool_choice",
    ),
    "chat: legacy functions": (CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400,
                               "functions"),
    "chat: max_tokens and max_completion_tokens differ": (
        CHAT, {"messages": USER, "max_tokens": 3, "max_completion_tokens": 4}, 400,
        "max_completion_tokens",
    ),
    "chat: json_schema extra that is not JSON": (
        CHAT, {"messages": USER, "json_schema": "{nope"}, 400, "json_schema"
    ),
    "abort_request: no rid": ("/abort_request", {}, 400, "rid"),
}  # fmt: skip


def post(http: httpx.Client, route: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(route, content=body, headers={"Content-Type": "application/json"})
    return http.post(route, json=body)


def assert_healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_4xx_and_the_server_stays_healthy(http: httpx.Client, case: str) -> None:
    route, body, status, param = BAD_INPUT[case]
    response = post(http, route, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["message"] and error["type"] == kind
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert_healthy(http)


def test_streamed_request_with_bad_input_is_a_400_before_streaming(http: httpx.Client) -> None:
    body = {"text": "a", "stream": True, "sampling_params": {"regex": "(bad"}}
    response = http.post("/generate", json=body)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")


def test_openai_client_sees_bad_request_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=USER)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found"
    assert "'toy'" in str(missing.value)  # names the served model
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="toy", messages=USER, temperature=-1)


def test_unknown_route_is_404(http: httpx.Client) -> None:
    response = http.get("/v2/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_wrong_method_is_405(http: httpx.Client) -> None:
    assert http.get("/generate").status_code == 405


def test_overloaded_engine_answers_503(make_server: Any) -> None:
    live, _ = make_server(ServerConfig(), max_queued=0)
    response = httpx.post(f"{live.url}/generate", json={"text": "a"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "overloaded_error"
    stream = httpx.post(f"{live.url}{CHAT}", json={"messages": USER, "stream": True})
    assert stream.status_code == 503
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model="toy/fake-model", prompt="a")
    assert raised.value.status_code == 503


class TestApiKey:
    @pytest.fixture
    def live(self, make_server: Any) -> Any:
        return make_server(ServerConfig(api_key="sesame"))[0]

    def test_missing_key_is_401(self, live: Any) -> None:
        response = httpx.post(f"{live.url}/generate", json={"text": "a"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"

    def test_wrong_key_is_401(self, live: Any) -> None:
        headers = {"Authorization": "Bearer nope"}
        assert httpx.get(f"{live.url}/v1/models", headers=headers).status_code == 401
        assert httpx.get(f"{live.url}/metrics", headers=headers).status_code == 401
        assert httpx.get(f"{live.url}/nothing", headers=headers).status_code == 401

    def test_right_key_is_served(self, live: Any) -> None:
        headers = {"Authorization": "Bearer sesame"}
        assert httpx.get(f"{live.url}/v1/models", headers=headers).status_code == 200
        assert httpx.get(f"{live.url}/get_model_info", headers={"x-api-key": "sesame"}).is_success

    def test_health_needs_no_key(self, live: Any) -> None:
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/health_generate").status_code == 200

    def test_openai_client_with_the_wrong_key_gets_authentication_error(self, live: Any) -> None:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        good = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sesame", max_retries=0)
        assert good.models.list().data[0].id == "toy/fake-model"
