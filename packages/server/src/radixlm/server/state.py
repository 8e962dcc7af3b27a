"""ServerState: the engine, the config and what the routes share (in-flight requests, metrics),
plus the one place that submits requests to the engine and accounts for them."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from starlette.requests import Request

from radixlm.sampling import (
    EmbeddingOutput,
    EmbeddingRequest,
    EngineOverloaded,
    EngineUnavailable,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
    check_text_fits,
    max_token_chars,
)
from radixlm.server.config import ServerConfig
from radixlm.server.errors import APIError, invalid_json
from radixlm.server.metrics import ServerMetrics
from radixlm.server.protocol import EngineClient
from radixlm.server.response_store import ResponseStore
from radixlm.server.streams import EngineStreams, close_iterator

if TYPE_CHECKING:
    from radixlm.server.tracing import RequestTracer

logger = logging.getLogger("radixlm.server")
P = ParamSpec("P")
T = TypeVar("T")

#: Threads of a server's pool for blocking work (chat templates, tokenizing, parsing large
#: bodies): a few, so that such work from many clients queues there, not on the event loop.
BLOCKING_WORKERS = 4
#: Bodies larger than this are parsed and validated in the pool (~10 ms per MiB, more for
#: long lists of token ids).
LARGE_BODY_BYTES = 1 << 20


def parse_json(raw: bytes) -> Any:
    """A request body as JSON (None when empty); 400 when it is not JSON."""
    try:
        return json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid_json(error) from None


def as_object(body: Any) -> dict[str, Any]:
    """`body` when it is a JSON object; 400 otherwise."""
    if not isinstance(body, dict):
        kind = "nothing" if body is None else type(body).__name__
        raise APIError(400, f"the request body must be a JSON object; got {kind}", code="invalid")
    return body


@contextmanager
def renamed_errors(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise InvalidRequest about a field in `names` as about the field it maps to: the
    engine names SamplingParams fields and `text` / `input_ids`, which each route calls by
    the names its clients sent (`max_tokens`, `response_format`, `sampling_params.regex`)."""
    try:
        yield
    except InvalidRequest as error:
        if error.field not in names:
            raise
        raise InvalidRequest(names[error.field], error.message) from None


#: Adapter names a 404 about an unknown model lists at most.
_NAMES_SHOWN = 10


@dataclass(frozen=True)
class ServedModel:
    """What an OpenAI request's `model` named: the base model, or one of its LoRA adapters.

    `name` is what the response's `model` echoes: the served name for the base model (whatever
    alias the client sent), the client's own spelling for an adapter (`adapter` or
    `served:adapter`). `lora` is the adapter's name, the `lora_path` of the engine requests;
    `lora_param` the request field it came from, which the engine's errors about `lora_path`
    are reported under."""

    name: str
    lora: str | None = None
    lora_param: str = "model"

    def with_lora_path(self, lora_path: str | None) -> ServedModel:
        """This model with a request's explicit `lora_path` (SGLang's field) applied: the
        adapter it names on the base model (the engine checks the name); InvalidRequest when
        `model` already names another adapter."""
        if lora_path is None or lora_path == self.lora:
            return self
        if self.lora is not None:
            raise InvalidRequest(
                "lora_path",
                f"names the LoRA adapter {lora_path!r} but model names {self.lora!r}; "
                "send the adapter in one of them",
            )
        return ServedModel(self.name, lora_path, "lora_path")

    def error_names(self) -> dict[str, str]:
        """The engine's field for the adapter -> the request field that named it."""
        return {"lora_path": self.lora_param} if self.lora is not None else {}


class ServerState:
    """Shared by every route of one app. Not thread-safe: used from the event loop only."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.inflight: dict[str, float] = {}
        #: Set on SIGTERM (the launcher's GracefulDrain): new work is refused with 503 while
        #: what is in flight finishes.
        self.draining = False
        self.open_requests = 0  # HTTP requests being answered (counted by DrainMiddleware)
        self._model_info: dict[str, Any] | None = None
        self.metrics: ServerMetrics | None = None
        if config.enable_metrics:
            self.metrics = ServerMetrics(
                engine.server_info,
                lambda: len(self.inflight),
                self.served_model_name,
                config.metrics_format,
                self.context_length,
            )
        self.responses = ResponseStore(config.response_store_size)  # /v1/responses
        # Read once, before serving: it walks the whole vocabulary.
        self.max_token_chars = max_token_chars(getattr(engine, "tokenizer", None))
        self._pool: ThreadPoolExecutor | None = None  # started on first use
        #: OpenTelemetry spans (set by `create_app` when tracing is on; None: no spans).
        self.tracer: RequestTracer | None = None

    # Work off the event loop.

    async def run_blocking(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` in the server's thread pool, awaited. Cancelling the await
        does not stop a call already running (it finishes in its thread)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(BLOCKING_WORKERS, thread_name_prefix="radixlm-server")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def read_body(self, request: Request, parse: Callable[[dict[str, Any]], T]) -> T:
        """The request body as a JSON object (400 when it is not one), then `parse(body)` (the
        route's validation); both in the pool when the body is large."""
        raw = await request.body()

        def read() -> T:
            return parse(as_object(parse_json(raw)))

        return await self.run_blocking(read) if len(raw) > LARGE_BODY_BYTES else read()

    def close(self) -> None:
        """Stop the thread pool when the app shuts down (calls running in it finish; one
        started after is served by a new pool, as when the app starts again)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # Model facts.

    @property
    def model_info(self) -> dict[str, Any]:
        if self._model_info is None:
            self._model_info = dict(self.engine.model_info())
        return self._model_info

    @property
    def served_model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return str(self.model_info.get("model_path") or "default")

    @property
    def media_tokens(self) -> dict[str, str | None]:
        """{"image": ..., "video": ...}: the text that stands for one image / video in a
        prompt (the engine's `image_token` / `video_token`); None where the model does not
        take that modality (or the engine does not say)."""
        info = self.model_info
        return {
            kind: value if isinstance(value := info.get(f"{kind}_token"), str) and value else None
            for kind in ("image", "video")
        }

    @property
    def context_length(self) -> int | None:
        value = self.model_info.get("max_context_length")
        return int(value) if isinstance(value, int) else None

    def check_text_fits(self, text: str | int, field: str) -> None:
        """InvalidRequest naming `field` when a prompt of this many characters cannot fit in
        the model's context whatever its tokens (see `radixlm.sampling.check_text_fits`), so
        that it is refused before anything tokenizes it."""
        context = self.context_length
        if context is not None:
            check_text_fits(text, context, self.max_token_chars, field)

    def lora_adapters(self) -> dict[str, str]:
        """The engine's loaded LoRA adapters, name -> path, read now (the engine's optional
        `lora_adapters()`); {} for an engine without LoRA support."""
        read = getattr(self.engine, "lora_adapters", None)
        return dict(read()) if callable(read) else {}

    def check_model(self, name: str | None) -> ServedModel:
        """What an OpenAI request's `model` names. None, "default" (SGLang's documentation's
        name) and the served name are the base model; a loaded LoRA adapter's name (vLLM's
        convention) or `<served name>:<adapter>` (SGLang's; `default:<adapter>` too) is that
        adapter. Any other name is a 404 naming what is served."""
        served = self.served_model_name
        if name is None or name in ("default", served):
            return ServedModel(served)
        adapters = self.lora_adapters()
        if name in adapters:
            return ServedModel(name, name)
        for base in (served, "default"):
            adapter = name.removeprefix(f"{base}:")
            if adapter != name and adapter in adapters:
                return ServedModel(name, adapter)
        where = "see /v1/models"
        serves = repr(served)
        if adapters:
            names = ", ".join(repr(a) for a in sorted(adapters)[:_NAMES_SHOWN])
            more = len(adapters) - _NAMES_SHOWN
            kind = "LoRA adapter" if len(adapters) == 1 else "LoRA adapters"
            serves += f" and the {kind} {names}" + (f" and {more} more" if more > 0 else "")
            first = min(adapters)
            where = f"send model={first!r} or model={served + ':' + first!r}; {where}"
        raise APIError(
            404,
            f"the model {name!r} is not served here; this server serves {serves} ({where})",
            param="model",
            code="model_not_found",
        )

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}{uuid.uuid4().hex}"

    # Submission.

    def prepare(self, request: GenerateRequest) -> GenerateRequest:
        """The request with an id (a fresh one if the client gave none). Nothing else: the
        engine validates what it is sent (token ids, the context, a text too long in
        characters to fit it, custom logit processors, a rid in use), once, with the message
        its own API gives."""
        if request.rid is None:
            return request.model_copy(update={"rid": self.new_id("")})
        return request

    def streams(self, route: str, requests: list[GenerateRequest]) -> EngineStreams:
        """The engine streams of prepared single requests (call `start()` next)."""
        return EngineStreams(
            [lambda r=r: self._tracked(route, r) for r in requests]  # type: ignore[misc]
        )

    async def _tracked(self, route: str, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        rid = str(request.rid)
        arrival = time.monotonic()
        # A rid already in flight is the engine's to refuse; its entry stays the first one's.
        owner = rid not in self.inflight
        if owner:
            self.inflight[rid] = arrival
        finals: dict[int, GenerateChunk] = {}
        timer = self.metrics.track(request, arrival) if self.metrics is not None else None
        iterator: AsyncIterator[GenerateChunk] | None = None
        outcome = "disconnected"  # unless the engine finishes or refuses it
        try:
            iterator = self.engine.generate(request)
            async for chunk in iterator:
                if timer is not None:
                    timer.chunk(chunk)
                if chunk.finished:
                    finals[chunk.index] = chunk
                yield chunk
            outcome = "finished"
        except InvalidRequest:
            outcome = "invalid"
            raise
        except EngineOverloaded:
            outcome = "overloaded"
            raise
        except EngineUnavailable:
            outcome = "unavailable"
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            if iterator is not None:
                await close_iterator(iterator)
            if owner:
                self.inflight.pop(rid, None)
            self._account(route, request, finals, time.monotonic() - arrival, outcome)
            if self.tracer is not None:
                self.tracer.record(request, finals, outcome)

    def _account(
        self,
        route: str,
        request: GenerateRequest,
        finals: dict[int, GenerateChunk],
        latency: float,
        outcome: str,
    ) -> None:
        if outcome in ("invalid", "overloaded", "unavailable", "error"):
            if self.config.log_requests:
                logger.info("%s rid=%s refused by the engine (%s)", route, request.rid, outcome)
            return
        expected = request.params.n
        ended = [finals[i] for i in sorted(finals)]
        prompt = ended[0].prompt_tokens if ended else 0
        cached = ended[0].cached_tokens if ended else 0
        completion = sum(m.completion_tokens for m in ended)
        reasons: list[str] = [m.finish_type or "?" for m in ended]
        if len(finals) < expected:
            reasons.append(outcome)
        if self.metrics is not None:
            for i, m in enumerate(ended):
                self.metrics.record_sequence(
                    route,
                    reasons[i],
                    prompt if i == 0 else 0,
                    cached if i == 0 else 0,
                    m.completion_tokens,
                    latency,
                )
            if len(finals) < expected:
                self.metrics.record_unfinished(route, outcome)
            if ended:
                self.metrics.record_phases((ended[0].extra or {}).get("timestamps"))
        if self.config.log_requests:
            logger.info(
                "%s rid=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d n=%d "
                "finish=%s latency=%.3fs",
                route,
                request.rid,
                prompt,
                cached,
                completion,
                expected,
                ",".join(reasons),
                latency,
            )

    async def encode(self, route: str, request: EmbeddingRequest) -> EmbeddingOutput:
        """One single embedding request on the engine's optional `encode` (a 400 when the
        engine has none), with a fresh `rid` when the client gave none; tracked in flight and
        in the metrics as a generation request is. Cancelling it cancels the engine's call."""
        encode = getattr(self.engine, "encode", None)
        if not callable(encode):
            raise APIError(400, "this engine does not serve pooling models", code="not_supported")
        if request.rid is None:
            request = request.model_copy(update={"rid": self.new_id("")})
        rid = str(request.rid)
        arrival = time.monotonic()
        owner = rid not in self.inflight
        if owner:
            self.inflight[rid] = arrival
        try:
            output: EmbeddingOutput = await encode(request)
        except (InvalidRequest, EngineOverloaded, EngineUnavailable) as error:
            if self.config.log_requests:
                logger.info("%s rid=%s refused by the engine (%s)", route, rid, error)
            raise
        finally:
            if owner:
                self.inflight.pop(rid, None)
        latency = time.monotonic() - arrival
        if self.metrics is not None:
            # A pooling request finishes when it is pooled: "stop", as vLLM counts it.
            self.metrics.record_sequence(
                route, "stop", output.prompt_tokens, output.cached_tokens, 0, latency
            )
        if self.config.log_requests:
            logger.info(
                "%s rid=%s prompt_tokens=%d cached_tokens=%d latency=%.3fs",
                route, rid, output.prompt_tokens, output.cached_tokens, latency,
            )  # fmt: skip
        return output

    async def abort_all(self) -> int:
        count = 0
        for rid in list(self.inflight):
            count += bool(await self.engine.abort(rid))
        return count
