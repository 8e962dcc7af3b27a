"""EngineBackend: run programs on an in-process `radixlm.runtime.Engine`, without HTTP.

`radixlm.runtime` is imported only inside `EngineBackend.__init__`, when no engine is given, so
radixlm-lang installs and imports without the runtime. Any object with SGLang's Engine call
shapes works (`generate(prompt=..., sampling_params=..., ...)`, optionally `async_generate`,
`model_info()`, `flush_cache()`).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from radixlm.lang.backends.native import Body, NativeBackend
from radixlm.lang.chat_template import ChatTemplate, Renderer, resolve_chat_template
from radixlm.lang.errors import UnsupportedFeature

# /generate body key -> Engine.generate keyword.
_KEYWORDS = {
    "text": "prompt",
    "input_ids": "input_ids",
    "image_data": "image_data",
    "video_data": "video_data",
    "sampling_params": "sampling_params",
    "return_logprob": "return_logprob",
    "logprob_start_len": "logprob_start_len",
    "top_logprobs_num": "top_logprobs_num",
    "return_text_in_logprobs": "return_text_in_logprobs",
    "stream": "stream",
}
# Keywords an engine may lack without changing the result (SGLang's Engine always returns texts).
_OPTIONAL = {"return_text_in_logprobs"}
_DONE = object()


def _accepted(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword names `fn` takes, or None when it takes **kwargs."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


class _EngineTransport:
    """Calls the engine. With `async_generate`, calls run on one private event loop, so requests
    from many program threads reach the engine together and batch; otherwise sync `generate`
    calls are serialised by a lock."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._async = callable(getattr(engine, "async_generate", None))
        entry = engine.async_generate if self._async else engine.generate
        self._accepts = _accepted(entry)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="radixlm-lang-engine-loop", daemon=True
                ).start()
                self._loop = loop
            return self._loop

    def _run(self, awaitable: Any) -> Any:
        async def wrap() -> Any:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrap(), self._event_loop()).result()

    def _kwargs(self, body: Body) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for key, value in body.items():
            keyword = _KEYWORDS.get(key)
            if keyword is None:
                raise UnsupportedFeature(
                    f"the in-process backend cannot pass {key!r} to the engine"
                )
            if self._accepts is not None and keyword not in self._accepts:
                if keyword in _OPTIONAL:
                    continue
                raise UnsupportedFeature(f"this engine's generate() takes no {keyword!r}")
            kwargs[keyword] = value
        return kwargs

    def request(self, body: Body) -> Any:
        kwargs = self._kwargs(body)
        if self._async:
            return self._maybe_await(self.engine.async_generate(**kwargs))
        with self._lock:
            return self.engine.generate(**kwargs)

    def stream(self, body: Body) -> Iterator[dict[str, Any]]:
        kwargs = self._kwargs({**body, "stream": True})
        if not self._async:
            with self._lock:
                yield from self.engine.generate(**kwargs)
            return
        chunks: queue.Queue[Any] = queue.Queue()

        async def pump() -> None:
            try:
                result = self.engine.async_generate(**kwargs)
                if inspect.isawaitable(result):
                    result = await result
                async for chunk in result:
                    chunks.put(chunk)
                chunks.put(_DONE)
            except BaseException as error:  # handed to the consuming thread
                chunks.put(error)

        asyncio.run_coroutine_threadsafe(pump(), self._event_loop())
        while True:
            item = chunks.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def model_info(self) -> dict[str, Any]:
        info_fn = getattr(self.engine, "model_info", None)
        info = dict(info_fn()) if callable(info_fn) else {}
        if "chat_template" not in info:
            info["chat_template"] = getattr(
                getattr(self.engine, "tokenizer", None), "chat_template", None
            )
        return info

    def _maybe_await(self, value: Any) -> Any:
        return self._run(value) if inspect.isawaitable(value) else value

    def flush_cache(self) -> bool:
        flush = getattr(self.engine, "flush_cache", None)
        return bool(self._maybe_await(flush())) if callable(flush) else False

    def server_info(self) -> dict[str, Any]:
        for name in ("server_info", "get_server_info"):
            fn = getattr(self.engine, name, None)
            if callable(fn):
                return dict(self._maybe_await(fn()))
        return {}

    def close(self) -> None:
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


def _tokenizer_renderer(engine: Any) -> Renderer | None:
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    bos = getattr(tokenizer, "bos_token", None) or ""

    def render(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        text = str(
            tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )
        return text[len(bos) :] if bos and text.startswith(bos) else text

    return render


class EngineBackend(NativeBackend):
    """Programs against an in-process engine.

    Give a running `engine` (a `radixlm.runtime.Engine` or anything with its call shapes), or a
    `model_path` and engine keywords to build one here (then `shutdown()` stops it).
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        model_path: str | None = None,
        chat_template_name: str | ChatTemplate | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self._owns_engine = engine is None
        if engine is None:
            if model_path is None:
                raise ValueError("EngineBackend needs an engine or a model_path")
            from radixlm.runtime.engine import Engine

            engine = Engine(model_path=model_path, **engine_kwargs)
        elif engine_kwargs or model_path is not None:
            raise ValueError("give either a running engine or model_path with engine keywords")
        self.engine = engine
        self._engine_transport = _EngineTransport(engine)
        self.model_info = self._engine_transport.model_info()
        template = resolve_chat_template(
            chat_template_name, self.model_info.get("chat_template"), _tokenizer_renderer(engine)
        )
        super().__init__(self._engine_transport, template.with_model_media_tokens(self.model_info))

    def shutdown(self) -> None:
        """Stop the private event loop, and the engine when this backend built it."""
        self._engine_transport.close()
        if self._owns_engine:
            shutdown = getattr(self.engine, "shutdown", None)
            if callable(shutdown):
                shutdown()

    def __enter__(self) -> EngineBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"EngineBackend({type(self.engine).__name__})"


def looks_like_engine(obj: object) -> bool:
    """An object with an engine's generate() that is not already a program backend."""
    return callable(getattr(obj, "generate", None)) and not callable(getattr(obj, "select", None))
