"""The Ray Serve PD client (`radixlm.router.ray.RayPDEngineClient`) over fake deployment
handles: how it pairs the two halves, and what each half's end does to the other; and the
plain client (`RayEngineClient`) when its client leaves. Needs the
`ray` extra (imports only; no Ray instance starts); skips without it. The live application is
tested in integration_tests/test_ray_serve.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'radixlm-router[ray]'")

from ray.serve.exceptions import RequestCancelledError

from radixlm.router.ray import RayEngineClient, RayPDEngineClient
from radixlm.sampling import FinishReason, GenerateChunk, GenerateRequest, InvalidRequest


class FakeStream:
    """A deployment response stream: its items (an exception is raised where it stands), then
    either its end or, with `hold`, nothing until it is cancelled."""

    def __init__(self, items: list[Any], hold: bool = False) -> None:
        self.items = list(items)
        self.hold = hold
        self.cancelled = False
        self._cancel: asyncio.Event | None = None

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, BaseException):
                raise item
            return item
        if not self.hold or self.cancelled:
            raise StopAsyncIteration
        if self._cancel is None:
            self._cancel = asyncio.Event()
        await self._cancel.wait()
        raise RequestCancelledError("fake")

    def cancel(self) -> None:
        self.cancelled = True
        if self._cancel is not None:
            self._cancel.set()


class FakeHandle:
    """A deployment handle whose every call answers with `stream`, recording the requests."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.requests: list[GenerateRequest] = []

    def options(self, **_options: Any) -> FakeHandle:
        return self

    @property
    def prefill(self) -> FakeHandle:
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    def remote(self, request: GenerateRequest, **_kwargs: Any) -> FakeStream:
        self.requests.append(request)
        return self.stream


def _chunk(ids: tuple[int, ...], finish: bool = False, index: int = 0) -> GenerateChunk:
    return GenerateChunk(
        "r1",
        index,
        "",
        ids,
        3,
        len(ids),
        finish_reason=FinishReason(type="length") if finish else None,
    )


def _run(prefill: FakeStream, decode: FakeStream, request: GenerateRequest) -> Any:
    client = RayPDEngineClient(FakeHandle(prefill), FakeHandle(decode), None, {})

    async def collect() -> list[GenerateChunk]:
        return [chunk async for chunk in client.generate(request)]

    handles = (client.prefill_handle, client.handle)
    try:
        return asyncio.run(collect()), handles
    except BaseException as error:
        return error, handles


def test_the_decode_half_gets_the_prefill_replicas_endpoint_and_the_same_room() -> None:
    prefill = FakeStream([("10.0.0.5", 7001), _chunk((5,), finish=True)])
    decode = FakeStream([_chunk((5, 6)), _chunk((5, 6, 7), finish=True)])
    out, (p, d) = _run(prefill, decode, GenerateRequest(input_ids=[1, 2, 3], rid="r1"))
    assert [c.output_ids for c in out] == [(5, 6), (5, 6, 7)]
    (sent_prefill,), (sent_decode,) = p.requests, d.requests
    assert isinstance(sent_prefill.bootstrap_room, int)
    assert sent_prefill.bootstrap_host is None  # the prefill replica names itself
    assert (sent_decode.bootstrap_host, sent_decode.bootstrap_port) == ("10.0.0.5", 7001)
    assert sent_decode.bootstrap_room == sent_prefill.bootstrap_room


def test_a_batch_gets_one_distinct_room_per_prompt() -> None:
    prefill = FakeStream([("h", 7001)])
    decode = FakeStream([_chunk((5,), True, 0), _chunk((6,), True, 1), _chunk((7,), True, 2)])
    request = GenerateRequest(text=["a", "b", "c"], rid=["x", "y", "z"])
    out, (p, d) = _run(prefill, decode, request)
    assert len(out) == 3
    rooms = d.requests[0].bootstrap_room
    assert isinstance(rooms, list) and len(set(rooms)) == 3
    assert rooms == p.requests[0].bootstrap_room
    assert d.requests[0].bootstrap_host == ["h"] * 3
    assert d.requests[0].bootstrap_port == [7001] * 3


def test_a_failed_prefill_half_is_the_answer_and_ends_the_waiting_decode_half() -> None:
    refused = InvalidRequest("sampling_params.n", "n > 1 is not supported here")
    prefill = FakeStream([("h", 7001), refused])
    decode = FakeStream([], hold=True)  # waits for K/V that never comes
    out, _ = _run(prefill, decode, GenerateRequest(input_ids=[1, 2, 3], rid="r1"))
    assert out is refused
    assert decode.cancelled


def test_a_decode_half_that_ends_first_ends_the_prefill_half() -> None:
    prefill = FakeStream([("h", 7001)], hold=True)  # still waiting for the decode's receipt
    decode = FakeStream([_chunk((5,), finish=True)])
    out, _ = _run(prefill, decode, GenerateRequest(input_ids=[1, 2, 3], rid="r1"))
    assert [c.output_ids for c in out] == [(5,)]
    assert prefill.cancelled


def test_a_client_that_leaves_mid_stream_ends_both_halves() -> None:
    prefill = FakeStream([("h", 7001)], hold=True)
    decode = FakeStream([_chunk((5,)), _chunk((5, 6))], hold=True)
    client = RayPDEngineClient(FakeHandle(prefill), FakeHandle(decode), None, {})

    async def leave_after_one() -> None:
        stream = client.generate(GenerateRequest(input_ids=[1, 2, 3], rid="r1"))
        assert (await stream.__anext__()).output_ids == (5,)
        await stream.aclose()  # what the server does when its client disconnects

    asyncio.run(leave_after_one())
    assert decode.cancelled and prefill.cancelled


def test_the_plain_client_cancels_its_replica_stream_when_the_client_leaves() -> None:
    replica = FakeStream([_chunk((5,)), _chunk((5, 6))], hold=True)
    client = RayEngineClient(FakeHandle(replica), None, {})

    async def leave_after_one() -> None:
        stream = client.generate(GenerateRequest(input_ids=[1, 2, 3], rid="r1"))
        assert (await stream.__anext__()).output_ids == (5,)
        await stream.aclose()

    asyncio.run(leave_after_one())
    assert replica.cancelled


def test_the_plain_client_leaves_a_finished_stream_alone() -> None:
    replica = FakeStream([_chunk((5,)), _chunk((5, 6), finish=True)])
    client = RayEngineClient(FakeHandle(replica), None, {})

    async def read_all() -> list[GenerateChunk]:
        return [c async for c in client.generate(GenerateRequest(input_ids=[1, 2], rid="r1"))]

    assert [c.output_ids for c in asyncio.run(read_all())] == [(5,), (5, 6)]
    assert not replica.cancelled
