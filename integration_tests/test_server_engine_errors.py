"""Bad input against the real engine: every item is a 4xx (or 503) OpenAI error object, never a
500, and the server still generates afterwards."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

MODEL = "tiny-llama"
TOO_LONG = 2048  # tokens; the servers' engines hold 1024 (conftest.CONTEXT_LENGTH)
LONG_TEXT = "the radix tree " * TOO_LONG
SCHEMA_NOT_JSON = "{not json"

Case = tuple[str, str, Any, int, str | None]

# (route, label, body, status, the error's param when it names one)
BAD_INPUT: list[Case] = [
    # ranges
    ("/v1/completions", "temperature < 0", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", "top_p > 1", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", "max_tokens < 0", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", "n = 0", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", "logprobs > 20", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/chat/completions", "top_logprobs > 20",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99},
     400, "top_logprobs"),
    ("/v1/chat/completions", "presence_penalty > 2",
     {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 5}, 400,
     "presence_penalty"),
    ("/generate", "native top_k = -2",
     {"text": "x", "sampling_params": {"top_k": -2}}, 400, "sampling_params.top_k"),
    ("/generate", "token id outside the vocabulary",
     {"input_ids": [1, 10**6], "sampling_params": {"max_new_tokens": 2}}, 400, "input_ids"),
    ("/v1/completions", "logit_bias key not a token id",
     {"prompt": "x", "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("/v1/completions", "logit_bias token outside the vocabulary",
     {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    # types
    ("/v1/completions", "temperature as a word", {"prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", "prompt as a number", {"prompt": 12}, 400, "prompt"),
    ("/v1/chat/completions", "messages as a string", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", "message without a role", {"messages": [{"content": "x"}]}, 400,
     None),
    ("/generate", "sampling_params as a list", {"text": "x", "sampling_params": [1]}, 400, None),
    ("/generate", "body as a list", [1, 2], 400, None),
    ("/generate", "body not JSON", "{not json", 400, None),
    ("/v1/completions", "no prompt", {"model": MODEL}, 400, "prompt"),
    ("/generate", "neither text nor input_ids", {"sampling_params": {}}, 400, None),
    # unknown fields
    ("/v1/completions", "unknown top-level field", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/chat/completions", "unknown top-level field",
     {"messages": [{"role": "user", "content": "x"}], "bogus": 1}, 400, "bogus"),
    ("/generate", "unknown sampling param",
     {"text": "x", "sampling_params": {"bogus": 1}}, 400, None),
    ("/generate", "unknown top-level field", {"text": "x", "bogus": 1}, 400, None),
    # grammar errors
    ("/generate", "regex that does not compile",
     {"text": "x", "sampling_params": {"regex": "(unclosed"}}, 400, None),
    ("/generate", "json_schema that is not JSON",
     {"text": "x", "sampling_params": {"json_schema": SCHEMA_NOT_JSON}}, 400, None),
    ("/generate", "EBNF without a root",
     {"text": "x", "sampling_params": {"ebnf": 'greeting ::= "Hi"'}}, 400, None),
    ("/generate", "two constraints at once",
     {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, 400, None),
    ("/v1/completions", "regex extra that does not compile",
     {"prompt": "x", "regex": "[z-a]"}, 400, None),
    ("/v1/chat/completions", "response_format schema of an unknown type",
     {"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema",
                          "json_schema": {"name": "s", "schema": {"type": "bogus"}}}},
     400, None),
    ("/v1/chat/completions", "named tool that is not in tools",
     {"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, None),
    # prompt longer than the context
    ("/v1/completions", "text prompt longer than the context",
     {"prompt": LONG_TEXT, "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", "token prompt longer than the context",
     {"prompt": [5] * TOO_LONG, "max_tokens": 2}, 400, "prompt"),
    ("/v1/chat/completions", "chat longer than the context",
     {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 2}, 400, "messages"),
    ("/generate", "native text longer than the context",
     {"text": LONG_TEXT, "sampling_params": {"max_new_tokens": 2}}, 400, None),
    # unknown model
    ("/v1/completions", "unknown model", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", "unknown model",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
]  # fmt: skip


def _check_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"message", "type", "param", "code"} <= set(error)
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


def _healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200


@pytest.mark.parametrize(
    ("route", "label", "body", "status", "param"),
    BAD_INPUT,
    ids=[f"{route}:{label}" for route, label, *_ in BAD_INPUT],
)
def test_bad_input_is_refused_and_the_server_stays_healthy(
    http: httpx.Client, route: str, label: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, str):
        response = http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(route, json=body)
    _check_error(response, status, param)
    _healthy(http)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_bad_streamed_request_is_refused_before_the_stream(http: httpx.Client, route: str) -> None:
    body: dict[str, Any] = {"stream": True}
    if route == "/generate":
        body |= {"text": "x", "sampling_params": {"regex": "(unclosed"}}
    elif route == "/v1/completions":
        body |= {"prompt": LONG_TEXT}
    else:
        body |= {"messages": [{"role": "user", "content": "x"}], "ebnf": "root ::= "}
    _check_error(http.post(route, json=body), 400, None)
    _healthy(http)


def test_unknown_route_is_404(http: httpx.Client) -> None:
    _check_error(http.get("/v2/nothing"), 404, None)
    _check_error(http.post("/v1/audio/transcriptions", json={"input": "x"}), 404, None)
    _healthy(http)


def test_unknown_model_id_is_404_on_retrieve(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_openai_client_raises_bad_request_with_the_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-3
        )
    assert raised.value.param == "temperature"


def test_abort_of_an_unknown_rid_fails_softly(http: httpx.Client) -> None:
    assert http.post("/abort_request", json={"rid": "nobody"}).json()["success"] is False
    _check_error(http.post("/abort_request", json={"bogus": 1}), 400, None)
    _healthy(http)


def test_a_rid_in_use_is_refused(http: httpx.Client, server: Any) -> None:
    body = {
        "text": "a long one",
        "rid": "dup",
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)
        _check_error(http.post("/generate", json={**body, "stream": False}), 400, "rid")
        assert server.engine.server_info()["num_running_reqs"] == 1
    server.assert_no_leaks()
    _healthy(http)


@pytest.mark.parametrize(
    "input_ids",
    [[1, 10**6], [5] * TOO_LONG],
    ids=["token id outside the vocabulary", "prompt longer than the context"],
)
def test_a_limit_has_one_message_on_the_engine_api_and_over_http(
    http: httpx.Client, server: Any, input_ids: list[int]
) -> None:
    from radixlm.sampling import InvalidRequest

    params = {"max_new_tokens": 2}
    with pytest.raises(InvalidRequest) as raised:
        server.engine.generate(input_ids=input_ids, sampling_params=params)
    body = {"input_ids": input_ids, "sampling_params": params}
    error = _check_error(http.post("/generate", json=body), 400, "input_ids")
    assert error["message"] == str(raised.value)


# --------------------------------------------------------------------------------------- auth


@pytest.fixture(scope="module")
def keyed(serve: Callable[..., Any]) -> Any:
    return serve({"api_key": "sesame"})


@pytest.fixture
def keyed_http(keyed: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        yield http


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "nope"}, {"Authorization": "sesame"}],
    ids=["missing", "wrong bearer", "wrong x-api-key", "no bearer scheme"],
)
@pytest.mark.parametrize(
    ("method", "route"),
    [("POST", "/generate"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
     ("GET", "/get_server_info"), ("GET", "/unknown-route")],
)  # fmt: skip
def test_missing_or_wrong_api_key_is_401(
    keyed_http: httpx.Client, headers: dict[str, str], method: str, route: str
) -> None:
    body = {"text": "x", "prompt": "x"} if method == "POST" else None
    response = keyed_http.request(method, route, json=body, headers=headers)
    _check_error(response, 401, None)
    assert response.headers["www-authenticate"] == "Bearer"
    _healthy(keyed_http)


def test_right_api_key_is_served(keyed: Any) -> None:
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sesame", max_retries=0)
    reply = good.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert reply.choices[0].finish_reason is not None
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with httpx.Client(base_url=keyed.url) as http:
        sent = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                         headers={"x-api-key": "sesame"})  # fmt: skip
        assert sent.status_code == 200


# ------------------------------------------------------------------- no 500 for anything sent


@pytest.mark.parametrize(
    "raw",
    [b"", b"null", b"\xff\xfe", b'{"text": "x", "sampling_params": {"max_new_tokens": 1e400}}',
     json.dumps({"text": "x", "sampling_params": {"stop": [1, 2]}}).encode(),
     json.dumps({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}).encode()],
    ids=["empty", "null", "not utf-8", "huge number", "stop as ints", "batch size mismatch"],
)  # fmt: skip
def test_odd_native_bodies_are_400(http: httpx.Client, raw: bytes) -> None:
    response = http.post("/generate", content=raw, headers={"content-type": "application/json"})
    _check_error(response, 400, None)
    _healthy(http)
