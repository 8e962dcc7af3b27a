"""Program (what `@function` makes): run it once, or over a batch with prefix hinting."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixlm.lang.backends import Backend, as_backend
from radixlm.lang.errors import BackendError, ProgramError
from radixlm.lang.executor import StreamExecutor
from radixlm.lang.ir import LogprobOptions, RunDefaults
from radixlm.lang.state import ProgramState
from radixlm.lang.tracing import StopTrace, is_tracing, trace_prefix
from radixlm.sampling import SamplingParams

logger = logging.getLogger(__name__)

#: A batch's traced common prefix is sent to the cache first when it is at least this long.
PREFIX_HINT_MIN_CHARS = 32

_default_backend: list[Any] = [None]
_default_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """The backend programs use when `run(backend=...)` is not given."""
    with _default_lock:
        _default_backend[0] = None if backend is None else as_backend(backend)


def get_default_backend() -> Backend | None:
    with _default_lock:
        backend: Backend | None = _default_backend[0]
        return backend


def _resolve_backend(backend: Any) -> Backend:
    chosen = backend if backend is not None else get_default_backend()
    if chosen is None:
        raise ValueError(
            "no backend: pass run(backend=...) or call sgl.set_default_backend("
            "sgl.RuntimeEndpoint('http://localhost:30000'))"
        )
    return as_backend(chosen)


def run_defaults(
    *,
    max_new_tokens: int | None,
    stop: str | list[str] | None,
    stop_token_ids: list[int] | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    frequency_penalty: float | None,
    presence_penalty: float | None,
    ignore_eos: bool | None,
    return_logprob: bool | None,
    logprob_start_len: int | None,
    top_logprobs_num: int | None,
    return_text_in_logprobs: bool | None,
) -> RunDefaults:
    """The run-level values as RunDefaults; raises InvalidRequest naming a bad field."""
    given = {
        "max_new_tokens": max_new_tokens,
        "stop": stop or None,
        "stop_token_ids": stop_token_ids or None,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
    }
    sampling = SamplingParams.parse({k: v for k, v in given.items() if v is not None})
    logprobs = LogprobOptions(
        return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs
    )
    return RunDefaults(sampling, logprobs)


#: The keyword arguments of `run` / `run_batch` that make their RunDefaults.
_RUN_DEFAULT_NAMES = tuple(inspect.signature(run_defaults).parameters)


def _run_defaults_from(arguments: Mapping[str, Any]) -> RunDefaults:
    """run_defaults of the run-level values among a method's `locals()`."""
    return run_defaults(**{name: arguments[name] for name in _RUN_DEFAULT_NAMES})


class Program:
    """An LM program: `def prog(s, ...)` decorated with `@function`.

    `prog.run(**arguments)` runs it and returns its ProgramState; calling `prog(...)` does the
    same. `run_batch([...])` runs many at once. `bind(...)` fixes some arguments.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: Mapping[str, Any] | None = None,
    ) -> None:
        parameters = list(inspect.signature(func).parameters.values())
        if not parameters:
            raise TypeError(f"{func.__name__} must take the program state as its first argument")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = [p.name for p in parameters[1:]]
        self.required_args = [
            p.name for p in parameters[1:] if p.default is inspect.Parameter.empty
        ]
        functools.update_wrapper(self, func)

    @property
    def name(self) -> str:
        return str(getattr(self.func, "__name__", "program"))

    def bind(self, **kwargs: Any) -> Program:
        """A program with some arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.name}() has no arguments {unknown}; it takes {self.arg_names}")
        return Program(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        max_new_tokens: int | None = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        ignore_eos: bool | None = None,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Any = None,
        use_thread: bool = True,
        **kwargs: Any,
    ) -> ProgramState:
        """Run once. The sampling values are the defaults of every gen (a gen's own values win;
        values set nowhere are left to the server). With `stream=True` the body runs on its own
        thread and this returns at once; follow it with `state.text_iter()`."""
        if is_tracing():
            raise StopTrace
        defaults = _run_defaults_from(locals())
        return run_program(self, _resolve_backend(backend), args, kwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: Iterable[Mapping[str, Any] | Sequence[Any]],
        *,
        max_new_tokens: int | None = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        ignore_eos: bool | None = None,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = True,
    ) -> list[ProgramState]:
        """Run once per item (a dict of arguments, or a tuple of them in order), concurrently
        on `num_threads` threads, with a tqdm progress bar (on stderr; `progress_bar=False`
        turns it off; SGLang's default is off). The text all items start
        with is sent to the backend's cache first. A program that fails does not stop the
        others: its state carries the error (`state.error()`; reads raise it)."""
        items = [self._arguments(item) for item in batch_kwargs]
        if not items:
            return []
        defaults = _run_defaults_from(locals())
        chosen = _resolve_backend(backend)
        if len(items) > 1:
            self._hint_prefix(chosen, items)
        threads = max(96, (os.cpu_count() or 1) * 16) if num_threads == "auto" else int(num_threads)
        threads = max(1, min(threads, len(items)))
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc=self.name)
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix=f"sgl-batch-{self.name}") as pool:
                futures = [
                    pool.submit(run_program, self, chosen, (), item, defaults, False, True, True)
                    for item in items
                ]
                if bar is not None:
                    for future in futures:
                        future.add_done_callback(lambda _: bar.update())
                return [future.result() for future in futures]
        finally:
            if bar is not None:
                bar.close()

    def _arguments(self, item: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(item, Mapping):
            return dict(item)
        if isinstance(item, (list, tuple)):
            free = [n for n in self.arg_names if n not in self.bind_arguments]
            required = [n for n in self.required_args if n not in self.bind_arguments]
            if not len(required) <= len(item) <= len(free):
                raise TypeError(
                    f"{self.name}() takes {len(required)} to {len(free)} arguments {free}; "
                    f"a batch item has {len(item)}"
                )
            return dict(zip(free, item, strict=False))
        raise TypeError(
            f"a batch item is a dict or a tuple of arguments; got {type(item).__name__}"
        )

    def _hint_prefix(self, backend: Backend, items: list[dict[str, Any]]) -> None:
        prefix = trace_prefix(
            self.func, self.arg_names, self.bind_arguments, items, backend.get_chat_template()
        )
        if len(prefix) >= PREFIX_HINT_MIN_CHARS:
            try:
                backend.cache_prefix(prefix)
            except BackendError as error:  # each run will report its own failure
                logger.debug("prefix hint failed: %s", error)

    def cache(self, backend: Any = None, **arguments: Any) -> str:
        """Send the program's constant prefix to the backend's cache; returns it."""
        chosen = _resolve_backend(backend)
        prefix = trace_prefix(
            self.func, self.arg_names, self.bind_arguments, [arguments], chosen.get_chat_template()
        )
        if prefix:
            chosen.cache_prefix(prefix)
        return prefix

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<sgl program {self.name}>"


def run_program(
    program: Program,
    backend: Backend,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    defaults: RunDefaults,
    stream: bool,
    sync: bool = False,
    keep_errors: bool = False,
) -> ProgramState:
    """Run `program` once on `backend`. Without `stream`, the body runs here and its exceptions
    propagate (unless `keep_errors`: then they are recorded in the state); with `stream`, it
    runs on a thread and every exception is recorded in the state."""
    executor = StreamExecutor(
        backend,
        defaults,
        stream=stream,
        num_api_spec_tokens=program.num_api_spec_tokens,
        label=program.name,
    )
    state = ProgramState(executor)
    arguments = {**program.bind_arguments, **kwargs}

    def body() -> None:
        try:
            state.ret_value = program.func(state, *args, **arguments)
        finally:
            executor.end()
        if sync:
            executor.sync()

    def body_recording_errors() -> None:
        try:
            body()
        except ProgramError as error:
            executor.fail(error)
        except Exception as error:
            executor.fail(ProgramError(f"the body of {program.name}()", error, executor.text_))

    if stream:
        threading.Thread(
            target=body_recording_errors, name=f"sgl-body-{program.name}", daemon=True
        ).start()
    elif keep_errors:
        body_recording_errors()
    else:
        body()
    return state
