"""Streaming from the live server: text_iter over a variable or the whole text, and async."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import endpoint_fixture, live_fixture  # noqa: F401

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(60)

PROMPT = "The capital of France?"
#: Long enough that the answer outlasts the reader's first wake-up: chunks that arrive while
#: the reader is busy are merged into one, and the tiny model on the C kernels decodes a
#: token in a fraction of a millisecond (16 tokens once came as one piece).
TOKENS = 64


@sgl.function
def ask(s):
    s += PROMPT
    s += sgl.gen("answer", max_tokens=TOKENS, ignore_eos=True)


def test_text_iter_of_a_variable_yields_it_piece_by_piece(endpoint):
    state = ask.run(backend=endpoint, stream=True, temperature=0)
    pieces = list(state.text_iter("answer"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] == TOKENS


def test_a_streamed_gen_equals_the_same_gen_unstreamed(endpoint):
    streamed = ask.run(backend=endpoint, stream=True, temperature=0)
    streamed_text = "".join(streamed.text_iter("answer"))
    assert streamed_text == ask.run(backend=endpoint, temperature=0)["answer"]


def test_text_iter_without_a_name_yields_the_whole_text(endpoint):
    state = ask.run(backend=endpoint, stream=True, temperature=0)
    assert "".join(state.text_iter()) == PROMPT + state["answer"]


def test_stream_meta_info_ends_with_the_finish_reason(endpoint):
    state = ask.run(backend=endpoint, stream=True, temperature=0)
    "".join(state.text_iter("answer"))
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "length"


def test_async_text_iter_yields_the_same_text(endpoint):
    async def collect() -> tuple[list[str], str]:
        state = ask.run(backend=endpoint, stream=True, temperature=0)
        pieces = [piece async for piece in state.text_async_iter("answer")]
        return pieces, state["answer"]

    pieces, answer = asyncio.run(collect())
    assert len(pieces) > 1 and "".join(pieces) == answer


def test_a_streamed_chat_turn_streams_only_the_answer(endpoint):
    @sgl.function
    def chat(s):
        s += sgl.user("Hi?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, ignore_eos=True))

    state = chat.run(backend=endpoint, stream=True, temperature=0)
    streamed = "".join(state.text_iter("answer"))
    assert streamed == state["answer"] and "<|im_end|>" not in streamed
    assert state.text().endswith(streamed + "<|im_end|>\n")


def test_a_failed_stream_raises_from_text_iter_naming_the_gen(endpoint):
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("answer", regex=r"(?=A)[A-Z]+")

    state = bad.run(backend=endpoint, stream=True)
    with pytest.raises(sgl.ProgramError, match=r"gen\('answer'\)"):
        list(state.text_iter("answer"))
