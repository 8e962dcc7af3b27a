"""Beam search over HTTP on the real engine: `use_beam_search` through the official `openai`
client's `extra_body` gives the engine's own beam search results, and leaks nothing."""

from __future__ import annotations

from typing import Any

import openai
import pytest

MODEL = "tiny-llama"
PROMPT = "the model is a cache of the"


def test_beam_search_completions_are_the_engines_beams_best_first(
    client: openai.OpenAI, server: Any
) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        n=2,
        max_tokens=8,
        extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5},
    )
    expected = server.engine.beam_search(PROMPT, 3, 8, 0.5)
    assert [c.text for c in out.choices] == [r["text"] for r in expected[:2]]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.finish_reason for c in out.choices] == [
        r["meta_info"]["finish_reason"]["type"] for r in expected[:2]
    ]
    assert out.usage is not None
    assert out.usage.completion_tokens == sum(len(r["output_ids"]) for r in expected[:2])
    server.assert_no_leaks()


def test_one_beam_is_the_greedy_completion(client: openai.OpenAI, server: Any) -> None:
    beam = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"use_beam_search": True}
    )
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert beam.choices[0].text == greedy.choices[0].text
    server.assert_no_leaks()


def test_streaming_beam_search_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, extra_body={"use_beam_search": True}
        )
    assert error.value.body["param"] == "stream"  # type: ignore[index]


def test_a_search_past_the_context_is_a_400_naming_max_tokens(
    client: openai.OpenAI, server: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5000, extra_body={"use_beam_search": True}
        )
    assert error.value.body["param"] == "max_tokens"  # type: ignore[index]
    server.assert_no_leaks()
