"""create_app: every route of radixlm's server mounted on any engine that satisfies EngineClient."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.server._version import __version__
from radixlm.server.config import ServerConfig
from radixlm.server.errors import APIError, BodyTooLarge, body_too_large, install_error_handlers
from radixlm.server.lora import adapter_cards, lora_router
from radixlm.server.metrics import ServerMetrics
from radixlm.server.native import native_router
from radixlm.server.openai_chat import create_chat_completion
from radixlm.server.openai_completions import create_completion
from radixlm.server.openai_models import ChatCompletionRequest, CompletionRequest
from radixlm.server.openai_responses import create_response, delete_response, stored_response
from radixlm.server.openai_responses_models import ResponsesRequest
from radixlm.server.pooling import pooling_router
from radixlm.server.protocol import EngineClient
from radixlm.server.state import ServerState
from radixlm.server.streams import ClientDisconnected
from radixlm.server.tokenize import tokenize_router
from radixlm.server.weights import weights_router

# Reachable without the API key (load balancers and orchestrators probe them).
OPEN_PATHS = frozenset({"/health", "/health_generate"})


class ApiKeyMiddleware:
    """401 for any HTTP request without `Authorization: Bearer <key>` (or `x-api-key: <key>`),
    except the health probes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if hmac.compare_digest(given, self._key):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if not given else "invalid API key"
        response = APIError(
            401, f"{message}; send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
        ).response()
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over `limit` bytes, on every route. A body whose Content-Length
    says so is refused before any of it is read; one without (chunked) is counted as the app
    reads it, and reading stops with BodyTooLarge once it passes the limit. Nothing is
    buffered here."""

    def __init__(self, app: ASGIApp, limit: int, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.limit:
                if self.metrics is not None:
                    self.metrics.errors.labels(status="413").inc()
                await body_too_large(self.limit).response()(scope, receive, send)
                return
            # The HTTP server delivers no more than Content-Length bytes.
            await self.app(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)


class DrainMiddleware:
    """While the server drains (SIGTERM, `ServerState.draining`): 503 with Retry-After for new
    work (every POST) and for the health probes, so that load balancers and orchestrators
    send nothing more; reads (models, metrics, server info) still answer, and the requests in
    flight finish undisturbed. It counts the HTTP requests open (`ServerState.open_requests`,
    a streamed one until its last byte is sent): the drain waits for none."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if state.draining and (scope["method"] == "POST" or scope["path"] in OPEN_PATHS):
            response = APIError(
                503,
                "the server is shutting down and takes no new requests; send them to another "
                "replica",
                code="draining",
                type="server_error",
            ).response()
            await response(scope, receive, send)
            return
        state.open_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.open_requests -= 1


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _openai_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    def model_card() -> dict[str, Any]:
        info = state.model_info
        return {
            "id": state.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radixlm",
            "root": info.get("model_path"),
            "max_model_len": info.get("max_context_length"),
        }

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        """The served model, then its loaded LoRA adapters (OpenAI's model list)."""
        return {"object": "list", "data": [model_card(), *adapter_cards(state)]}

    @router.get("/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        """One model (the served model or a LoRA adapter) by name; 404 for any other."""
        if model == state.served_model_name:
            return model_card()
        for card in adapter_cards(state):
            if card["id"] == model:
                return card
        raise APIError(404, f"the model {model!r} is not served here", param="model",
                       code="model_not_found")  # fmt: skip

    def body_schema(model: Any) -> dict[str, Any]:
        content = {"application/json": {"schema": model.model_json_schema()}}
        return {"requestBody": {"required": True, "content": content}}

    @router.post("/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(http: Request) -> Response:
        """OpenAI's text completions (SGLang / vLLM sampling extras accepted in the body)."""
        return await create_completion(state, http)

    @router.post("/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(http: Request) -> Response:
        """OpenAI's chat completions: chat template, response_format, tools, streaming."""
        return await create_chat_completion(state, http)

    @router.post("/responses", openapi_extra=body_schema(ResponsesRequest))
    async def responses(http: Request) -> Response:
        """OpenAI's Responses API: input items, instructions, text.format, function tools,
        streaming events, previous_response_id over an in-memory store."""
        return await create_response(state, http)

    @router.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        """A stored response (store: true) by id; 404 once dropped from the in-memory store."""
        return stored_response(state, response_id)

    @router.delete("/responses/{response_id}")
    async def remove_response(response_id: str) -> dict[str, Any]:
        """Drop a stored response; 404 when it is not stored."""
        return delete_response(state, response_id)

    return router


def create_app(
    engine: EngineClient, config: ServerConfig | None = None, *, tracer_provider: Any = None
) -> FastAPI:
    """A FastAPI app serving `engine` with radixlm's native and OpenAI-compatible routes.

    The app holds its own state (no module globals), so several apps may run in one process.
    Add routes or middleware to the returned app as to any FastAPI app; `app.state.radixlm` is
    the ServerState (engine, config, in-flight requests, metrics).

    Tracing (OpenTelemetry, `radixlm-server[tracing]`) is on when `tracer_provider` is given
    (an SDK `TracerProvider`, yours to shut down) or `config.otlp_traces_endpoint` is set (the
    app then makes an OTLP/HTTP exporting provider, shut down with the app). Off, nothing of
    OpenTelemetry is imported.
    """
    config = config or ServerConfig()
    if not isinstance(engine, EngineClient):
        missing = [
            name
            for name in ("generate", "abort", "flush_cache", "model_info", "server_info")
            if not callable(getattr(engine, name, None))
        ]
        raise TypeError(
            f"{type(engine).__name__} is not an EngineClient (missing: {', '.join(missing) or 'tokenizer'})"
        )
    state = ServerState(engine, config)
    owned_provider: Any = None
    if tracer_provider is None and config.otlp_traces_endpoint is not None:
        tracer_provider = owned_provider = otlp_provider(config.otlp_traces_endpoint)
    tracing_middleware: Any = None
    if tracer_provider is not None:
        from radixlm.server.tracing import RequestTracer, TracingMiddleware

        state.tracer = RequestTracer(tracer_provider)
        tracing_middleware = TracingMiddleware

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            state.close()
            if owned_provider is not None:
                owned_provider.shutdown()  # exports the spans still queued

    app = FastAPI(
        title="radixlm",
        version=__version__,
        description="OpenAI-compatible and SGLang-native LLM serving.",
        lifespan=lifespan,
    )
    app.state.radixlm = state
    install_error_handlers(app)

    async def on_disconnect(request: Request, error: Exception) -> Response:
        return Response(status_code=499)

    app.add_exception_handler(ClientDisconnected, on_disconnect)
    app.include_router(native_router(state))
    app.include_router(lora_router(state))
    app.include_router(weights_router(state))
    app.include_router(_openai_router(state))
    app.include_router(pooling_router(state))
    app.include_router(tokenize_router(state))
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes, metrics=state.metrics)
    app.add_middleware(DrainMiddleware, state=state)
    if config.api_key is not None:  # checked first (but for tracing)
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if tracing_middleware is not None:  # outermost: refused requests get their span too
        app.add_middleware(tracing_middleware, tracing=state.tracer)
    return app


def otlp_provider(endpoint: str) -> Any:
    """An OpenTelemetry TracerProvider exporting to `endpoint` over OTLP/HTTP (batched);
    RuntimeError naming the extra to install when OpenTelemetry is missing."""
    try:
        from radixlm.server.tracing import otlp_tracer_provider

        return otlp_tracer_provider(endpoint)
    except ImportError as error:
        raise RuntimeError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({error}); install it with "
            "`pip install 'radixlm-server[tracing]'`"
        ) from None
