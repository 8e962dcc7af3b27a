"""The language's primitives, with SGLang's names, arguments and argument order."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from typing import Any, overload

from radixlm.lang.choices import ChoicesMethod, token_length_normalized
from radixlm.lang.ir import (
    ExprLike,
    ExprList,
    Gen,
    Image,
    LogprobOptions,
    RoleBegin,
    RoleEnd,
    Select,
    Video,
    as_expr,
    dtype_name,
    json_schema_text,
)
from radixlm.lang.program import Program, get_default_backend
from radixlm.sampling import InvalidRequest


@overload
def function(func: Callable[..., Any], num_api_spec_tokens: int | None = None) -> Program: ...
@overload
def function(
    func: None = None, num_api_spec_tokens: int | None = None
) -> Callable[[Callable[..., Any]], Program]: ...
def function(
    func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None
) -> Program | Callable[[Callable[..., Any]], Program]:
    """Make `def prog(s, ...)` an LM program: `@function` or `@function(num_api_spec_tokens=N)`."""
    if num_api_spec_tokens is not None and num_api_spec_tokens < 1:
        raise ValueError(f"num_api_spec_tokens must be at least 1; got {num_api_spec_tokens}")
    if func is not None:
        return Program(func, num_api_spec_tokens)

    def decorate(inner: Callable[..., Any]) -> Program:
        return Program(inner, num_api_spec_tokens)

    return decorate


def _check_regex(name: str | None, regex: str | None) -> None:
    if regex is None:
        return
    try:
        re.compile(regex)
    except re.error as error:
        raise InvalidRequest(
            "regex", f"gen({name!r}): {regex!r} is not a valid regular expression: {error}"
        ) from None


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
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
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
) -> Gen | Select:
    """Generate into variable `name`. Unset values come from the run (`prog.run(...)`).

    With `choices`, this is `select`. `regex` / `json_schema` (text, dict or pydantic model)
    constrain the output; `dtype` (int, float, bool, str) constrains it to that type's regex.
    """
    if choices:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    _check_regex(name, regex)
    sampling = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": min_tokens,
        "n": n,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "stop_regex": stop_regex,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
        "regex": regex,
        "json_schema": json_schema_text(json_schema),
    }
    logprobs = LogprobOptions(
        return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs
    )
    given = {k: v for k, v in sampling.items() if v is not None}
    return Gen(name, given, logprobs, dtype_name(dtype))


def _typed_gen(dtype: type, name: str | None, max_tokens: int | None, **kwargs: Any) -> Gen:
    expr = gen(name, max_tokens, dtype=dtype, **kwargs)
    assert isinstance(expr, Gen)
    return expr


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
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
) -> Gen:
    """Generate an integer (as text matching REGEX_INT) into `name`."""
    values = dict(locals())
    return _typed_gen(int, values.pop("name"), values.pop("max_tokens"), **values)


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
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
) -> Gen:
    """Generate a double-quoted string (REGEX_STR) into `name`."""
    values = dict(locals())
    return _typed_gen(str, values.pop("name"), values.pop("max_tokens"), **values)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod = token_length_normalized,
) -> Select:
    """Choose one of `choices` by the model's scores; the choice is added to the text and
    stored in `name`, its scores in `get_meta_info(name)`. `choices_method` is
    token_length_normalized (default), greedy_token_selection or
    unconditional_likelihood_normalized."""
    if not choices:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices")
    if any(not isinstance(c, str) for c in choices):
        raise TypeError(f"select({name!r}): choices must be strings")
    if temperature > 1e-5:
        raise ValueError(
            f"select({name!r}) scores the choices and takes the best; temperature must be 0"
        )
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(f"select({name!r}): choices_method must be a ChoicesMethod")
    return Select(name, tuple(choices), temperature, choices_method)


def image(expr: Any) -> Image:
    """An image for a vision model: a file path, URL, data URI, base64 string or bytes."""
    return Image(expr)


def video(path: Any, num_frames: int | None = None) -> Video:
    """A video for a vision model (Qwen2-VL): a file path, URL, data URI, base64 string or the
    bytes of a video file. It goes to the model whole (a file as base64 in `video_data`, a
    URL as it is) and the server samples its frames: its own default number of them, since a
    request has no field for a count. `num_frames` is accepted for SGLang's programs, and a
    warning says that it is not sent."""
    if num_frames is not None:
        if num_frames < 1:
            raise ValueError(f"video(num_frames=...) must be at least 1; got {num_frames}")
        warnings.warn(
            f"video(num_frames={num_frames}): the video is sent whole and the server samples "
            "its own default number of frames; num_frames is not sent",
            UserWarning,
            stacklevel=2,
        )
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, (str, bytes)):
        raise TypeError(
            f"video() takes a file path, URL, data URI, base64 string or bytes; got "
            f"{type(path).__name__}"
        )
    return Video(path, num_frames)


def _turn(role: str, expr: ExprLike | None) -> ExprList:
    if expr is None:
        return ExprList.of(RoleBegin(role), RoleEnd(role))
    return ExprList.of(RoleBegin(role), as_expr(expr), RoleEnd(role))


def system(expr: ExprLike | None = None) -> ExprList:
    """A system turn holding `expr`, written with the model's chat template."""
    return _turn("system", expr)


def user(expr: ExprLike | None = None) -> ExprList:
    """A user turn holding `expr`."""
    return _turn("user", expr)


def assistant(expr: ExprLike | None = None) -> ExprList:
    """An assistant turn holding `expr`."""
    return _turn("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    """Flush the prefix cache of `backend` (default: the default backend)."""
    from radixlm.lang.backends import as_backend

    chosen = backend if backend is not None else get_default_backend()
    return False if chosen is None else as_backend(chosen).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """What `backend` (default: the default backend) reports about itself."""
    from radixlm.lang.backends import as_backend

    chosen = backend if backend is not None else get_default_backend()
    return None if chosen is None else as_backend(chosen).get_server_info()
