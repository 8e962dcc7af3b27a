"""ProgramState (the `s` of a program) and ProgramStateGroup (what `s.fork(n)` returns)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, overload

from radixlm.lang.errors import ProgramError
from radixlm.lang.executor import StreamExecutor
from radixlm.lang.ir import (
    Expr,
    ExprLike,
    ExprList,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
)

_POLL_S = 0.1


class _Follower:
    """Follows the growth of the text (or of one variable) of a streaming state."""

    def __init__(self, executor: StreamExecutor, var_name: str | None) -> None:
        self.executor = executor
        self.var_name = var_name
        self.sent = 0

    def _done(self) -> bool:
        ex = self.executor
        if self.var_name is None:
            return ex.finished.is_set()
        return self.var_name in ex.completed or ex.finished.is_set()

    def next_chunk(self) -> str | None:
        """New text (blocking until there is some), or None once it is complete. Raises the
        program's error if it failed before completing what is followed."""
        ex = self.executor
        while True:
            done = self._done() or ex.error_ is not None
            if self.var_name is None:
                current: Any = ex.text_
                event = ex.text_event
            else:
                current = ex.variables.get(self.var_name, "")
                event = ex.stream_events.get(self.var_name, ex.text_event)
            if isinstance(current, str) and len(current) > self.sent:
                chunk = current[self.sent :]
                self.sent = len(current)
                return chunk
            if done:
                complete = self.var_name in ex.completed if self.var_name else ex.error_ is None
                if ex.error_ is not None and not complete:
                    raise ex.error_
                return None
            if event.wait(_POLL_S):
                event.clear()


class ProgramState:
    """The state of one running program: its text, chat turns and variables.

    `s += "text"` or `s += gen("name")` adds to it; `s["name"]` waits for a variable; the text
    and turns come with `text()` and `messages()`. A failed primitive makes those reads raise
    its ProgramError; `error()` returns it without raising.
    """

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    # ----- building -----

    def __iadd__(self, other: ExprLike) -> ProgramState:
        if other is None:
            raise ValueError("cannot add None to a program state")
        self.stream_executor.submit(as_expr(other))
        return self

    def _role(self, role: str, expr: ExprLike | None) -> Any:
        if expr is not None:
            turn = ExprList.of(RoleBegin(role), as_expr(expr), RoleEnd(role))
            self.stream_executor.submit(turn)
            return turn

        @contextmanager
        def turn_scope() -> Iterator[None]:
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return turn_scope()

    @overload
    def system(self, expr: None = None) -> AbstractContextManager[None]: ...
    @overload
    def system(self, expr: ExprLike) -> ExprList: ...
    def system(self, expr: ExprLike | None = None) -> Any:
        """Add a system turn holding `expr`; without it, a context manager for the turn."""
        return self._role("system", expr)

    @overload
    def user(self, expr: None = None) -> AbstractContextManager[None]: ...
    @overload
    def user(self, expr: ExprLike) -> ExprList: ...
    def user(self, expr: ExprLike | None = None) -> Any:
        """Add a user turn holding `expr`; without it, a context manager for the turn."""
        return self._role("user", expr)

    @overload
    def assistant(self, expr: None = None) -> AbstractContextManager[None]: ...
    @overload
    def assistant(self, expr: ExprLike) -> ExprList: ...
    def assistant(self, expr: ExprLike | None = None) -> Any:
        """Add an assistant turn holding `expr`; without it, a context manager for the turn."""
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything added inside the block also becomes variable `name`."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` states that continue from this one's text in parallel (waits for this state's
        queued primitives first). `position_ids_offset` is accepted for compatibility."""
        executors = self.stream_executor.fork(int(size))
        return ProgramStateGroup([ProgramState(e) for e in executors], self)

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator[ProgramState]:
        """A single fork for the block, joined at its end."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ----- reading -----

    def text(self) -> str:
        """The whole text so far (waits for queued primitives)."""
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        """The finished chat turns, in the OpenAI message format."""
        return self.stream_executor.messages()

    def sync(self) -> None:
        """Wait for every queued primitive."""
        self.stream_executor.sync()

    def error(self) -> ProgramError | None:
        """The error that stopped the program (after waiting for it to run), or None."""
        return self.stream_executor.error()

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """What the backend reported for variable `name`: completion tokens, finish reason,
        logprobs; for `select`, the choices' scores (`normalized_prompt_logprobs`, ...)."""
        return self.stream_executor.get_meta_info(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or one variable) as it grows, when the program runs with stream=True;
        otherwise the finished text (or variable) at once."""
        if not self.stream_executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        follower = _Follower(self.stream_executor, var_name)
        while (chunk := follower.next_chunk()) is not None:
            yield chunk

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for asyncio; with `return_meta_data`, yields (chunk, meta_info)."""
        loop = asyncio.get_running_loop()
        if not self.stream_executor.stream:
            value = await loop.run_in_executor(
                None, self.text if var_name is None else lambda: self.get_var(var_name)
            )
            yield (
                (value, self.get_meta_info(var_name) if var_name else None)
                if return_meta_data
                else value
            )
            return
        follower = _Follower(self.stream_executor, var_name)
        while True:
            chunk = await loop.run_in_executor(None, follower.next_chunk)
            if chunk is None:
                return
            if return_meta_data:
                meta = self.stream_executor.meta_info.get(var_name) if var_name else None
                yield chunk, meta
            else:
                yield chunk

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.stream_executor.variable_names()

    def __del__(self) -> None:
        executor = getattr(self, "stream_executor", None)
        if executor is not None:
            executor.end()

    def __repr__(self) -> str:
        error = self.stream_executor.error()
        if error is not None:
            return f"ProgramState(failed: {error})"
        return f"ProgramState({self.stream_executor.text_!r})"


class ProgramStateGroup:
    """The states made by `s.fork(n)`: index or iterate them, `+=` to all, then `join()`."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """Bring the forks back into the source state (queued there, in order).

        `gather_variable`: every variable the forks created becomes, in the source state, the
        list of the forks' values. `concate_and_append`: the text each fork added is appended to
        the source state, fork after fork.
        """
        self.src_state.stream_executor.join_forks([s.stream_executor for s in self.states], mode)

    def __getitem__(self, index: int) -> ProgramState:
        return self.states[index]

    def __setitem__(self, index: int, value: ProgramState) -> None:
        if self.states[index] is not value:
            raise TypeError("the states of a fork cannot be replaced; use += on them")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(
        self, other: ExprLike | list[ExprLike] | tuple[ExprLike, ...] | Callable[[int], ExprLike]
    ) -> ProgramStateGroup:
        """A string or expression goes to every fork; a list gives one item per fork; a
        function `f(i)` gives fork i its item."""
        if isinstance(other, (str, Expr)):
            for state in self.states:
                state += other
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} items for {len(self.states)} forks")
            for state, item in zip(self.states, other, strict=True):
                state += item
        elif callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            raise TypeError(
                f"forks take a string, an expression, a list or a function of the fork index; "
                f"got {type(other).__name__}"
            )
        return self
