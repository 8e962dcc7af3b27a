"""Engine: the public, SGLang-shaped API over the engine loop running in a background thread.

    with Engine("path/to/model") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16})
        print(out["text"], out["meta_info"]["cached_tokens"])

The same object serves the HTTP server: `generate(GenerateRequest)` is an async iterator of
`GenerateChunk`s, and `abort` / `flush_cache` can be awaited, so it satisfies the server's `EngineClient`
protocol structurally (the runtime never imports the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import threading
import uuid
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import Future
from functools import partial
from typing import Any, Generic, TypeVar, cast, overload

from radixlm.runtime.beam_search import (
    BeamSearch,
    BeamSearchParams,
    EarlyStopping,
    result_chunks,
    step_candidates,
    step_request,
)
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.detokenizer import TextDecoder, load_tokenizer
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.engine_process import ProcessConnection, ThreadConnection
from radixlm.runtime.messages import (
    Abort,
    Call,
    CheckInvariants,
    Command,
    CommandResult,
    ContinueGeneration,
    FlushCache,
    GetServerInfo,
    GetWeightsByName,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    LoadLoraAdapterFromTensors,
    Output,
    PauseGeneration,
    ReleaseMemoryOccupation,
    RequestClosed,
    RequestFailed,
    ResumeMemoryOccupation,
    SeqDelta,
    Stats,
    StopSequence,
    UnloadLoraAdapter,
    UpdateWeights,
    UpdateWeightsFromDistributed,
)
from radixlm.runtime.model_files import resolve_model_path
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.multimodal.preparer import multimodal_preparer
from radixlm.runtime.output_processor import RequestOutput
from radixlm.runtime.preparer import FrontendLimits, RequestPreparer
from radixlm.runtime.tensor_bucket import FlattenedTensorBucket, checked_bucket
from radixlm.sampling import (
    EmbeddingOutput,
    EmbeddingRequest,
    EngineUnavailable,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
    SamplingDefaults,
    SamplingParams,
)

#: What a reader's sink receives after the chunks: END once the request is closed.
END = object()

T = TypeVar("T")
Chunk = dict[str, Any]
_ParamsArg = SamplingParams | dict[str, Any] | list[SamplingParams | dict[str, Any]] | None


class Reply(Coroutine[Any, Any, T], Generic[T]):
    """A result that works both ways: `await engine.abort(rid)` in async code, and
    `engine.abort(rid)` (truthiness, `.result()`) in plain code, as SGLang's Engine offers.

    The action has already been requested when the Reply is returned; only its answer may
    still be pending (it comes from the engine loop)."""

    def __init__(self, future: Future[T]) -> None:
        self._future = future
        self._coroutine: Coroutine[Any, Any, T] | None = None

    @classmethod
    def of(cls, value: T) -> Reply[T]:
        future: Future[T] = Future()
        future.set_result(value)
        return cls(future)

    def result(self, timeout: float | None = None) -> T:
        """Block until the answer is there."""
        return self._future.result(timeout)

    def __bool__(self) -> bool:
        return bool(self.result())

    def __eq__(self, other: object) -> bool:
        return bool(self.result() == (other.result() if isinstance(other, Reply) else other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        state = repr(self._future.result()) if self._future.done() else "pending"
        return f"Reply({state})"

    async def _wait(self) -> T:
        if self._future.done():
            return self._future.result()
        return await asyncio.wrap_future(self._future)

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait().__await__()

    def _coro(self) -> Coroutine[Any, Any, T]:
        if self._coroutine is None:
            self._coroutine = self._wait()
        return self._coroutine

    def send(self, value: Any) -> Any:
        return self._coro().send(value)

    def throw(self, *args: Any) -> Any:
        return self._coro().throw(*args)

    def close(self) -> None:
        if self._coroutine is not None:
            self._coroutine.close()


def with_local_model(config: EngineConfig) -> EngineConfig:
    """`config` with its model (and tokenizer) path replaced by the local directory it
    stands for (a hub id downloaded, a GGUF file's sidecar, a built-in model's files), so the
    engine core and its ranks read local files only. The served model name stays what the
    user passed."""
    model = config.runner.model
    local = str(resolve_model_path(model.model_path, model.revision, model.download_dir))
    tokenizer_path = config.tokenizer_path
    if tokenizer_path is not None:
        tokenizer_path = str(resolve_model_path(tokenizer_path, model.revision, model.download_dir))
    if local == model.model_path and tokenizer_path == config.tokenizer_path:
        return config
    runner = dataclasses.replace(config.runner, model=dataclasses.replace(model, model_path=local))
    return dataclasses.replace(
        config,
        runner=runner,
        tokenizer_path=tokenizer_path,
        served_model_name=config.served_model_name or model.model_path,
    )


class Engine:
    """An LLM engine: continuous batching over RadixAttention on one model.

    `Engine(model_path, **kwargs)` takes SGLang-style keyword arguments (see
    `radixlm.runtime.config.ENGINE_KWARGS`), or `config=EngineConfig(...)`. A
    `ModelRunner` already built may be passed as `runner=` (its config then wins; the core
    then runs on a thread).

    The core runs on a thread of this process by default, or with `engine_process=True` in a
    process of its own (what `radixlm serve` does): this object then stays the front end —
    tokenization, validation, chat templates and output routing — and the core's internals
    (`runner`, `scheduler`, `cache`, `grammar`, `run_in_loop`) are not reachable from here.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        config: EngineConfig | None = None,
        runner: ModelRunner | None = None,
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if config is None:
            path = model_path or (runner.config.model.model_path if runner else None)
            if path is None:
                raise TypeError(
                    "Engine needs a model_path (a Hugging Face model directory, a GGUF file, a "
                    "hub id or a built-in model's name)"
                )
            config = EngineConfig.from_kwargs(path, **kwargs)
        elif kwargs:
            raise TypeError("pass either config= or keyword arguments, not both")
        if runner is not None:
            config = dataclasses.replace(config, runner=runner.config, engine_process=False)
        config = with_local_model(config)
        self.config = config
        self._tokenizer = tokenizer or load_tokenizer(config.tokenizer_path or config.model_path)
        # Output routing: rid -> the reader's sink and the request's output (detokenized
        # here, from the core's deltas); command reply id -> its future.
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self._outputs: dict[str, RequestOutput] = {}
        self._replies: dict[int, Future[Any]] = {}
        self._next_reply = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._live: dict[str, Any] = {}  # the engine process's latest Stats
        self._connection: ThreadConnection | ProcessConnection
        if config.in_process:
            self._connection = ProcessConnection(
                config, self._dispatch, self._engine_down, tokenizer=tokenizer
            )
        else:
            self._connection = ThreadConnection(
                config, self._dispatch, runner=runner, tokenizer=self._tokenizer
            )
            core = self._connection.core
            self._core = core
            self.runner = core.executor.runner
            self.scheduler = core.scheduler
            self.cache = core.scheduler.cache
            self.grammar = core.grammar
        info = self._connection.info
        self.info = info
        if isinstance(self._connection, ProcessConnection):
            self._live = self._connection.stats
        self.eos_token_ids = info.eos_token_ids
        self.context_length = info.context_length
        lora = info.static_info.get("lora")
        #: The loaded LoRA adapters, name -> directory (None: the engine serves none); kept
        #: in step with the core by the load and unload answers.
        self._lora: dict[str, str] | None = (
            dict(lora["initial_adapters"]) if isinstance(lora, dict) else None
        )
        self.sampling_defaults = SamplingDefaults.from_generation_config(
            dict(info.generation_config),
            mode=config.sampling_defaults,
        )
        self._preparer = RequestPreparer(
            self._tokenizer,
            self.sampling_defaults,
            FrontendLimits(
                vocab_size=info.vocab_size,
                context_length=info.context_length,
                custom_logit_processors=config.runner.sampler.enable_custom_logit_processor,
                clamp_max_tokens=config.clamp_max_tokens,
                max_logprobs=config.max_logprobs,
                stream_interval=config.stream_interval,
                hidden_size=info.hidden_size,
                mixture_of_experts=info.static_info.get("moe") is not None,
                routed_experts=bool(info.static_info.get("routed_experts")),
                priority_scheduling=config.scheduler.enable_priority_scheduling,
                disaggregation_mode=config.disaggregation.mode,
            ),
            config.incremental_streaming_output,
            multimodal_preparer(
                config.model_path,
                info.architectures,
                self._tokenizer,
                config.media,
                info.hidden_size,
            ),
            lora_adapters=self.lora_adapters if self._lora is not None else None,
            pooling=info.static_info.get("pooling"),
        )

    # ------------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the core (open requests end with an error) and its process or thread."""
        if self._closed:
            return
        self._closed = True
        self._connection.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def healthy(self) -> bool:
        """Whether the core serves (False while a dead engine process restarts, and after)."""
        return not self._closed and self._connection.healthy

    @property
    def failed(self) -> bool:
        """The engine process died and no restart is left: this engine will not serve again."""
        return self._connection.failed

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None in thread mode)."""
        connection = self._connection
        return connection.pid if isinstance(connection, ProcessConnection) else None

    @property
    def rank_pids(self) -> list[int | None]:
        """The processes of this machine's tensor-parallel ranks, rank 0 (the engine process)
        first; the engine process alone without tensor parallelism, [] in thread mode."""
        connection = self._connection
        return connection.rank_pids if isinstance(connection, ProcessConnection) else []

    # ------------------------------------------------------------------------- outputs

    def _dispatch(self, outputs: list[Output]) -> None:
        """Route the core's outputs to their readers (on the core's or the receiver's thread;
        a sink only hands the item over, it never blocks). The items for readers on an event
        loop go over in one call per loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_AsyncSink, Any]]] = {}

        def send(sink: Callable[[Any], None], item: Any) -> None:
            if isinstance(sink, _AsyncSink):
                batches.setdefault(sink.loop, []).append((sink, item))
            else:
                sink(item)

        stops: list[StopSequence] = []
        for out in outputs:
            if type(out) is SeqDelta:  # the common case first
                state = self._outputs.get(out.rid)
                sink = self._sinks.get(out.rid)
                if state is None or sink is None:
                    continue
                chunk, stop_core = state.apply(out)
                if stop_core:
                    stops.append(StopSequence(out.rid, out.index))
                if chunk is not None:
                    send(sink, chunk)
                continue
            match out:
                case RequestClosed(rid):
                    with self._lock:
                        sink = self._sinks.pop(rid, None)
                        self._outputs.pop(rid, None)
                    if sink is not None:
                        send(sink, END)
                case RequestFailed(rid, error):
                    with self._lock:
                        sink = self._sinks.pop(rid, None)
                        self._outputs.pop(rid, None)
                    if sink is not None:
                        send(sink, error)
                        send(sink, END)
                case Stats(values):
                    self._live = values
                case CommandResult(reply, value, error):
                    with self._lock:
                        future = self._replies.pop(reply, None)
                    if future is not None:
                        if error is not None:
                            future.set_exception(error)
                        else:
                            future.set_result(value)
        for loop, items in batches.items():
            _deliver_soon(loop, items)
        for stop in stops:
            self._connection.post(stop)

    def _engine_down(self, reason: str) -> None:
        """The engine process died: every open request and command ends with the reason."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            replies, self._replies = self._replies, {}
            self._outputs = {}
        for sink in sinks.values():
            sink(EngineUnavailable(reason))
            sink(END)
        for future in replies.values():
            future.set_exception(EngineUnavailable(reason))

    def _ask(self, make: Callable[[int], Command]) -> Future[Any]:
        """Send a command that carries a reply id; its future gets the core's answer."""
        future: Future[Any] = Future()
        if not self.healthy:
            future.set_exception(EngineUnavailable("the engine is not serving"))
            return future
        with self._lock:
            reply = next(self._next_reply)
            self._replies[reply] = future
        self._connection.post(make(reply))
        return future

    # ---------------------------------------------------------------------- submission

    def _submit(
        self,
        items: Sequence[GenerateRequest | EmbeddingRequest],
        sinks: list[Callable[[Any], None]],
    ) -> list[str]:
        """Prepare every item (raises InvalidRequest before queueing any), then send them; a
        rid already in use is refused here, the one place that routes outputs by rid."""
        if self._closed:
            raise EngineUnavailable("the engine is shut down")
        if not self._connection.healthy:
            raise EngineUnavailable("the engine is not serving (its process is down or restarting)")
        preparer = self._preparer
        requests = [
            preparer.prepare_pooling(item)
            if isinstance(item, EmbeddingRequest)
            else preparer.prepare(item)
            for item in items
        ]
        rids = [r.rid for r in requests]
        with self._lock:
            clash = [r for r in rids if r in self._sinks] or [
                r for i, r in enumerate(rids) if r in rids[:i]
            ]
            if clash:
                raise InvalidRequest("rid", f"request id {clash[0]!r} is already in use")
            self._sinks.update(zip(rids, sinks, strict=True))
            for request in requests:
                self._outputs[request.rid] = RequestOutput(
                    request, self._tokenizer, self.eos_token_ids
                )
        for request in requests:
            self._connection.post(request)
        return rids

    @staticmethod
    def _build_request(
        prompt: str | list[str] | None,
        sampling_params: _ParamsArg,
        input_ids: list[int] | list[list[int]] | None,
        extra: dict[str, Any],
    ) -> GenerateRequest:
        body: dict[str, Any] = {k: _media_arg(v) for k, v in extra.items() if v is not None}
        if prompt is not None:
            body["text"] = prompt
        if input_ids is not None:
            body["input_ids"] = input_ids
        if sampling_params is not None:
            body["sampling_params"] = sampling_params
        return GenerateRequest.parse(body)

    # ------------------------------------------------------------------ SGLang-style API

    @overload
    def generate(self, prompt: GenerateRequest) -> AsyncIterator[Chunk]: ...

    @overload
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: _ParamsArg = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        custom_logit_processor: str | list[str | None] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        input_embeds: Any = None,
        return_hidden_states: bool | list[bool] = False,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool | list[bool] = False,
        routed_experts_start_len: int | list[int] = 0,
        priority: int | list[int | None] | None = None,
        timeout: float | list[float | None] | None = None,
        require_reasoning: bool | list[bool] = False,
        bootstrap_host: str | list[str | None] | None = None,
        bootstrap_port: int | list[int | None] | None = None,
        bootstrap_room: int | list[int | None] | None = None,
    ) -> Any: ...

    def generate(
        self,
        prompt: str | list[str] | GenerateRequest | None = None,
        sampling_params: _ParamsArg = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        custom_logit_processor: str | list[str | None] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        input_embeds: Any = None,
        return_hidden_states: bool | list[bool] = False,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool | list[bool] = False,
        routed_experts_start_len: int | list[int] = 0,
        priority: int | list[int | None] | None = None,
        timeout: float | list[float | None] | None = None,
        require_reasoning: bool | list[bool] = False,
        bootstrap_host: str | list[str | None] | None = None,
        bootstrap_port: int | list[int | None] | None = None,
        bootstrap_room: int | list[int | None] | None = None,
    ) -> Any:
        """Generate, SGLang's way, blocking: a dict for one prompt (n == 1), a list of dicts
        for a batch or n > 1 (prompt-major), or with `stream=True` an iterator of chunks
        (cumulative text; `index` tells sequences apart). `priority` needs an engine with
        `enable_priority_scheduling`; `timeout` (seconds from arrival) ends a request with
        finish reason abort, keeping what it generated. `bootstrap_host`, `bootstrap_port`
        and `bootstrap_room` pair the halves of a request on a prefill and a decode engine
        (`disaggregation_mode`; see `radixlm.runtime.disaggregation`).

        Given a `GenerateRequest` instead, returns an async iterator of its chunks (the
        `EngineClient` form the HTTP server uses).
        """
        if isinstance(prompt, GenerateRequest):
            return self._stream_async(prompt)
        request = self._build_request(
            prompt,
            sampling_params,
            input_ids,
            dict(
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                token_ids_logprob=token_ids_logprob,
                return_text_in_logprobs=return_text_in_logprobs,
                custom_logit_processor=custom_logit_processor,
                stream=stream,
                rid=rid,
                # A tensor [seq, hidden] (or [batch, seq, hidden]) is taken too.
                input_embeds=input_embeds.tolist()
                if hasattr(input_embeds, "tolist")
                else input_embeds,
                return_hidden_states=return_hidden_states,
                image_data=image_data,
                video_data=video_data,
                audio_data=audio_data,
                lora_path=lora_path,
                return_routed_experts=return_routed_experts,
                routed_experts_start_len=routed_experts_start_len,
                priority=priority,
                timeout=timeout,
                require_reasoning=require_reasoning,
                bootstrap_host=bootstrap_host,
                bootstrap_port=bootstrap_port,
                bootstrap_room=bootstrap_room,
            ),
        )
        chunks = self._stream_sync(request)
        if stream:
            return (chunk.to_json() for chunk in chunks)
        return _as_json(_collect(request, list(chunks)))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: _ParamsArg = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        custom_logit_processor: str | list[str | None] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        input_embeds: Any = None,
        return_hidden_states: bool | list[bool] = False,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool | list[bool] = False,
        routed_experts_start_len: int | list[int] = 0,
        priority: int | list[int | None] | None = None,
        timeout: float | list[float | None] | None = None,
        require_reasoning: bool | list[bool] = False,
        bootstrap_host: str | list[str | None] | None = None,
        bootstrap_port: int | list[int | None] | None = None,
        bootstrap_room: int | list[int | None] | None = None,
    ) -> Any:
        """`generate` for asyncio: awaits the result, or with `stream=True` returns an async
        iterator of chunks (`async for chunk in await engine.async_generate(..., stream=True)`)."""
        request = self._build_request(
            prompt,
            sampling_params,
            input_ids,
            dict(
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                token_ids_logprob=token_ids_logprob,
                return_text_in_logprobs=return_text_in_logprobs,
                custom_logit_processor=custom_logit_processor,
                stream=stream,
                rid=rid,
                # A tensor [seq, hidden] (or [batch, seq, hidden]) is taken too.
                input_embeds=input_embeds.tolist()
                if hasattr(input_embeds, "tolist")
                else input_embeds,
                return_hidden_states=return_hidden_states,
                image_data=image_data,
                video_data=video_data,
                audio_data=audio_data,
                lora_path=lora_path,
                return_routed_experts=return_routed_experts,
                routed_experts_start_len=routed_experts_start_len,
                priority=priority,
                timeout=timeout,
                require_reasoning=require_reasoning,
                bootstrap_host=bootstrap_host,
                bootstrap_port=bootstrap_port,
                bootstrap_room=bootstrap_room,
            ),
        )
        chunks = self._stream_async(request)
        if stream:
            return _json_stream(chunks)
        return _as_json(_collect(request, [chunk async for chunk in chunks]))

    def _stream_sync(self, request: GenerateRequest) -> Iterator[GenerateChunk]:
        items = request.split()
        inbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        sinks = [_queue_sink(inbox, k) for k in range(len(items))]
        rids = self._submit(items, sinks)
        return self._read_sync(inbox, rids, _offsets(items, request.is_single))

    def _read_sync(
        self, inbox: queue.SimpleQueue[tuple[int, Any]], rids: list[str], offsets: list[int]
    ) -> Iterator[GenerateChunk]:
        open_ = len(rids)
        try:
            while open_:
                k, item = inbox.get()
                if item is END:
                    open_ -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item.with_index(offsets[k] + item.index) if offsets[k] else item
        finally:
            if open_:
                self._abort_all(rids)

    async def _stream_async(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        loop = asyncio.get_running_loop()
        items = request.split()
        inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        sinks = [_async_sink(loop, inbox, k) for k in range(len(items))]
        # Tokenization and validation run off the event loop.
        rids = await loop.run_in_executor(None, self._submit, items, sinks)
        offsets = _offsets(items, request.is_single)
        incremental = self.config.incremental_streaming_output
        open_ = len(rids)
        try:
            while open_:
                # Everything that arrived while the reader was busy: a sequence's chunks that
                # queued up are merged into one (a slow reader gets fewer, larger chunks
                # instead of falling further behind).
                arrived = [await inbox.get()]
                while not inbox.empty():
                    arrived.append(inbox.get_nowait())
                merged: dict[tuple[int, int], GenerateChunk] = {}
                for k, item in arrived:
                    if item is END:
                        open_ -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        key = (k, item.index)
                        earlier = merged.get(key)
                        merged[key] = (
                            item if earlier is None else _coalesce(earlier, item, incremental)
                        )
                for (k, _), chunk in merged.items():
                    yield chunk.with_index(offsets[k] + chunk.index) if offsets[k] else chunk
        finally:
            if open_:
                self._abort_all(rids)

    def _abort_all(self, rids: list[str]) -> None:
        """The reader went away: abort whichever of its requests still run."""
        with self._lock:
            live = [rid for rid in rids if rid in self._sinks]
        for rid in live:
            self._connection.post(Abort(rid))

    # ------------------------------------------------------------------- pooling models

    def encode(
        self,
        prompt: str | list[str] | EmbeddingRequest | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        text_pair: str | list[str] | None = None,
        rid: str | list[str] | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> Any:
        """SGLang's `Engine.encode` on a pooling model, blocking: `{"embedding": [...],
        "meta_info": {...}}` for one input, a list of them for a batch (run together).
        `embedding` is the pooled embedding, or the head's outputs (a classifier's logits, a
        cross-encoder's score over (`prompt`, `text_pair`), a reward).

        Given an `EmbeddingRequest` (single) instead, returns an awaitable of its
        `EmbeddingOutput` (the `EngineClient` form the HTTP server uses)."""
        if isinstance(prompt, EmbeddingRequest):
            return self._encode_async(prompt)
        request = _embedding_request(
            prompt, input_ids, text_pair, rid, dimensions, normalize, truncate_prompt_tokens
        )
        items = request.split()
        inbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        sinks = [_queue_sink(inbox, k) for k in range(len(items))]
        rids = self._submit(items, sinks)
        finals: dict[int, GenerateChunk] = {}
        for chunk in self._read_sync(inbox, rids, list(range(len(items)))):
            finals[chunk.index] = chunk
        results = [_embedding_output(finals.get(k), rid).to_json() for k, rid in enumerate(rids)]
        return results[0] if request.is_single else results

    async def async_encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        text_pair: str | list[str] | None = None,
        rid: str | list[str] | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> Any:
        """`encode` for asyncio."""
        request = _embedding_request(
            prompt, input_ids, text_pair, rid, dimensions, normalize, truncate_prompt_tokens
        )
        outputs = await asyncio.gather(*(self._encode_async(item) for item in request.split()))
        results = [output.to_json() for output in outputs]
        return results[0] if request.is_single else results

    async def _encode_async(self, request: EmbeddingRequest) -> EmbeddingOutput:
        """One single encode request's result (InvalidRequest, EngineOverloaded or
        EngineUnavailable as `generate` raises them)."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        rids = await loop.run_in_executor(
            None, self._submit, [request], [_async_sink(loop, inbox, 0)]
        )
        final: GenerateChunk | None = None
        open_ = True
        try:
            while open_:
                _, item = await inbox.get()
                if item is END:
                    open_ = False
                elif isinstance(item, BaseException):
                    raise item
                else:
                    final = item
        finally:
            if open_:
                self._abort_all(rids)
        return _embedding_output(final, rids[0])

    # ----------------------------------------------------------------------- beam search

    @overload
    def beam_search(
        self,
        prompt: GenerateRequest,
        beam_width: int,
        *,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
    ) -> Coroutine[Any, Any, list[GenerateChunk]]: ...

    @overload
    def beam_search(
        self,
        prompt: str | list[int],
        beam_width: int,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
        *,
        ignore_eos: bool = False,
        skip_special_tokens: bool = True,
    ) -> list[Chunk]: ...

    def beam_search(
        self,
        prompt: str | list[int] | GenerateRequest,
        beam_width: int,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
        *,
        ignore_eos: bool = False,
        skip_special_tokens: bool = True,
    ) -> Any:
        """Beam search (vLLM's `LLM.beam_search`, scored as transformers' `num_beams`), blocking:
        the `beam_width` best sequences, best first, as `/generate` final chunks whose
        `meta_info` adds `score` (cumulative logprob / generated_len ** length_penalty) and
        `cumulative_logprob`. `beam_width=1` is greedy decoding.

        Each step is one batch of single-token requests, one per live beam; the radix cache
        shares the beams' common prefixes, so a step prefills only each beam's newest token.

        Given a `GenerateRequest` (the server's `EngineClient` form), returns a coroutine; the
        prompt, `max_new_tokens` (default: up to the context), `ignore_eos`, `rid` and
        `skip_special_tokens` come from the request, other sampling parameters do not apply.
        """
        if isinstance(prompt, GenerateRequest):
            return self._beam_search_async(prompt, beam_width, length_penalty, early_stopping)
        prompt_ids = self._preparer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        search = self._new_search(
            prompt_ids, beam_width, max_tokens, length_penalty, early_stopping, ignore_eos
        )
        cached = 0
        while not search.done:
            request = step_request(prompt_ids, search)
            outputs = _collect(request, list(self._stream_sync(request)))
            cached = cached or outputs[0].cached_tokens
            search.advance(step_candidates(outputs))
        decoder = TextDecoder(self._tokenizer, skip_special_tokens)
        chunks = result_chunks(search, uuid.uuid4().hex, prompt_ids, cached, decoder)
        return [chunk.to_json() for chunk in chunks]

    async def _beam_search_async(
        self,
        request: GenerateRequest,
        beam_width: int,
        length_penalty: float,
        early_stopping: EarlyStopping,
    ) -> list[GenerateChunk]:
        if not request.is_single:
            raise InvalidRequest("text", "beam search takes one prompt; send one")
        loop = asyncio.get_running_loop()
        if request.text is not None:
            prompt_ids = await loop.run_in_executor(None, self._preparer.encode, str(request.text))
        else:
            prompt_ids = [int(t) for t in request.input_ids or []]  # type: ignore[arg-type]
        params = request.params
        max_tokens = params.max_new_tokens
        if max_tokens is None:
            max_tokens = max(1, self.context_length - len(prompt_ids))
        search = self._new_search(
            prompt_ids, beam_width, max_tokens, length_penalty, early_stopping, params.ignore_eos
        )
        cached = 0
        while not search.done:
            step = step_request(prompt_ids, search)
            outputs = _collect(step, [chunk async for chunk in self._stream_async(step)])
            cached = cached or outputs[0].cached_tokens
            search.advance(step_candidates(outputs))
        decoder = TextDecoder(self._tokenizer, params.skip_special_tokens)
        rid = request.rid if isinstance(request.rid, str) else uuid.uuid4().hex
        return result_chunks(search, rid, prompt_ids, cached, decoder)

    def _new_search(
        self,
        prompt_ids: list[int],
        beam_width: int,
        max_tokens: int,
        length_penalty: float,
        early_stopping: EarlyStopping,
        ignore_eos: bool,
    ) -> BeamSearch:
        params = BeamSearchParams(
            beam_width, max_tokens, length_penalty, early_stopping, ignore_eos
        )
        total = len(prompt_ids) + max_tokens
        if total > self.context_length:
            raise InvalidRequest(
                "max_new_tokens",
                f"this model's maximum context length is {self.context_length} tokens; you "
                f"requested {total} tokens ({len(prompt_ids)} in the prompt, {max_tokens} to "
                "generate); lower max_tokens or shorten the prompt",
            )
        return BeamSearch(params, self.eos_token_ids)

    # --------------------------------------------------------------------------- control

    def abort(self, rid: str) -> Reply[bool]:
        """Abort a request by id (its stream ends with finish_reason abort). The Reply is
        True when the id was known; await it or use it as a bool."""
        with self._lock:
            known = rid in self._sinks
        if known:
            self._connection.post(Abort(rid))
        return Reply.of(known)

    def flush_cache(self) -> Reply[bool]:
        """Drop the radix cache; False (and nothing dropped) while requests are running."""
        return Reply(self._ask(FlushCache))

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> Reply[dict[str, str]]:
        """Load a PEFT LoRA adapter directory under a name requests use (`lora_path`),
        SGLang's `/load_lora_adapter`. The Reply gives the loaded adapters (name -> path);
        a bad adapter or a name in use raises InvalidRequest naming `lora_path` /
        `lora_name`."""
        return self._lora_command(lambda reply: LoadLoraAdapter(lora_name, lora_path, reply))

    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        config_dict: Mapping[str, Any],
    ) -> Reply[dict[str, str]]:
        """Load a LoRA adapter a trainer holds in memory, without writing files (SGLang's
        `load_lora_adapter_from_tensors`): `tensors` are the PEFT-named A/B matrices
        (`...layers.3.self_attn.q_proj.lora_A.weight`: what `adapter_model.safetensors`
        holds), as a dict or (name, tensor) pairs, and `config_dict` the PEFT config (what
        `adapter_config.json` holds: `r`, `lora_alpha`, ...). An adapter already loaded under
        `lora_name` is replaced: requests sent after the Reply use the new weights and never
        reuse K/V computed with the earlier ones; requests already running finish on the
        earlier ones. The tensors are copied on the engine's thread: wait for the Reply
        before changing them. The Reply gives the loaded adapters (name -> directory,
        `<tensors>` for these); a bad adapter raises InvalidRequest naming `tensors` or
        `config_dict`."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        pairs = tuple((str(name), tensor) for name, tensor in items)
        config = dict(config_dict)
        return self._lora_command(
            lambda reply: LoadLoraAdapterFromTensors(lora_name, pairs, config, reply)
        )

    def unload_lora_adapter(self, lora_name: str) -> Reply[dict[str, str]]:
        """Unload an adapter: new requests naming it are refused at once, requests already
        using it finish, then its weights are freed. InvalidRequest if no such adapter."""
        return self._lora_command(lambda reply: UnloadLoraAdapter(lora_name, reply))

    # ------------------------------------------------------------------------- weights

    def update_weights_from_disk(
        self,
        model_path: str,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Reply[dict[str, Any]]:
        """Replace the model's weights with a checkpoint directory's (safetensors of the same
        architecture; every tensor the model needs), between steps, without a restart
        (SGLang's `update_weights_from_disk`). The Reply gives `{"success", "message",
        "weight_version"}`; a checkpoint that lacks tensors changes nothing. Requests that
        arrive after it never reuse K/V computed before; the radix cache is flushed when
        nothing runs (`flush_cache`)."""
        return Reply(
            self._ask(
                lambda reply: UpdateWeights(model_path, None, flush_cache, weight_version, reply)
            )
        )

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, Any]] | Any,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Reply[dict[str, Any]]:
        """Replace some or all weights from (checkpoint name, tensor) pairs — a trainer in the
        same process (SGLang's `update_weights_from_tensor`); as `update_weights_from_disk`
        otherwise. Tensors are copied (converted to the model's dtype and device).

        `load_format="flattened_bucket"` (SGLang's): `named_tensors` is one flat buffer and
        where each tensor lies in it — a `radixlm.runtime.FlattenedTensorBucket` (or
        SGLang's), or `{"flattened_tensor": tensor or bytes, "metadata": [...]}` — so that
        thousands of small tensors cross to an engine process in one piece. A bucket whose
        metadata does not fit its buffer raises InvalidRequest naming `named_tensors`."""
        payload: tuple[tuple[str, Any], ...] | FlattenedTensorBucket
        if load_format == "flattened_bucket":
            try:
                payload = checked_bucket(named_tensors)
            except ValueError as error:
                raise InvalidRequest("named_tensors", str(error)) from None
        elif load_format in (None, "direct"):
            payload = tuple((str(name), tensor) for name, tensor in named_tensors)
        else:
            raise InvalidRequest(
                "load_format",
                f"load_format is None ((name, tensor) pairs) or 'flattened_bucket'; got "
                f"{load_format!r}",
            )
        return Reply(
            self._ask(
                lambda reply: UpdateWeights(None, payload, flush_cache, weight_version, reply)
            )
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> Reply[dict[str, Any]]:
        """Join a trainer's torch.distributed group (SGLang's `init_weights_update_group`):
        rank `rank_offset` of `world_size`, the trainer rank 0, a TCP store at
        `master_address:master_port`; `gloo` (CPU tensors) or `nccl` (on the GPU). Its own
        process group, apart from tensor parallelism's; under tensor parallelism every rank
        joins, rank r as `rank_offset + r` (SGLang's layout: `world_size` counts them all)
        and receives the trainer's tensors itself. The Reply comes once every rank has
        joined."""
        return Reply(
            self._ask(
                lambda reply: InitWeightsUpdateGroup(
                    master_address, master_port, rank_offset, world_size, group_name, backend, reply
                )
            )
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Reply[dict[str, Any]]:
        """Receive tensors broadcast by the trainer (rank 0 of `group_name`), one per name in
        order, with these dtypes (`torch.bfloat16` or `"bfloat16"`) and shapes; then update
        the weights with them (SGLang's `update_weights_from_distributed`; answered as
        `update_weights_from_tensor`)."""
        command = partial(
            UpdateWeightsFromDistributed,
            tuple(names),
            tuple(str(d) for d in dtypes),
            tuple(tuple(int(n) for n in shape) for shape in shapes),
            group_name,
            flush_cache,
            weight_version,
        )
        return Reply(self._ask(lambda reply: command(reply)))

    def pause_generation(self, mode: str = "abort") -> Reply[bool]:
        """Stop running steps (SGLang's `pause_generation`, e.g. while a trainer updates the
        weights): `abort` ends every open request (finish_reason abort), `retract` sends the
        running ones back to the queue (their computed tokens stay cached: they resume
        cheaply), `in_place` keeps them where they are. New requests are queued meanwhile."""
        return Reply(self._ask(lambda reply: PauseGeneration(mode, reply)))

    def continue_generation(self) -> Reply[bool]:
        """Run steps again after `pause_generation`."""
        return Reply(self._ask(ContinueGeneration))

    def release_memory_occupation(
        self, tags: Sequence[str] | str | None = None
    ) -> Reply[dict[str, Any]]:
        """Give back the memory of `tags` — `"kv_cache"` (the KV pool and the request table;
        the radix cache is flushed), `"weights"` (the model's parameters), `"cuda_graph"`;
        None: all — while a trainer uses the device (SGLang's `release_memory_occupation`).
        The Reply gives `{"success", "message"}`; refused (`success: false`) while a request
        runs: pause it with `pause_generation("abort")` or `("retract")` first. Until the
        weights and the KV cache are back no step runs: requests sent meanwhile wait in the
        queue. InvalidRequest naming `tags` for an unknown tag."""
        chosen = (tags,) if isinstance(tags, str) else None if tags is None else tuple(tags)
        return Reply(self._ask(lambda reply: ReleaseMemoryOccupation(chosen, reply)))

    def resume_memory_occupation(
        self, tags: Sequence[str] | str | None = None
    ) -> Reply[dict[str, Any]]:
        """Allocate the memory of released `tags` again (None: all; SGLang's
        `resume_memory_occupation`): the KV cache empty, the weights as zeros — requests
        keep waiting until `update_weights_*` has written every weight (a release of the
        weights is meant to be followed by an update: verl's order is resume `["weights"]`,
        update, resume `["kv_cache"]`). A tag that is not released is left alone."""
        chosen = (tags,) if isinstance(tags, str) else None if tags is None else tuple(tags)
        return Reply(self._ask(lambda reply: ResumeMemoryOccupation(chosen, reply)))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first `truncate_size` rows of a weight by checkpoint name, as nested lists
        (SGLang's `get_weights_by_name`; a stacked projection's own rows for `q_proj` and the
        like). Under tensor parallelism the rows of the whole tensor, gathered from every
        rank's shard (SGLang gathers row-parallel weights and answers rank 0's rows of the
        others, which are the same first rows while they fit in rank 0's shard).
        InvalidRequest naming `name` when the model has none."""
        return cast(
            list[Any],
            self._ask(lambda reply: GetWeightsByName(name, truncate_size, reply)).result(60),
        )

    def lora_adapters(self) -> dict[str, str]:
        """The loaded adapters, name -> directory (empty when LoRA is off)."""
        return dict(self._lora or {})

    def _lora_command(self, make: Callable[[int], Command]) -> Reply[dict[str, str]]:
        answer = self._ask(make)
        done: Future[dict[str, str]] = Future()

        def update(future: Future[Any]) -> None:
            error = future.exception()
            if error is not None:
                done.set_exception(error)
                return
            # Updated before the caller sees the answer, so its next request finds the name.
            if self._lora is not None:
                self._lora = dict(future.result())
            done.set_result(dict(future.result()))

        answer.add_done_callback(update)
        return Reply(done)

    def run_in_loop(self, function: Callable[[EngineCore], T], timeout: float | None = 60) -> T:
        """Run `function(core)` on the engine thread between steps and return its result
        (for inspection and tests; thread mode only)."""
        if self.config.in_process:
            raise RuntimeError("run_in_loop needs the engine on a thread (engine_process=False)")
        future = self._ask(lambda reply: Call(function, reply))
        return cast(T, future.result(timeout))

    def check_invariants(self, timeout: float | None = 60) -> None:
        """Raise AssertionError unless the cache is consistent and no KV slot is lost
        (free + cached + held by running requests == pool size)."""
        self._ask(CheckInvariants).result(timeout)

    # ------------------------------------------------------------------------------ info

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (chat templates, token counting)."""
        return self._tokenizer

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/get_model_info`."""
        info = self.info
        multimodal = self._preparer.multimodal
        media = multimodal.processor if multimodal is not None else None
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.tokenizer_path or self.config.model_path,
            "served_model_name": self.config.served_model_name or self.config.model_path,
            "is_generation": self._preparer.pooling is None,
            # A pooling model's task ("embed", "classify", "score", "reward"), pooling method,
            # normalisation and labels (None: a generative model).
            "pooling": self._preparer.pooling,
            "max_context_length": info.context_length,
            "vocab_size": info.vocab_size,
            "chat_template": getattr(self._tokenizer, "chat_template", None),
            "eos_token_ids": list(info.eos_token_ids),
            "architectures": list(info.architectures),
            # The text that stands for one image / video in a prompt (None: not taken).
            "image_token": media.image_token if media is not None else None,
            "video_token": media.video_token if media is not None else None,
        }

    get_model_info = model_info

    def live_stats(self) -> dict[str, Any]:
        """The live figures alone (running, queued, token usage, cache counters): what a
        router reads on every request, without the configuration `server_info` adds."""
        if isinstance(self._connection, ThreadConnection):
            return self._connection.core.live_stats()
        return dict(self._live)

    def server_info(self, fresh: bool = False) -> dict[str, Any]:
        """Configuration and live statistics (a snapshot; counters are cumulative). Does not
        wait for the core: on a thread it reads the core's counters, from a process it gives
        the statistics the process last sent (at least every 50 ms while busy, and whenever
        it goes idle, ahead of the outputs they follow). `fresh=True` asks the process and
        waits for its answer (between two steps)."""
        if isinstance(self._connection, ThreadConnection):
            live = self._connection.core.live_stats()  # read across threads: a snapshot
        elif fresh:
            live = self._live = self._ask(GetServerInfo).result(60)
        else:
            live = self._live
        return {
            "config": self.config.to_dict(),
            **self.info.static_info,
            "model": self.model_info(),
            "max_total_num_tokens": self.info.max_total_num_tokens,
            "healthy": self.healthy,
            "engine_mode": "process" if self.config.in_process else "thread",
            **live,
        }

    get_server_info = server_info


def _media_arg(value: Any) -> Any:
    """PIL images given to the engine API become PNG bytes (the request schema's form)."""
    if isinstance(value, list):
        return [_media_arg(v) for v in value]
    if hasattr(value, "save") and hasattr(value, "mode") and hasattr(value, "size"):
        import io

        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    return value


def _queue_sink(inbox: queue.SimpleQueue[tuple[int, Any]], k: int) -> Callable[[Any], None]:
    def sink(item: Any) -> None:
        inbox.put((k, item))

    return sink


class _AsyncSink:
    """Hands items to a reader on an event loop. `Engine._dispatch` batches the items of one
    loop into one `call_soon_threadsafe` (one wake-up of the loop per batch of outputs)."""

    __slots__ = ("inbox", "k", "loop")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[tuple[int, Any]], k: int
    ) -> None:
        self.loop, self.inbox, self.k = loop, inbox, k

    def __call__(self, item: Any) -> None:
        _deliver_soon(self.loop, [(self, item)])


def _deliver_soon(loop: asyncio.AbstractEventLoop, items: list[tuple[_AsyncSink, Any]]) -> None:
    # A RuntimeError means the reader's event loop is gone; its request is aborted.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[_AsyncSink, Any]]) -> None:
    for sink, item in items:
        sink.inbox.put_nowait((sink.k, item))


def _async_sink(
    loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[tuple[int, Any]], k: int
) -> Callable[[Any], None]:
    return _AsyncSink(loop, inbox, k)


def _embedding_request(
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    text_pair: str | list[str] | None,
    rid: str | list[str] | None,
    dimensions: int | None,
    normalize: bool | None,
    truncate_prompt_tokens: int | None,
) -> EmbeddingRequest:
    body = {
        "text": prompt,
        "input_ids": input_ids,
        "text_pair": text_pair,
        "rid": rid,
        "dimensions": dimensions,
        "normalize": normalize,
        "truncate_prompt_tokens": truncate_prompt_tokens,
    }
    return EmbeddingRequest.parse({k: v for k, v in body.items() if v is not None})


def _embedding_output(final: GenerateChunk | None, rid: str) -> EmbeddingOutput:
    """An encode request's result from its final chunk; one that ended without a result
    (aborted, or too long for the memory left) raises InvalidRequest saying why."""
    extra = (final.extra or {}) if final is not None else {}
    embedding = extra.get("embedding")
    if final is None or embedding is None:
        reason = final.finish_reason if final is not None else None
        message = reason.message if reason is not None and reason.message else "aborted"
        raise InvalidRequest(
            "text", f"the encode request {rid!r} ended without a result: {message}"
        )
    return EmbeddingOutput(
        rid=final.rid,
        embedding=tuple(embedding),
        prompt_tokens=final.prompt_tokens,
        cached_tokens=final.cached_tokens,
        e2e_latency=final.e2e_latency,
    )


def _offsets(items: list[GenerateRequest], single: bool) -> list[int]:
    """Where each item's sequences start in the batch's `index` numbering (prompt-major)."""
    if single:
        return [0] * len(items)
    offsets, start = [], 0
    for item in items:
        offsets.append(start)
        start += item.params.n
    return offsets


def _coalesce(earlier: GenerateChunk, later: GenerateChunk, incremental: bool) -> GenerateChunk:
    """One chunk saying what two consecutive chunks of a sequence said. Output logprobs and
    hidden states are streamed as only the new entries, so they add up; text and ids too when
    the engine streams incrementally, else the later chunk's are the whole output so far."""

    def joined(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        return b if a is None or b is None else a + b

    return later._replace(
        text=earlier.text + later.text if incremental else later.text,
        output_ids=earlier.output_ids + later.output_ids if incremental else later.output_ids,
        output_token_logprobs=joined(earlier.output_token_logprobs, later.output_token_logprobs),
        output_top_logprobs=joined(earlier.output_top_logprobs, later.output_top_logprobs),
        output_token_ids_logprobs=joined(
            earlier.output_token_ids_logprobs, later.output_token_ids_logprobs
        ),
        hidden_states=joined(earlier.hidden_states, later.hidden_states),
    )


def _as_json(result: Any) -> Any:
    if isinstance(result, GenerateChunk):
        return result.to_json()
    return [chunk.to_json() for chunk in result]


async def _json_stream(chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[dict[str, Any]]:
    async for chunk in chunks:
        yield chunk.to_json()


def _collect(request: GenerateRequest, chunks: list[GenerateChunk]) -> Any:
    """Final outputs in index order: one chunk for a single prompt with n == 1, else a list."""
    final = sorted((c for c in chunks if c.finished), key=lambda c: c.index)
    if request.is_single and len(final) == 1:
        return final[0]
    return final
