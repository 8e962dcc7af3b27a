"""Streaming: run(stream=True), text_iter over the text or one variable, and the async variant."""

from __future__ import annotations

import asyncio

import pytest

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(30)

ANSWER = " Paris is the capital and largest city of France."


@pytest.fixture
def backend(make_server):
    server = make_server({"The capital of France?": ANSWER})
    server.core.delay = 0.1  # paces the stream: a chunk every 10 ms
    endpoint = sgl.RuntimeEndpoint(server.url, timeout=20)
    endpoint.fake = server
    yield endpoint
    endpoint.close()


@sgl.function
def ask(s):
    s += "The capital of France?"
    s += sgl.gen("answer", max_tokens=64)


def test_text_iter_of_a_variable_yields_it_piece_by_piece(backend):
    state = ask.run(backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert len(pieces) > 1
    assert "".join(pieces) == ANSWER == state["answer"]


def test_streaming_gens_ask_the_server_to_stream(backend):
    state = ask.run(backend=backend, stream=True)
    state.sync()
    assert backend.fake.core.requests[-1]["stream"] is True


def test_text_iter_without_a_name_yields_the_whole_text(backend):
    state = ask.run(backend=backend, stream=True)
    assert "".join(state.text_iter()) == "The capital of France?" + ANSWER


def test_text_iter_without_streaming_yields_the_result_once(backend):
    state = ask.run(backend=backend)
    assert list(state.text_iter("answer")) == [ANSWER]


def test_stream_meta_info_ends_with_the_finish_reason(backend):
    state = ask.run(backend=backend, stream=True)
    "".join(state.text_iter("answer"))
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "stop"


def test_async_text_iter_yields_the_same_text(backend):
    async def collect() -> list[str]:
        state = ask.run(backend=backend, stream=True)
        return [piece async for piece in state.text_async_iter("answer")]

    pieces = asyncio.run(collect())
    assert len(pieces) > 1 and "".join(pieces) == ANSWER


def test_async_text_iter_can_return_meta_data(backend):
    async def collect() -> list[tuple[str, object]]:
        state = ask.run(backend=backend, stream=True)
        return [item async for item in state.text_async_iter("answer", return_meta_data=True)]

    items = asyncio.run(collect())
    assert all(isinstance(meta, dict) for _, meta in items)
    assert "".join(piece for piece, _ in items) == ANSWER


def test_text_iter_raises_the_error_of_a_failed_stream(backend):
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("answer", temperature=-3.0)

    state = bad.run(backend=backend, stream=True)
    with pytest.raises(sgl.ProgramError, match=r"gen\('answer'\)"):
        list(state.text_iter("answer"))


def test_an_exception_in_a_streamed_body_reaches_the_reader(backend):
    @sgl.function
    def broken(s):
        s += "x"
        raise RuntimeError("boom")

    state = broken.run(backend=backend, stream=True)
    with pytest.raises(sgl.ProgramError, match="boom"):
        list(state.text_iter())
