"""Find the constant text every run of a program starts with, by tracing its body.

The body runs once against a stand-in state with stand-in arguments (or the real ones, where the
whole batch shares them). Constant text and role markers are recorded; the first thing that
depends on an argument, on the model, or on the state stops the trace. `run_batch` sends the
result to the backend's cache before the batch (prefix hinting), so every run hits it.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import ConstantText, Expr, ExprList, RoleBegin, RoleEnd, as_expr

logger = logging.getLogger(__name__)
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "radixlm_lang_tracing", default=False
)
_MISSING = object()


class StopTrace(Exception):
    """The traced body reached something that depends on the run."""


def is_tracing() -> bool:
    """True inside a trace (a program called from a traced body must not run for real)."""
    return _TRACING.get()


def _stop(*args: Any, **kwargs: Any) -> Any:
    raise StopTrace


class _Unknown:
    """A value the trace cannot know: any use of it stops the trace."""

    __str__ = __repr__ = __format__ = __mul__ = __rmul__ = _stop
    __iter__ = __len__ = __bool__ = __eq__ = __ne__ = __hash__ = __getitem__ = _stop
    __int__ = __float__ = __contains__ = __call__ = __lt__ = __gt__ = _stop

    def __getattr__(self, name: str) -> Any:
        raise StopTrace

    def __add__(self, other: Any) -> _Partial:
        return _Partial("")

    def __radd__(self, other: Any) -> _Partial:
        if isinstance(other, (str, Expr)):
            return _Partial(other)
        raise StopTrace


class _Placeholder(_Unknown):
    """An argument whose value differs across the batch."""


class _Partial(_Unknown):
    """Known text (or expression) followed by something unknown: `"Q: " + question`."""

    known: str | Expr

    def __init__(self, known: str | Expr) -> None:
        object.__setattr__(self, "known", known)

    def __add__(self, other: Any) -> _Partial:
        return self

    def __radd__(self, other: Any) -> _Partial:
        if isinstance(other, (str, Expr)):
            return _Partial(ExprList.of(as_expr(other), as_expr(self.known)))
        raise StopTrace


class _TraceState:
    """A stand-in for ProgramState that records constant text."""

    def __init__(self, template: ChatTemplate) -> None:
        self._template = template
        self._role: str | None = None
        self._turns = 0
        self.text = ""

    def __iadd__(self, other: Any) -> _TraceState:
        self._add(other)
        return self

    def _add(self, other: Any) -> None:
        if isinstance(other, _Partial):
            self._add(other.known)
            raise StopTrace
        if isinstance(other, str):
            self.text += other
        elif isinstance(other, ConstantText):
            self.text += other.value
        elif isinstance(other, ExprList):
            for item in other.items:
                self._add(item)
        elif isinstance(other, RoleBegin):
            if self._role is not None:
                raise StopTrace
            default = self._template.default_system_prompt
            if not self._turns and other.role != "system" and default:
                self._add(
                    ExprList.of(RoleBegin("system"), ConstantText(default), RoleEnd("system"))
                )
            self.text += self._template.prefix_and_suffix(other.role)[0]
            self._role = other.role
        elif isinstance(other, RoleEnd):
            self.text += self._template.prefix_and_suffix(other.role)[1]
            self._role, self._turns = None, self._turns + 1
        else:
            raise StopTrace

    def _turn(self, role: str, expr: Any) -> Any:
        if expr is not None:
            self._add(
                ExprList.of(
                    RoleBegin(role),
                    ConstantText(expr) if isinstance(expr, str) else expr,
                    RoleEnd(role),
                )
            )
            return None

        @contextmanager
        def scope() -> Iterator[None]:
            self._add(RoleBegin(role))
            yield
            self._add(RoleEnd(role))

        return scope()

    def system(self, expr: Any = None) -> Any:
        return self._turn("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._turn("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._turn("assistant", expr)

    def __getattr__(self, name: str) -> Any:
        raise StopTrace

    __getitem__ = __setitem__ = __contains__ = _stop


def _shared(values: Sequence[Any]) -> Any:
    first = values[0]
    try:
        if all(v is first or v == first for v in values[1:]):
            return first
    except Exception:  # values that cannot be compared are not shared
        pass
    return _Placeholder()


def trace_prefix(
    func: Callable[..., Any],
    arg_names: Sequence[str],
    bound: Mapping[str, Any],
    batch: Sequence[Mapping[str, Any]],
    template: ChatTemplate,
) -> str:
    """The constant text all runs of `func` over `batch` start with ("" when none)."""
    kwargs: dict[str, Any] = dict(bound)
    for name in arg_names:
        if name in bound:
            continue
        values = [item.get(name, _MISSING) for item in batch]
        if all(v is _MISSING for v in values):
            continue
        missing = any(v is _MISSING for v in values)
        kwargs[name] = _Placeholder() if missing else _shared(values)
    state = _TraceState(template)
    token = _TRACING.set(True)
    try:
        func(state, **kwargs)
    except StopTrace:
        pass
    except Exception as error:  # the body did something the trace does not model
        logger.debug("prefix trace stopped: %r", error)
    finally:
        _TRACING.reset(token)
    return state.text
