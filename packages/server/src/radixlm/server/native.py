"""SGLang's native routes: /generate (single, batch, streaming), health, model and server info,
cache flush, abort, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixlm.sampling import (
    EmbeddingRequest,
    EngineUnavailable,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
    SamplingParams,
)
from radixlm.server._version import __version__
from radixlm.server.errors import APIError, as_api_error, unavailable
from radixlm.server.metrics import CONTENT_TYPE
from radixlm.server.pooling import refuse_generation
from radixlm.server.state import ServerState, renamed_errors
from radixlm.server.streams import (
    DONE_EVENT,
    EngineJSONResponse,
    EngineStreams,
    EventStreamResponse,
    cancel_on_disconnect,
    sse,
)

# Errors about SamplingParams fields name them as /generate's body holds them.
_SAMPLING_NAMES = {name: f"sampling_params.{name}" for name in SamplingParams.model_fields}


def _schema_of(model: Any) -> dict[str, Any]:
    """An OpenAPI request body documenting `model` (the route parses the body itself)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


class _Generate:
    """One /generate call: maps (stream, sequence) to SGLang's flat output index."""

    def __init__(self, state: ServerState, request: GenerateRequest) -> None:
        self.items = [state.prepare(item) for item in request.split()]
        if state.config.reasoning_parser is None and any(i.require_reasoning for i in self.items):
            raise InvalidRequest(
                "require_reasoning",
                "needs a reasoning parser to know where the reasoning ends; start the server "
                "with --reasoning-parser (qwen3 or deepseek-r1) or remove require_reasoning",
            )
        self.n = [item.params.n for item in self.items]
        self.offsets = [sum(self.n[:i]) for i in range(len(self.items))]
        self.single = request.is_single and self.n[0] == 1

    def shape(self, stream: int, chunk: GenerateChunk) -> dict[str, Any]:
        """The chunk as /generate answers it: SGLang's layout, with the flat index (none for
        a single request of one sequence)."""
        out = chunk.to_json()
        if self.single:
            out.pop("index", None)
        else:
            out["index"] = self.offsets[stream] + chunk.index
        return out

    async def collect(self, streams: EngineStreams) -> Any:
        finals: dict[int, dict[str, Any]] = {}
        try:
            await streams.start()
            async for stream, chunk in streams:
                if chunk.finished:
                    finals[self.offsets[stream] + chunk.index] = self.shape(stream, chunk)
        finally:
            await streams.aclose()
        expected = sum(self.n)
        if len(finals) < expected:
            raise APIError(500, f"the engine ended {expected - len(finals)} sequence(s) without a "
                           "final chunk (finish_reason set); this is an engine bug")  # fmt: skip
        return finals[0] if self.single else [finals[i] for i in sorted(finals)]

    async def events(self, streams: EngineStreams) -> AsyncIterator[str]:
        try:
            async for stream, chunk in streams:
                yield sse(self.shape(stream, chunk))
        except Exception as error:
            yield sse((as_api_error(error) or APIError(500, f"engine error: {error}")).body())
        finally:
            await streams.aclose()
        yield DONE_EVENT


def native_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    @router.post("/generate", openapi_extra=_schema_of(GenerateRequest), tags=["native"])
    async def generate(http: Request) -> Response:
        """SGLang's `/generate`: text or token ids, single or batch, streamed as SSE on request."""
        refuse_generation(state)
        request = await state.read_body(http, GenerateRequest.parse)
        with renamed_errors(_SAMPLING_NAMES):  # the engine names bare SamplingParams fields
            call = _Generate(state, request)
            streams = state.streams("/generate", call.items)
            if request.stream:
                await cancel_on_disconnect(http, streams.start())
                return EventStreamResponse(call.events(streams))
            return EngineJSONResponse(await cancel_on_disconnect(http, call.collect(streams)))

    @router.get("/health", tags=["native"])
    async def health() -> Response:
        """Liveness: 200 while the engine serves; 503 while it cannot (its process died and is
        restarting, or has no restart left)."""
        if not getattr(engine, "healthy", True):
            if getattr(engine, "failed", False):
                reason = "the engine process died and will not restart; restart the server"
            else:
                reason = "the engine is not serving (it is restarting); retry shortly"
            raise unavailable(EngineUnavailable(reason))
        return Response(status_code=200)

    @router.get("/health_generate", tags=["native"])
    async def health_generate() -> Response:
        """Readiness: 200 once a real one-token generation (on a pooling model: one encode)
        succeeds, 503 otherwise."""
        rid = state.new_id("health-")

        async def run() -> None:
            if state.model_info.get("is_generation", True) is False:
                await state.encode("/health_generate", EmbeddingRequest(input_ids=[0], rid=rid))
                return
            probe = GenerateRequest(
                input_ids=[0],
                sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
                rid=rid,
            )
            streams = state.streams("/health_generate", [probe])
            try:
                await streams.start()
                async for _ in streams:
                    pass
            finally:
                await streams.aclose()

        try:
            await asyncio.wait_for(run(), timeout=state.config.health_generate_timeout)
        except Exception as error:
            reason = "timed out" if isinstance(error, asyncio.TimeoutError) else repr(error)
            raise APIError(503, f"the engine cannot generate: {reason}", code="unhealthy") from None
        return Response(status_code=200)

    @router.get("/get_model_info", tags=["native"])
    async def get_model_info() -> dict[str, Any]:
        """The model: path, tokenizer, context length, vocabulary, chat template, EOS ids."""
        return {**state.model_info, "served_model_name": state.served_model_name}

    @router.get("/get_server_info", tags=["native"])
    async def get_server_info() -> dict[str, Any]:
        """Engine config and live stats (cache hit rate, running / queued), server settings."""
        # In the thread pool: an engine in its own process answers over a round trip.
        info = await state.run_blocking(engine.server_info)
        return {
            **info,
            "server_config": state.config.public_dict(),
            "http_requests_in_flight": len(state.inflight),
            "version": __version__,
        }

    @router.post("/flush_cache", tags=["native"])
    async def flush_cache() -> Response:
        """Drop the unlocked prefix-cache entries; 400 while requests are running."""
        if await engine.flush_cache():
            return JSONResponse({"success": True, "message": "Cache flushed."})
        raise APIError(
            400, "the cache was not flushed: requests are running; retry when idle", code="busy"
        )

    # SGLang also answers GET on it.
    router.add_api_route("/flush_cache", flush_cache, methods=["GET"], include_in_schema=False)

    @router.post("/abort_request", tags=["native"])
    async def abort_request(http: Request) -> dict[str, Any]:
        """Abort `{"rid": ...}` (its stream ends with finish_reason abort) or `{"abort_all": true}`."""
        body = await state.read_body(http, dict)
        unknown = set(body) - {"rid", "abort_all"}
        if unknown:
            raise APIError(400, f"unknown fields {sorted(unknown)}; send rid or abort_all")
        if body.get("abort_all"):
            return {"success": True, "aborted": await state.abort_all()}
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise APIError(400, "give the request id to abort as rid", param="rid")
        aborted = bool(await engine.abort(rid))
        return {"success": aborted, "aborted": int(aborted)}

    if state.metrics is not None:
        metrics = state.metrics

        @router.get("/metrics", tags=["native"])
        async def get_metrics() -> Response:
            """Prometheus metrics."""
            # In the thread pool: rendering asks the engine for its live stats.
            return Response(await state.run_blocking(metrics.render), media_type=CONTENT_TYPE)

    return router
