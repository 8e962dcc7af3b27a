"""`--enable-cache-report`: OpenAI usage carries `prompt_tokens_details.cached_tokens` (chat,
completions, the streamed usage chunk) only when it is on, as in SGLang."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from radixlm.server import ServerConfig

USER = [{"role": "user", "content": "Hi"}]
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
def post(make_server: Any) -> Callable[..., dict[str, Any]]:
    """POST a body to a fresh server with or without the cache report; the response's usage
    (a streamed call's: its last usage chunk's)."""

    def send(report: bool, path: str, body: dict[str, Any]) -> dict[str, Any]:
        live, _ = make_server(ServerConfig(served_model_name="toy", enable_cache_report=report))
        body = {"model": "toy", **body}
        reply = httpx.post(f"{live.url}{path}", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        if not body.get("stream"):
            return dict(reply.json()["usage"])
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        return dict(chunks[-1]["usage"])

    return send


CALLS = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3}),
    "completions": ("/v1/completions", {"prompt": "Hi there", "max_tokens": 3}),
    "streamed chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, **STREAM}),
    "streamed completions": ("/v1/completions", {"prompt": "Hi there", "max_tokens": 3, **STREAM}),
}


@pytest.mark.parametrize("call", CALLS)
def test_usage_reports_cached_tokens_when_the_cache_report_is_on(
    post: Callable[..., dict[str, Any]], call: str
) -> None:
    usage = post(True, *CALLS[call])
    assert usage["prompt_tokens"] > 0
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"] // 2}


@pytest.mark.parametrize("call", CALLS)
def test_usage_has_no_details_when_the_cache_report_is_off(
    post: Callable[..., dict[str, Any]], call: str
) -> None:
    usage = post(False, *CALLS[call])
    assert usage["prompt_tokens"] > 0 and "prompt_tokens_details" not in usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_the_responses_api_reports_cached_tokens_either_way(
    post: Callable[..., dict[str, Any]],
) -> None:
    usage = post(False, "/v1/responses", {"input": "Hi", "max_output_tokens": 3})
    assert usage["input_tokens_details"]["cached_tokens"] == usage["input_tokens"] // 2
