"""DataParallelEngine over simulated replicas: it routes by prefix, follows each request's
rid for abort, sums the replicas' figures, and keeps serving when a replica goes down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from radixlm.router import DataParallelEngine
from radixlm.sampling import (
    EmbeddingOutput,
    EmbeddingRequest,
    EngineUnavailable,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
)


class WordTokenizer:
    """Each word is one token: its length (enough for prefixes to match as words do)."""

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, word)) for word in text.split()]


class FakeReplica:
    """An engine that answers at once, remembers the prompts it saw (its "cache") and
    reports the cached tokens a real radix cache would: the longest prefix seen before."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tokenizer = WordTokenizer()
        self.seen: list[list[int]] = []
        self.healthy = True
        self.failed = False
        self.aborted: list[str] = []
        self.hold: asyncio.Event | None = None  # set: generate waits for it

    def _cached(self, ids: list[int]) -> int:
        best = 0
        for other in self.seen:
            n = 0
            while n < min(len(ids), len(other)) and ids[n] == other[n]:
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if not self.healthy:
            raise EngineUnavailable(f"{self.name} is down")
        ids = (
            list(request.input_ids)  # type: ignore[arg-type]
            if request.input_ids is not None
            else self.tokenizer.encode(str(request.text))
        )
        cached = self._cached(ids)
        self.seen.append(ids)
        if self.hold is not None:
            await self.hold.wait()
            if not self.healthy:
                raise EngineUnavailable(f"{self.name} died")
        yield GenerateChunk(
            rid=str(request.rid),
            index=0,
            text=self.name,
            output_ids=(1,),
            prompt_tokens=len(ids),
            completion_tokens=1,
            cached_tokens=cached,
            finish_reason=FinishReason(type="length"),
        )

    async def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return True

    async def flush_cache(self) -> bool:
        self.seen.clear()
        return True

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "fake", "max_context_length": 100}

    def server_info(self) -> dict[str, Any]:
        prompt = sum(len(s) for s in self.seen)
        return {
            "model_path": "fake",
            "num_running_reqs": 0,
            "num_queued_reqs": 0,
            "token_usage": 0.5,
            "prompt_tokens": prompt,
            "cached_tokens": 0,
            "max_total_num_tokens": 1000,
        }


PREFIXES = [
    " ".join(
        f"{word}{p}"
        for word in ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    )
    for p in range(4)
]


def _requests(rounds: int = 8) -> list[GenerateRequest]:
    import random

    rng = random.Random(0)
    out = []
    for r in range(rounds):
        order = list(range(4))
        rng.shuffle(order)
        out += [
            GenerateRequest(text=f"{PREFIXES[p]} question {r} of {p}", rid=f"r{r}-{p}")
            for p in order
        ]
    return out


async def _run(engine: DataParallelEngine, requests: list[GenerateRequest]) -> list[GenerateChunk]:
    chunks = []
    for request in requests:
        chunks += [c async for c in engine.generate(request)]
    return chunks


@pytest.mark.parametrize("match_on", ["tokens", "text"])
def test_cache_aware_keeps_prefixes_together_round_robin_does_not(match_on: str) -> None:
    cached = {}
    for policy in ("cache_aware", "round_robin"):
        replicas = [FakeReplica("a"), FakeReplica("b")]
        engine = DataParallelEngine(replicas, policy, match_on=match_on)
        chunks = asyncio.run(_run(engine, _requests()))
        cached[policy] = sum(c.cached_tokens for c in chunks)
        if policy == "cache_aware":
            assert {c.text for c in chunks} == {"a", "b"}  # both replicas work
            for prefix in PREFIXES:  # and every prompt of one prefix went to one of them
                where = {
                    r.name for r in replicas for ids in r.seen
                    if ids[:8] == WordTokenizer().encode(prefix)
                }  # fmt: skip
                assert len(where) == 1, where
    # One replica alone would reuse 8 words of prefix for 7 of each prefix's 8 requests.
    single = 4 * 7 * 8
    assert cached["cache_aware"] >= 0.9 * single
    assert cached["round_robin"] < cached["cache_aware"]


def test_chats_arrive_as_token_ids_and_route_by_them() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b")]
    engine = DataParallelEngine(replicas, "cache_aware")
    ids = list(range(50))
    first = asyncio.run(_run(engine, [GenerateRequest(input_ids=ids, rid="x")]))[0].text
    again = asyncio.run(_run(engine, [GenerateRequest(input_ids=[*ids, 99], rid="y")]))[0]
    assert again.text == first and again.cached_tokens == 50


def test_abort_reaches_the_replica_that_runs_the_request() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b")]
    engine = DataParallelEngine(replicas, "round_robin")

    async def main() -> tuple[bool, bool]:
        hold = asyncio.Event()
        for r in replicas:
            r.hold = hold
        task = asyncio.ensure_future(_run(engine, [GenerateRequest(text="x y", rid="long")]))
        await asyncio.sleep(0.01)
        found = await engine.abort("long")
        unknown = await engine.abort("nobody")
        hold.set()
        await task
        return found, unknown

    found, unknown = asyncio.run(main())
    assert found and not unknown
    assert sum(r.aborted.count("long") for r in replicas) == 1
    assert engine.router.replica("0").in_flight == engine.router.replica("1").in_flight == 0


def test_a_dead_replica_fails_its_requests_and_the_others_serve() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b")]
    engine = DataParallelEngine(replicas, "cache_aware")

    async def main() -> tuple[BaseException | None, list[str]]:
        hold = asyncio.Event()
        replicas[0].hold = hold
        replicas[1].hold = hold
        stuck = asyncio.ensure_future(_run(engine, [GenerateRequest(text="p q r", rid="1")]))
        await asyncio.sleep(0.01)
        home = next(r for r in replicas if r.seen)
        home.healthy = False  # it dies with the request in flight
        hold.set()
        try:
            await stuck
            error = None
        except EngineUnavailable as caught:
            error = caught
        after = await _run(engine, [GenerateRequest(text="p q r", rid=f"n{i}") for i in range(5)])
        return error, [c.text for c in after]

    error, served_by = asyncio.run(main())
    assert isinstance(error, EngineUnavailable)
    assert len(set(served_by)) == 1 and len(served_by) == 5  # all on the one that lives
    assert engine.healthy
    for r in replicas:
        r.healthy = False
    with pytest.raises(EngineUnavailable, match="no replica is serving"):
        asyncio.run(_run(engine, [GenerateRequest(text="p", rid="z")]))
    assert not engine.healthy


def test_server_info_sums_the_replicas_and_lists_each() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b")]
    engine = DataParallelEngine(replicas, "power_of_two")
    asyncio.run(_run(engine, _requests(2)))
    info = engine.server_info()
    assert info["dp_size"] == 2 and info["router_policy"] == "power_of_two"
    assert info["max_total_num_tokens"] == 2000
    assert info["prompt_tokens"] == sum(len(s) for r in replicas for s in r.seen)
    assert [r["id"] for r in info["replicas"]] == ["0", "1"]
    assert all(r["healthy"] and r["in_flight"] == 0 for r in info["replicas"])
    assert engine.model_info()["dp_size"] == 2
    assert asyncio.run(engine.flush_cache()) is True
    assert all(not r.seen for r in replicas)


def test_a_prefill_server_routes_each_bootstrap_room_to_its_replica() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    engine = DataParallelEngine(replicas, "cache_aware", follow_bootstrap_room=True)
    rooms = [7, 8, 9, 10, 2**62 + 1]
    requests = [GenerateRequest(text="same prompt", bootstrap_room=r, rid=str(r)) for r in rooms]
    chunks = asyncio.run(_run(engine, requests))
    assert [c.text for c in chunks] == [replicas[r % 3].name for r in rooms]
    assert engine.server_info()["router_policy"] == "follow_bootstrap_room"
    replicas[1].healthy = False  # the room's replica is down: no other may take it
    with pytest.raises(EngineUnavailable, match="replica 1"):
        asyncio.run(_run(engine, [GenerateRequest(text="x", bootstrap_room=4)]))
    # Without the option a room is no routing key (a decode server's replicas).
    plain = DataParallelEngine(replicas[::2], "round_robin")
    chunks = asyncio.run(_run(plain, [GenerateRequest(text="y", bootstrap_room=0)] * 2))
    assert [c.text for c in chunks] == ["a", "c"]


def test_server_info_sums_disaggregation_queues_where_reported() -> None:
    class Queued(FakeReplica):
        def server_info(self) -> dict[str, Any]:
            return {**super().server_info(), "num_decode_transfer_queue_reqs": 2}

    info = DataParallelEngine([Queued("a"), Queued("b")]).server_info()
    assert info["num_decode_transfer_queue_reqs"] == 4
    assert [r["num_decode_transfer_queue_reqs"] for r in info["replicas"]] == [2, 2]
    plain = DataParallelEngine([FakeReplica("a"), FakeReplica("b")]).server_info()
    assert "num_decode_transfer_queue_reqs" not in plain


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        DataParallelEngine([])
    with pytest.raises(ValueError, match="match_on"):
        DataParallelEngine([FakeReplica("a")], match_on="bytes")
    with pytest.raises(ValueError, match="router policy must be one of"):
        DataParallelEngine([FakeReplica("a")], "fastest")


class LoraReplica(FakeReplica):
    """A replica with LoRA adapters; `refuse` makes its next load fail."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.adapters: dict[str, str] = {}
        self.refuse = False

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        if self.refuse:
            raise InvalidRequest("lora_path", f"{self.name} cannot read {lora_path}")
        self.adapters[lora_name] = lora_path
        return dict(self.adapters)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        if lora_name not in self.adapters:
            raise InvalidRequest("lora_name", f"no adapter {lora_name}")
        del self.adapters[lora_name]
        return dict(self.adapters)

    def lora_adapters(self) -> dict[str, str]:
        return dict(self.adapters)


def test_lora_adapters_are_loaded_on_every_replica_or_none() -> None:
    replicas = [LoraReplica("a"), LoraReplica("b")]
    engine = DataParallelEngine(replicas)
    assert asyncio.run(engine.load_lora_adapter("x", "/x")) == {"x": "/x"}
    assert [r.adapters for r in replicas] == [{"x": "/x"}, {"x": "/x"}]
    assert engine.lora_adapters() == {"x": "/x"}
    replicas[1].refuse = True
    with pytest.raises(InvalidRequest, match="cannot read"):
        asyncio.run(engine.load_lora_adapter("y", "/y"))
    assert [r.adapters for r in replicas] == [{"x": "/x"}, {"x": "/x"}]  # a took y back
    assert asyncio.run(engine.unload_lora_adapter("x")) == {}
    assert engine.lora_adapters() == {}
    with pytest.raises(InvalidRequest, match="no adapter"):
        asyncio.run(engine.unload_lora_adapter("x"))


class EncodingReplica(FakeReplica):
    """A replica serving a pooling model: its `encode` answers the prompt's length."""

    async def encode(self, request: EmbeddingRequest) -> EmbeddingOutput:
        if not self.healthy:
            raise EngineUnavailable(f"{self.name} is down")
        ids = self.tokenizer.encode(str(request.text))
        cached = self._cached(ids)
        self.seen.append(ids)
        return EmbeddingOutput(str(request.rid), (float(len(ids)),), len(ids), cached)


def test_encode_requests_route_by_prefix_to_the_replica_that_cached_it() -> None:
    replicas = [EncodingReplica("a"), EncodingReplica("b")]
    engine = DataParallelEngine(replicas, "cache_aware")
    instruction = "Instruct: find the passage that answers this question. Query:"

    async def main() -> list[EmbeddingOutput]:
        first = await engine.encode(EmbeddingRequest(text=f"{instruction} one", rid="1"))
        second = await engine.encode(EmbeddingRequest(text=f"{instruction} two", rid="2"))
        return [first, second]

    first, second = asyncio.run(main())
    assert second.cached_tokens == len(instruction.split())  # same replica: its cache hit
    assert sum(len(r.seen) for r in replicas) == 2
    assert first.embedding == (float(len(instruction.split()) + 1),)


def test_encode_on_replicas_without_it_is_refused() -> None:
    engine = DataParallelEngine([FakeReplica("a")], "round_robin")
    with pytest.raises(InvalidRequest, match="pooling"):
        asyncio.run(engine.encode(EmbeddingRequest(text="x", rid="1")))


def test_each_routing_decision_is_a_span_under_the_callers_span() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    replicas = [FakeReplica("a"), FakeReplica("b")]
    engine = DataParallelEngine(replicas, "cache_aware", tracer_provider=provider)
    ids = list(range(50))

    async def requests() -> list[GenerateChunk]:
        with provider.get_tracer("test").start_as_current_span("http"):
            chunks = await _run(engine, [GenerateRequest(input_ids=ids, rid="x")])
            return chunks + await _run(engine, [GenerateRequest(input_ids=[*ids, 7], rid="y")])

    first, second = asyncio.run(requests())
    spans = exporter.get_finished_spans()
    http = next(s for s in spans if s.name == "http")
    routes = [s for s in spans if s.name == "route"]
    assert len(routes) == 2
    for route in routes:
        assert route.parent is not None and route.parent.span_id == http.context.span_id
        assert route.context.trace_id == http.context.trace_id
        assert route.attributes is not None
        assert route.attributes["radixlm.router.policy"] == "cache_aware"
    later = next(r for r in routes if (r.attributes or {})["gen_ai.request.id"] == "y")
    attributes = dict(later.attributes or {})
    # The second prompt extends the first: it goes where the first went, 50 tokens matched.
    assert attributes["radixlm.router.replica"] == "ab".index(first.text)
    assert second.text == first.text
    assert attributes["radixlm.router.reason"] == "prefix"
    assert attributes["radixlm.router.matched_tokens"] == 50
    assert attributes["radixlm.router.prompt_tokens"] == 51
    assert not trace.get_current_span().is_recording()  # nothing left attached


def test_a_routing_failure_is_an_error_span() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    replicas = [FakeReplica("a")]
    replicas[0].healthy = False
    engine = DataParallelEngine(replicas, "round_robin", tracer_provider=provider)
    with pytest.raises(EngineUnavailable):
        asyncio.run(_run(engine, [GenerateRequest(input_ids=[1, 2], rid="z")]))
    (route,) = exporter.get_finished_spans()
    assert route.name == "route" and route.status.status_code is StatusCode.ERROR
