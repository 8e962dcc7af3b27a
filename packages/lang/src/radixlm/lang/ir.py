"""The program representation: expression nodes a program adds to its state, and run defaults.

Nodes are plain immutable data. They know nothing of backends or of the executor that runs them
(`radixlm.lang.executor`), so a program can be built, inspected or traced without either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Union

from radixlm.sampling import SamplingParams

if TYPE_CHECKING:
    from radixlm.lang.choices import ChoicesMethod

#: Regular expressions behind `gen_int`, `gen(dtype=float)`, `dtype=bool`, `gen_string`.
REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r'"[^"\n]*"'

DTYPE_REGEX: dict[str, str] = {
    "int": REGEX_INT,
    "float": REGEX_FLOAT,
    "bool": REGEX_BOOL,
    "str": REGEX_STR,
}
_DTYPE_NAMES: dict[object, str] = {
    int: "int",
    "int": "int",
    float: "float",
    "float": "float",
    bool: "bool",
    "bool": "bool",
    str: "str",
    "str": "str",
    "string": "str",
}

#: Values a program may add to its state with `s += ...`.
ExprLike = Union["Expr", str]


def dtype_name(dtype: object) -> str | None:
    """`int`, `"int"`, `float`, ... as one of "int", "float", "bool", "str" (None stays None)."""
    if dtype is None:
        return None
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype must be one of int, float, bool, str (or their names); got {dtype!r}"
        ) from None


def as_expr(value: object) -> Expr:
    """A string becomes ConstantText; an Expr stays itself; anything else is a TypeError."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return ConstantText(value)
    raise TypeError(
        f"a program state takes strings and sgl expressions (gen, select, user, ...), "
        f"not {type(value).__name__}; convert it with str(...)"
    )


class Expr:
    """A node of an LM program. `a + b` of nodes and strings builds an ExprList."""

    def __add__(self, other: ExprLike) -> ExprList:
        if not isinstance(other, (str, Expr)):
            return NotImplemented
        return ExprList.of(self, as_expr(other))

    def __radd__(self, other: ExprLike) -> ExprList:
        if not isinstance(other, (str, Expr)):
            return NotImplemented
        return ExprList.of(as_expr(other), self)

    def describe(self) -> str:
        """How the node reads in a program, for error messages."""
        return type(self).__name__


@dataclass(frozen=True, eq=False)
class ConstantText(Expr):
    value: str

    def describe(self) -> str:
        shown = self.value if len(self.value) <= 40 else self.value[:37] + "..."
        return f"text {shown!r}"


@dataclass(frozen=True, eq=False)
class ExprList(Expr):
    items: tuple[Expr, ...]

    @classmethod
    def of(cls, *parts: Expr) -> ExprList:
        """Concatenate, flattening nested lists."""
        flat: list[Expr] = []
        for part in parts:
            flat.extend(part.items if isinstance(part, ExprList) else (part,))
        return cls(tuple(flat))

    def describe(self) -> str:
        return " + ".join(item.describe() for item in self.items) or "nothing"


@dataclass(frozen=True)
class LogprobOptions:
    """The /generate request's logprob fields (not sampling parameters). None: not set here."""

    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def over(self, base: LogprobOptions) -> LogprobOptions:
        """These options, with the fields not set here taken from `base`."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(base, **{k: v for k, v in given.items() if v is not None})

    def request_fields(self) -> dict[str, Any]:
        """The fields that are set, as /generate body keys."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def _check_sampling_keys(values: Mapping[str, Any]) -> None:
    unknown = sorted(set(values) - set(SamplingParams.model_fields))
    if unknown:
        raise ValueError(f"not sampling parameters: {', '.join(unknown)}")


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate text into variable `name` (None: into the text only).

    `sampling` holds only the SamplingParams fields this call sets; the rest come from the run.
    """

    name: str | None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    dtype: str | None = None

    def __post_init__(self) -> None:
        _check_sampling_keys(self.sampling)

    def describe(self) -> str:
        return f"gen({self.name!r})"


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Pick one of `choices` by scoring each with the model; the choice goes into `name`."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    method: ChoicesMethod

    def describe(self) -> str:
        shown = ", ".join(repr(c) for c in self.choices[:4]) + (
            ", ..." if len(self.choices) > 4 else ""
        )
        return f"select({self.name!r}, choices=[{shown}])"


@dataclass(frozen=True, eq=False)
class Image(Expr):
    """An image: a file path, a URL, a data URI, a base64 string or raw bytes."""

    source: str | bytes

    def describe(self) -> str:
        if isinstance(self.source, bytes):
            return f"image(<{len(self.source)} bytes>)"
        return f"image({self.source[:60]!r})"


@dataclass(frozen=True, eq=False)
class Video(Expr):
    """A video: a file path, a URL, a data URI, a base64 string or raw bytes of a video file.

    `num_frames` is SGLang's argument, kept for the program's record; the request carries the
    whole video and the server samples its own number of frames.
    """

    source: str | bytes
    num_frames: int | None = None

    def describe(self) -> str:
        shown = (
            f"<{len(self.source)} bytes>"
            if isinstance(self.source, bytes)
            else repr(self.source[:60])
        )
        frames = f", num_frames={self.num_frames}" if self.num_frames is not None else ""
        return f"video({shown}{frames})"


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str

    def describe(self) -> str:
        return f"{self.role}_begin()"


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str

    def describe(self) -> str:
        return f"{self.role}_end()"


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    name: str

    def describe(self) -> str:
        return f"var_scope({self.name!r})"


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    name: str

    def describe(self) -> str:
        return f"end of var_scope({self.name!r})"


@dataclass(frozen=True, eq=False)
class CachePrefix(Expr):
    """Ask the backend to cache the text so far (before forks start from it)."""

    reason: str = "fork"

    def describe(self) -> str:
        return self.reason


@dataclass(frozen=True, eq=False)
class JoinForks(Expr):
    """Bring the forks' new variables back as lists (`names`), or append their new text.

    `forks` are opaque executor handles; only the executor knows what they are.
    """

    forks: tuple[Any, ...]
    mode: str
    names: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"join(mode={self.mode!r})"


@dataclass(frozen=True)
class RunDefaults:
    """The run-level sampling values: the defaults of every gen in the program."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)

    def params_for(self, gen: Gen, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        """The gen's SamplingParams: the run's explicit values overridden by the gen's, plus
        `extra_stop` (the chat template's end-of-turn strings). Raises InvalidRequest."""
        values = {**self.sampling.model_dump(exclude_unset=True), **gen.sampling}
        if extra_stop:
            stop = values.get("stop")
            stops = [stop] if isinstance(stop, str) else list(stop or [])
            values["stop"] = stops + [s for s in extra_stop if s not in stops]
        return SamplingParams.parse(values)


def json_schema_text(schema: object) -> str | None:
    """A JSON schema given as text, a dict, or a pydantic model class, as JSON text."""
    if schema is None or isinstance(schema, str):
        return schema
    if isinstance(schema, Mapping):
        return json.dumps(schema)
    to_schema = getattr(schema, "model_json_schema", None)
    if callable(to_schema):
        return json.dumps(to_schema())
    raise TypeError(
        f"json_schema must be JSON text, a dict or a pydantic model class; got {type(schema).__name__}"
    )
