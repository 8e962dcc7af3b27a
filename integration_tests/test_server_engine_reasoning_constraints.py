"""Structured output for reasoning models through the server and the real engine: with
`--reasoning-parser`, a chat's `response_format` shapes the answer after `</think>`, not the
thinking. The tiny model's thinking is scripted by a custom logit processor (it forces the
tokens of a text that is no JSON, then of `</think>`, and leaves the logits alone after them);
its tokenizer writes `</think>` as several tokens."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Paris", "London"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
THOUGHT = "Paris, I think { not JSON"
_keys = itertools.count()


@pytest.fixture(scope="module")
def reasoning_server(serve: Callable[..., Any]) -> Any:
    return serve({"reasoning_parser": "deepseek-r1", "enable_custom_logit_processor": True})


def _scripted(server: Any) -> dict[str, Any]:
    """The chat's extra body that makes the model think THOUGHT and end its thinking."""
    from radixlm.runtime.fixtures import ScriptedTokensProcessor

    ids = server.engine.tokenizer.encode(f"{THOUGHT}</think>", add_special_tokens=False)
    return {
        "custom_logit_processor": ScriptedTokensProcessor.to_str(),
        "custom_params": {"script": list(ids), "script_key": f"chat-{next(_keys)}"},
    }


def _chat(server: Any, stream: bool) -> Any:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Which city?"}],
        response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=80,
        stream=stream,
        extra_body=_scripted(server),
    )


def test_reasoning_content_is_free_and_content_is_valid_json(reasoning_server: Any) -> None:
    message = _chat(reasoning_server, stream=False).choices[0].message
    assert getattr(message, "reasoning_content", None) == THOUGHT
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)
    reasoning_server.assert_no_leaks()


def test_the_streamed_answer_splits_the_same_way(reasoning_server: Any) -> None:
    thought = content = ""
    for chunk in _chat(reasoning_server, stream=True):
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert thought == THOUGHT
    jsonschema.validate(json.loads(content), SCHEMA)
