"""StreamExecutor: runs one program state's expressions, in order, on a background thread.

The program body submits expressions and goes on; reading a variable waits for the expression
that sets it. Forks are new executors that start from a copy of the parent's text, variables
and chat turns. A failing primitive stops the executor: the error names the primitive, is kept
in `error_`, and is raised by every read that depends on it.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, replace
from typing import Any

from radixlm.lang._media import data_uri, encode_image, encode_video
from radixlm.lang.backends.base import Backend, Completion, GenerateCall, Prompt
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.errors import ProgramError, UnsupportedFeature
from radixlm.lang.ir import (
    CachePrefix,
    ConstantText,
    Expr,
    ExprList,
    Gen,
    Image,
    JoinForks,
    RoleBegin,
    RoleEnd,
    RunDefaults,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    Video,
)
from radixlm.lang.speculative import ChatSpeculation, CompletionSpeculation

logger = logging.getLogger(__name__)
_POLL_S = 0.05


@dataclass(frozen=True)
class _TurnMedia:
    """An image or video of the open turn: where its placeholder starts in the text."""

    offset: int
    token: str
    kind: str  # "image" or "video"
    encoded: str

    def part(self) -> dict[str, Any]:
        """The content part that stands for it in a chat message."""
        key = f"{self.kind}_url"
        return {"type": key, key: {"url": data_uri(self.encoded, self.kind)}}


class StreamExecutor:
    """Executes the expressions of one program state on its own thread.

    Thread contract: `submit`, `fork`, `join_forks`, `end` are called by the program body (one
    thread); the reads (`get_var`, `text`, ...) by anyone; the worker thread alone writes the
    text, turns and generated variables.
    """

    def __init__(
        self,
        backend: Backend,
        defaults: RunDefaults,
        *,
        stream: bool = False,
        num_api_spec_tokens: int | None = None,
        chat_template: ChatTemplate | None = None,
        label: str = "program",
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.label = label
        self.chat_template = chat_template or backend.get_chat_template()
        self.num_api_spec_tokens = num_api_spec_tokens

        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.images_: list[str] = []
        self.videos_: list[str] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.role: str | None = None
        self.role_begin = 0
        self.role_media: list[_TurnMedia] = []
        self.fork_start = 0
        self.fork_messages = 0
        self.base_names: frozenset[str] = frozenset()
        self.error_: ProgramError | None = None

        self._events: dict[str, threading.Event] = {}
        self.completed: set[str] = set()
        self.stream_events: dict[str, threading.Event] = {}
        self.text_event = threading.Event()
        self.finished = threading.Event()
        self._scopes: dict[str, int] = {}
        self._ended = False
        self._completion_spec: CompletionSpeculation | None = None
        self._chat_spec: ChatSpeculation | None = None
        if num_api_spec_tokens is not None:
            if backend.is_chat_model:
                self._chat_spec = ChatSpeculation(num_api_spec_tokens)
            else:
                self._completion_spec = CompletionSpeculation(num_api_spec_tokens)

        self._queue: queue.Queue[Expr | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"sgl-{label}", daemon=True)
        self._worker.start()

    # ----- called by the program body -----

    def submit(self, expr: Expr) -> None:
        """Queue `expr`; registers the variables it will set so reads wait for them."""
        if self._ended:
            raise RuntimeError(
                f"the state of {self.label} has ended (its program returned, or it was joined); "
                "primitives can no longer be added to it"
            )
        self._register(expr)
        self._queue.put(expr)

    def _register(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._register(item)
            return
        names: tuple[str | None, ...] = ()
        if isinstance(expr, (Gen, Select, VarScopeBegin)):
            names = (expr.name,)
        elif isinstance(expr, JoinForks):
            names = expr.names
        for name in names:
            if name is not None:
                self.completed.discard(name)
                self._events[name] = threading.Event()
                if self.stream:
                    self.stream_events[name] = threading.Event()

    def fork(self, size: int) -> list[StreamExecutor]:
        """`size` executors starting from this one's state once its queue has run. With more
        than one fork, the text so far goes to the backend's cache first."""
        if size < 1:
            raise ValueError(f"fork size must be at least 1; got {size}")
        if self._chat_spec is not None and self._chat_spec.collecting:
            raise UnsupportedFeature("fork() inside a speculative assistant turn")
        if size > 1:
            self.submit(CachePrefix(f"fork({size})"))
        self.sync()
        if self.error_ is not None:
            raise self.error_
        children = []
        for i in range(size):
            child = StreamExecutor(
                self.backend,
                self.defaults,
                stream=self.stream,
                num_api_spec_tokens=self.num_api_spec_tokens,
                chat_template=self.chat_template,
                label=f"{self.label}/fork{i}",
            )
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.images_ = list(self.images_)
            child.videos_ = list(self.videos_)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.role, child.role_begin = self.role, self.role_begin
            child.role_media = list(self.role_media)
            child.fork_start, child.fork_messages = len(self.text_), len(self.messages_)
            child.base_names = frozenset(self.variables) | frozenset(self._events)
            children.append(child)
        return children

    def join_forks(self, forks: list[StreamExecutor], mode: str) -> None:
        """Queue the join of `forks` (see ProgramStateGroup.join)."""
        if mode == "gather_variable":
            names = sorted(
                {n for f in forks for n in f.variable_names()}
                - set().union(*(f.base_names for f in forks))
            )
        elif mode == "concate_and_append":
            names = []
        else:
            raise ValueError(
                f"join mode must be 'gather_variable' or 'concate_and_append'; got {mode!r}"
            )
        self.submit(JoinForks(tuple(forks), mode, tuple(names)))

    def end(self) -> None:
        """No more expressions will come; the worker stops after the queued ones."""
        if not self._ended:
            self._ended = True
            self._queue.put(None)

    # ----- reads -----

    def sync(self) -> None:
        """Wait until every submitted expression has run (or been skipped after an error)."""
        self._queue.join()

    def variable_names(self) -> set[str]:
        return set(self.variables) | set(self._events)

    def _wait(self, name: str) -> None:
        event = self._events.get(name)
        if event is None:
            return
        if self._chat_spec is None:
            event.wait()
            return
        while not event.wait(_POLL_S):
            if name in self._chat_spec.deferred:
                raise RuntimeError(
                    f"{name!r} is generated with the whole assistant turn (num_api_spec_tokens); "
                    "read it after the turn ends"
                )

    def get_var(self, name: str) -> Any:
        """The variable's value, once the expression that sets it has run."""
        self._wait(name)
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        raise KeyError(f"no variable {name!r}; this state has {sorted(self.variable_names())}")

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value
        self.completed.add(name)
        event = self._events.get(name)
        if event is not None:
            event.set()

    def get_meta_info(self, name: str) -> Any:
        self._wait(name)
        if name not in self.meta_info and self.error_ is not None:
            raise self.error_
        return self.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        if self.error_ is not None:
            raise self.error_
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        if self.error_ is not None:
            raise self.error_
        return list(self.messages_)

    def error(self) -> ProgramError | None:
        self.sync()
        return self.error_

    def fail(self, error: ProgramError) -> None:
        """Record a failure and wake every reader (it will see the error)."""
        if self.error_ is None:
            self.error_ = error
            logger.warning("%s: %s", self.label, error)
        for event in [*self._events.values(), *self.stream_events.values()]:
            event.set()
        self.text_event.set()

    # ----- the worker -----

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    spec = self._chat_spec
                    if spec is not None and spec.collecting and self.error_ is None:
                        self._execute(RoleEnd("assistant"))
                    return
                if self.error_ is None:
                    self._execute(expr)
            except ProgramError as error:
                self.fail(error)
            except Exception as error:
                self.fail(ProgramError(expr.describe() if expr else self.label, error, self.text_))
            finally:
                self._queue.task_done()
                self.text_event.set()
                if expr is None:
                    self.finished.set()
                    for event in self.stream_events.values():
                        event.set()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
            return
        try:
            self._dispatch(expr)
        except ProgramError:
            raise
        except Exception as error:
            raise ProgramError(expr.describe(), error, self.text_) from error

    def _dispatch(self, expr: Expr) -> None:
        if isinstance(expr, ConstantText):
            self._fill(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, Image):
            self._media("image", encode_image(expr.source))
        elif isinstance(expr, Video):
            self._media("video", encode_video(expr.source))
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            start = self._scopes.pop(expr.name, None)
            if start is None:
                raise ValueError(f"var_scope({expr.name!r}) ended without beginning")
            self._set(expr.name, self.text_[start:], None)
        elif isinstance(expr, CachePrefix):
            if self.text_:
                self.backend.cache_prefix(self.text_)
        elif isinstance(expr, JoinForks):
            self._join(expr)
        else:
            raise TypeError(f"unknown expression {type(expr).__name__}")

    def _append(self, text: str) -> None:
        self.text_ += text
        if self.stream:
            self.text_event.set()

    def _fill(self, text: str, structural: bool = False) -> None:
        """Constant text from the program (`structural`: role prefixes and suffixes)."""
        if not structural and self._chat_spec is not None and self._chat_spec.collecting:
            self._chat_spec.add_text(text)
            return
        if self._completion_spec is not None:
            self._completion_spec.consume(text)
        self._append(text)

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self.completed.add(name)
        for events in (self._events, self.stream_events):
            if name in events:
                events[name].set()

    def prompt(self) -> Prompt:
        """The state as a backend sees it."""
        return Prompt(
            text=self.text_,
            messages=tuple(self.messages_),
            images=tuple(self.images_),
            videos=tuple(self.videos_),
            role=self.role,
            role_text=self.text_[self.role_begin :] if self.role else "",
        )

    def _gen(self, expr: Gen) -> None:
        call = GenerateCall(
            self.prompt(),
            self.defaults.params_for(expr, self.chat_template.stop_str),
            expr.logprobs.over(self.defaults.logprobs),
            expr.dtype,
            expr.name,
        )
        if self._chat_spec is not None and self._chat_spec.collecting:
            self._chat_spec.add_gen(call)
            return
        if self._completion_spec is not None:
            self._store(expr.name, self._completion_spec.gen(call, self.backend.generate))
        elif self.stream:
            self._gen_stream(expr.name, call)
        else:
            self._store(expr.name, self.backend.generate(call))

    def _store(self, name: str | None, completion: Completion) -> None:
        text = completion.text
        self._append(text[0] if isinstance(text, list) else text)
        self._set(name, text, completion.meta_info)

    def _gen_stream(self, name: str | None, call: GenerateCall) -> None:
        if name is not None:
            self.variables[name] = ""
        for delta, meta in self.backend.generate_stream(call):
            self._append(delta)
            if name is not None:
                self.variables[name] += delta
                self.meta_info[name] = meta
                if name in self.stream_events:
                    self.stream_events[name].set()
        if name is not None:
            self._set(name, self.variables[name], self.meta_info.get(name))

    def _select(self, expr: Select) -> None:
        if self._chat_spec is not None and self._chat_spec.collecting:
            raise UnsupportedFeature("select() inside a speculative assistant turn")
        decision = self.backend.select(self.prompt(), expr.choices, expr.temperature, expr.method)
        if self._completion_spec is not None:
            self._completion_spec.consume(decision.decision)
        self._append(decision.decision)
        self._set(expr.name, decision.decision, decision.meta_info)

    def _media(self, kind: str, encoded: str) -> None:
        """An image or video: the template's placeholder into the text, the data beside it."""
        if self._chat_spec is not None and self._chat_spec.collecting:
            raise UnsupportedFeature(f"{kind}() inside a speculative assistant turn")
        token = self.chat_template.media_token(kind)
        (self.images_ if kind == "image" else self.videos_).append(encoded)
        self.role_media.append(_TurnMedia(len(self.text_), token, kind, encoded))
        self._fill(token, structural=True)

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(
                f"{role} turn started inside an open {self.role} turn; roles do not nest "
                f"(close it with {self.role}_end() first)"
            )
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and default_system:
            self._role_begin("system")
            self._fill(default_system, structural=True)
            self._role_end("system")
        prefix, _ = self.chat_template.prefix_and_suffix(role)
        self._fill(prefix, structural=True)
        self.role, self.role_begin, self.role_media = role, len(self.text_), []
        if role == "assistant" and self._chat_spec is not None:
            self._chat_spec.begin()

    def _role_end(self, role: str) -> None:
        if self.role != role:
            where = f"the open turn is {self.role}" if self.role else "no turn is open"
            raise ValueError(f"{role}_end() does not close a {role} turn; {where}")
        if self._chat_spec is not None and self._chat_spec.collecting:
            self._finish_chat_turn()
        content = self._turn_content()
        _, suffix = self.chat_template.prefix_and_suffix(role)
        self._fill(suffix, structural=True)
        self.messages_.append({"role": role, "content": content})
        self.role, self.role_media = None, []

    def _turn_content(self) -> str | list[dict[str, Any]]:
        """The open turn as a chat message's content: its text, or with images and videos,
        text and media parts in the order they were added (the placeholders left out of the
        text, since each part stands for one)."""
        if not self.role_media:
            return self.text_[self.role_begin :].lstrip()
        parts: list[dict[str, Any]] = []
        cursor = self.role_begin
        for item in self.role_media:
            parts.append({"type": "text", "text": self.text_[cursor : item.offset]})
            parts.append(item.part())
            cursor = item.offset + len(item.token)
        parts.append({"type": "text", "text": self.text_[cursor:]})
        parts[0]["text"] = parts[0]["text"].lstrip()
        return [p for p in parts if p["type"] != "text" or p["text"]]

    def _finish_chat_turn(self) -> None:
        assert self._chat_spec is not None
        prompt = replace(self.prompt(), role_text="")
        generate = self.backend.generate

        def call_with_turn_prompt(call: GenerateCall) -> Completion:
            return generate(replace(call, prompt=prompt))

        for text, part in self._chat_spec.finish(call_with_turn_prompt):
            self._append(text)
            if part.text is None:
                self._set(part.name, text, {"speculative": True})

    def _join(self, expr: JoinForks) -> None:
        forks: list[StreamExecutor] = list(expr.forks)
        for fork in forks:
            fork.sync()
        for i, fork in enumerate(forks):
            if fork.error_ is not None:
                raise RuntimeError(f"fork {i}: {fork.error_}") from fork.error_
        if expr.mode == "gather_variable":
            for name in expr.names:
                holders = [f for f in forks if name in f.variables]
                self._set(
                    name,
                    [f.variables[name] for f in holders],
                    [f.meta_info.get(name) for f in holders],
                )
        else:
            self._fill("".join(f.text_[f.fork_start :] for f in forks))
            for fork in forks:
                self.messages_.extend(fork.messages_[fork.fork_messages :])
        for fork in forks:
            fork.end()
