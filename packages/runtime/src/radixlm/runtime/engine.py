"""Engine: the public, SGLang-shaped API over the engine loop running in a background thread.

    with Engine("path/to/model") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16})
        print(out["text"], out["meta_info"]["cached_tokens"])

The same object serves the HTTP server: `generate(GenerateRequest)` is an async iterator of
chunks, and `abort` / `flush_cache` can be awaited, so it satisfies the server's `EngineClient`
protocol structurally (the runtime never imports the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar, overload

from radixlm.cache import RadixCache
from radixlm.runtime.beam_search import (
    BeamSearch,
    BeamSearchParams,
    EarlyStopping,
    result_chunks,
    step_candidates,
    step_request,
)
from radixlm.runtime.detokenizer import TextDecoder, load_tokenizer
from radixlm.runtime.engine_config import EngineConfig
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.executor import ModelExecutor
from radixlm.runtime.grammar import GrammarService
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.preparer import FrontendLimits, RequestPreparer
from radixlm.runtime.request_state import END, RequestHandle
from radixlm.runtime.scheduler import Scheduler
from radixlm.sampling import (
    EngineOverloaded,
    GenerateRequest,
    InvalidRequest,
    SamplingDefaults,
    SamplingParams,
)

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


class Engine:
    """An LLM engine: continuous batching over RadixAttention on one model.

    `Engine(model_path, **kwargs)` takes SGLang-style keyword arguments (see
    `radixlm.runtime.engine_config.ENGINE_KWARGS`), or `config=EngineConfig(...)`. A
    `ModelRunner` already built may be passed as `runner=` (its config then wins).
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
                raise TypeError("Engine needs a model_path (a local Hugging Face model directory)")
            config = EngineConfig.from_kwargs(path, **kwargs)
        elif kwargs:
            raise TypeError("pass either config= or keyword arguments, not both")
        if runner is not None:
            config = dataclasses.replace(config, runner=runner.config)
        self.config = config
        self.runner = runner if runner is not None else ModelRunner(config.runner)
        self._tokenizer = tokenizer or load_tokenizer(config.tokenizer_path or config.model_path)
        info = self.runner.info
        eos = set(info.eos_token_ids)
        if getattr(self._tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self._tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        self.context_length = self.runner.context_length
        pool = self.runner.kv_pool
        self.cache = RadixCache(
            page_size=pool.page_size,
            eviction_policy=config.cache.eviction_policy,  # type: ignore[arg-type]
            disable=config.cache.disable_radix_cache,
        )
        rows = self.runner.req_to_token_pool
        self.scheduler = Scheduler(config.scheduler, pool, rows, self.cache, rows.max_requests)
        self.grammar = GrammarService(
            config.grammar, self._tokenizer, self.runner.vocab_size, self.eos_token_ids
        )
        self.sampling_defaults = SamplingDefaults.from_generation_config(
            dict(info.generation_config),
            mode=config.sampling_defaults,  # type: ignore[arg-type]
        )
        self._preparer = RequestPreparer(
            self._tokenizer,
            self.sampling_defaults,
            self.grammar,
            FrontendLimits(
                vocab_size=self.runner.vocab_size,
                context_length=self.context_length,
                eos_token_ids=self.eos_token_ids,
                custom_logit_processors=config.runner.sampler.enable_custom_logit_processor,
                prefix_sharing=not config.cache.disable_radix_cache,
                clamp_max_tokens=config.clamp_max_tokens,
                max_logprobs=config.max_logprobs,
                stream_interval=config.stream_interval,
                hidden_size=self.runner.info.arch.hidden_size,
            ),
            config.incremental_streaming_output,
        )
        self._live: set[str] = set()
        self._live_lock = threading.Lock()
        self._core = EngineCore(
            self.scheduler,
            ModelExecutor(self.runner, seed=config.scheduler.random_seed),
            self.grammar,
            self.eos_token_ids,
            self.context_length,
            jump_forward=config.grammar.jump_forward,
            on_close=self._forget,
        )
        self._thread = threading.Thread(target=self._core.serve, name="radixlm-engine", daemon=True)
        self._closed = False
        self._thread.start()

    # ------------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the loop (open requests end with an error) and the grammar workers."""
        if self._closed:
            return
        self._closed = True
        self._core.post("stop")
        self._thread.join()
        self.grammar.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------------- submission

    def _forget(self, rid: str) -> None:
        with self._live_lock:
            self._live.discard(rid)

    def _submit(
        self, items: list[GenerateRequest], sinks: list[Callable[[Any], None]]
    ) -> list[RequestHandle]:
        """Prepare every item (raises InvalidRequest / EngineOverloaded before queueing any)."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        handles = [
            self._preparer.prepare(item, sink) for item, sink in zip(items, sinks, strict=True)
        ]
        limit = self.config.scheduler.max_queued_requests
        incoming = sum(len(h.seqs) for h in handles)
        if limit is not None and self._core.backlog(incoming) > limit:
            raise EngineOverloaded(
                f"the engine's queue is full ({limit} requests waiting); retry later"
            )
        with self._live_lock:
            rids = [h.rid for h in handles]
            clash = [r for r in rids if r in self._live] or [
                r for i, r in enumerate(rids) if r in rids[:i]
            ]
            if clash:
                raise InvalidRequest("rid", f"request id {clash[0]!r} is already in use")
            self._live.update(rids)
        for handle in handles:
            self._core.post("add", handle)
        return handles

    @staticmethod
    def _build_request(
        prompt: str | list[str] | None,
        sampling_params: _ParamsArg,
        input_ids: list[int] | list[list[int]] | None,
        extra: dict[str, Any],
    ) -> GenerateRequest:
        body: dict[str, Any] = {k: v for k, v in extra.items() if v is not None}
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
    ) -> Any:
        """Generate, SGLang's way, blocking: a dict for one prompt (n == 1), a list of dicts
        for a batch or n > 1 (prompt-major), or with `stream=True` an iterator of chunks
        (cumulative text; `index` tells sequences apart).

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
            ),
        )
        chunks = self._stream_sync(request)
        if stream:
            return chunks
        return _collect(request, list(chunks))

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
            ),
        )
        chunks = self._stream_async(request)
        if stream:
            return chunks
        return _collect(request, [chunk async for chunk in chunks])

    def _stream_sync(self, request: GenerateRequest) -> Iterator[Chunk]:
        items = request.split()
        inbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        sinks = [_queue_sink(inbox, k) for k in range(len(items))]
        handles = self._submit(items, sinks)
        return self._read_sync(inbox, handles, request.is_single)

    def _read_sync(
        self, inbox: queue.SimpleQueue[tuple[int, Any]], handles: list[RequestHandle], single: bool
    ) -> Iterator[Chunk]:
        open_ = len(handles)
        try:
            while open_:
                k, item = inbox.get()
                if item is END:
                    open_ -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield _reindex(item, handles[k], k, single)
        finally:
            if open_:
                for handle in handles:
                    self._core.post("abort", handle.rid)

    async def _stream_async(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        items = request.split()
        inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        sinks = [_async_sink(loop, inbox, k) for k in range(len(items))]
        # Tokenization and validation run off the event loop.
        handles = await loop.run_in_executor(None, self._submit, items, sinks)
        open_ = len(handles)
        try:
            while open_:
                k, item = await inbox.get()
                if item is END:
                    open_ -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield _reindex(item, handles[k], k, request.is_single)
        finally:
            if open_:
                for handle in handles:
                    self._core.post("abort", handle.rid)

    # ----------------------------------------------------------------------- beam search

    @overload
    def beam_search(
        self,
        prompt: GenerateRequest,
        beam_width: int,
        *,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
    ) -> Coroutine[Any, Any, list[Chunk]]: ...

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
            cached = cached or int(outputs[0]["meta_info"]["cached_tokens"])
            search.advance(step_candidates(outputs))
        decoder = TextDecoder(self._tokenizer, skip_special_tokens)
        return result_chunks(search, uuid.uuid4().hex, prompt_ids, cached, decoder)

    async def _beam_search_async(
        self,
        request: GenerateRequest,
        beam_width: int,
        length_penalty: float,
        early_stopping: EarlyStopping,
    ) -> list[Chunk]:
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
            cached = cached or int(outputs[0]["meta_info"]["cached_tokens"])
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
        with self._live_lock:
            known = rid in self._live
        if known:
            self._core.post("abort", rid)
        return Reply.of(known)

    def flush_cache(self) -> Reply[bool]:
        """Drop the radix cache; False (and nothing dropped) while requests are running."""
        future: Future[bool] = Future()
        self._core.post("flush", future)
        return Reply(future)

    def run_in_loop(self, function: Callable[[EngineCore], T], timeout: float | None = 60) -> T:
        """Run `function(core)` on the engine thread between steps and return its result
        (for inspection and tests)."""
        future: Future[T] = Future()
        self._core.post("call", (function, future))
        return future.result(timeout)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the cache is consistent and no KV slot is lost
        (free + cached + held by running requests == pool size)."""
        size = self.runner.kv_pool.num_slots
        self.run_in_loop(lambda core: core.scheduler.check_memory(size))

    # ------------------------------------------------------------------------------ info

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (chat templates, token counting)."""
        return self._tokenizer

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/get_model_info`."""
        info = self.runner.info
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.tokenizer_path or self.config.model_path,
            "served_model_name": self.config.served_model_name or self.config.model_path,
            "is_generation": True,
            "max_context_length": self.context_length,
            "vocab_size": self.runner.vocab_size,
            "chat_template": getattr(self._tokenizer, "chat_template", None),
            "eos_token_ids": list(self.eos_token_ids),
            "architectures": list(getattr(info.hf_config, "architectures", None) or []),
        }

    get_model_info = model_info

    def server_info(self) -> dict[str, Any]:
        """Configuration and live statistics (a snapshot; counters are cumulative)."""
        sched = self.scheduler
        pool = self.runner.kv_pool
        total = pool.num_slots
        free = pool.available + sched.evictable_tokens()
        stats = self.runner.stats
        return {
            "config": self.config.to_dict(),
            **self.grammar.settings(),
            # The compute dtype `dtype: auto` chose on this device, and why.
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "dtype_reason": self.runner.info.dtype_reason,
            "device": str(self.runner.device),
            # The linear layers' quantized format (None: full precision), and the KV pool's dtype.
            "quantization": quant.describe() if (quant := self.runner.info.quantization) else None,
            "kv_cache_dtype": str(self.runner.kv_pool.dtype).removeprefix("torch."),
            "model": self.model_info(),
            "max_total_num_tokens": total,
            "num_running_reqs": len(sched.running),
            "num_queued_reqs": len(sched.waiting),
            "token_usage": (total - free) / total if total else 0.0,
            "cache_hit_rate": sched.cached_tokens / sched.prompt_tokens
            if sched.prompt_tokens
            else 0.0,
            "prompt_tokens": sched.prompt_tokens,
            "cached_tokens": sched.cached_tokens,
            "cache_size": self.cache.total_size,
            "generated_tokens": self._core.generated_tokens,
            "jump_forward_tokens": self._core.jump_forward_tokens,
            "grammar_rollbacks": self._core.grammar_rollbacks,
            "finished_requests": self._core.finished_requests,
            "num_retractions": sched.num_retractions,
            "forward_passes": stats.forward_calls,
            "tokens_forwarded": stats.tokens_forwarded,
        }

    get_server_info = server_info


def _queue_sink(inbox: queue.SimpleQueue[tuple[int, Any]], k: int) -> Callable[[Any], None]:
    def sink(item: Any) -> None:
        inbox.put((k, item))

    return sink


def _async_sink(
    loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[tuple[int, Any]], k: int
) -> Callable[[Any], None]:
    def sink(item: Any) -> None:
        # A RuntimeError means the reader's event loop is gone; its request is aborted.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(inbox.put_nowait, (k, item))

    return sink


def _reindex(chunk: Chunk, handle: RequestHandle, k: int, single: bool) -> Chunk:
    if not single:
        chunk["index"] = k * handle.params.n + chunk["index"]
    return chunk


def _collect(request: GenerateRequest, chunks: list[Chunk]) -> Any:
    """Final outputs in index order: one dict for a single prompt with n == 1, else a list."""
    final = sorted(
        (c for c in chunks if c["meta_info"]["finish_reason"] is not None),
        key=lambda c: c["index"],
    )
    if request.is_single and len(final) == 1:
        return final[0]
    return final
