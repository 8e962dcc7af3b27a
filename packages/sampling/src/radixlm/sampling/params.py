"""SamplingParams: SGLang's sampling parameters plus vLLM's extras, validated with clear errors."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from radixlm.sampling.errors import FieldError, InvalidRequest

# field -> (low, low inclusive, high, high inclusive, what the value means). None: unbounded.
_RANGES: dict[str, tuple[float | None, bool, float | None, bool, str]] = {
    "temperature": (0.0, True, None, False, "0 means greedy decoding"),
    "top_p": (0.0, False, 1.0, True, "1 keeps every token"),
    "min_p": (0.0, True, 1.0, True, "0 disables min-p"),
    "frequency_penalty": (-2.0, True, 2.0, True, "0 disables it"),
    "presence_penalty": (-2.0, True, 2.0, True, "0 disables it"),
    "repetition_penalty": (0.0, False, 2.0, True, "1 disables it"),
    "max_new_tokens": (0, True, None, False, "0 only scores the prompt"),
    "min_new_tokens": (0, True, None, False, "0 disables it"),
    "n": (1, True, None, False, "the number of completions per prompt"),
    "logprobs": (-1, True, None, False, "top logprobs per output token; -1: the whole vocabulary"),
    "prompt_logprobs": (
        -1,
        True,
        None,
        False,
        "top logprobs per prompt token; -1: the whole vocabulary",
    ),
    "thinking_token_budget": (0, True, None, False, "tokens allowed before the thinking ends"),
    "stream_interval": (1, True, None, False, "output tokens per streamed chunk"),
}
LOGIT_BIAS_LIMIT = 100.0
# Other names accepted for SGLang's fields: vLLM's, and SGLang's own `sampling_seed`.
_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "sampling_seed": "seed"}

#: The structured-output constraints; at most one may be set on a request.
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag", "choice")


def _range_message(field: str, value: float) -> str | None:
    low, low_inclusive, high, high_inclusive, meaning = _RANGES[field]
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if not (too_low or too_high):
        return None
    left = "unbounded" if low is None else f"{'[' if low_inclusive else '('}{low:g}"
    right = "∞)" if high is None else f"{high:g}{']' if high_inclusive else ')'}"
    return f"must be in {left}, {right} ({meaning}); got {value:g}"


class RepetitionDetection(BaseModel):
    """Stop a generation that loops: the last `ngram_size` tokens repeated `repeats` times in a row
    within the last `window` tokens ends the request with finish reason `repetition`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ngram_size: int = Field(default=8, ge=1)
    repeats: int = Field(default=4, ge=2)
    window: int = Field(default=256, ge=2)

    @model_validator(mode="after")
    def _window_holds_the_repeats(self) -> RepetitionDetection:
        if self.window < self.ngram_size * self.repeats:
            raise ValueError(
                f"window ({self.window}) must be at least ngram_size × repeats "
                f"({self.ngram_size * self.repeats}) or no repetition could ever be seen"
            )
        return self


class SamplingParams(BaseModel):
    """How to sample one completion: SGLang's fields and defaults, plus vLLM's extras.

    Instances are immutable. Build one with `SamplingParams(**fields)` (raises pydantic's
    ValidationError) or `SamplingParams.parse(mapping)` (raises InvalidRequest naming the field).
    `max_tokens` and `min_tokens` are accepted as aliases of `max_new_tokens` and `min_new_tokens`.
    Vocabulary-dependent checks (token ids in range) are separate: `params.check(vocab_size)`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Length and stopping.
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False
    repetition_detection: RepetitionDetection | None = None
    thinking_token_budget: int | None = None

    # The distribution.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    seed: int | None = None
    n: int = 1

    # Structured output (at most one).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    choice: list[str] | None = None
    #: Refuse the constraint unless the grammar alone enforces all of it (no validation and
    #: rollback of completed values); None: the server's default (`--strict-constraints`).
    strict_constraint: bool | None = None

    # Detokenization and streaming.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    #: vLLM's: False returns token ids only (the text stays empty).
    detokenize: bool = True
    #: vLLM's: output tokens per streamed chunk (the first and the last are sent at once);
    #: None: the engine's `stream_interval`.
    stream_interval: int | None = None

    # Log probabilities (vLLM style; the /generate request has SGLang's own fields too).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    #: vLLM's: logprobs in a flat, columnar layout (`GenerateChunk.to_json`)
    #: instead of one small list per token, cheaper for long outputs.
    flat_logprobs: bool = False

    # Free-form parameters for a custom logit processor (SGLang's), and vLLM's name for the
    # same: `extra_args` reach the processor too, under `custom_params`' keys.
    custom_params: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None

    @classmethod
    def parse(cls, data: Mapping[str, Any] | None, field_prefix: str = "") -> SamplingParams:
        """Validate a mapping (a JSON body) into SamplingParams; raises InvalidRequest."""
        try:
            return cls.model_validate(dict(data or {}))
        except ValidationError as error:
            raise InvalidRequest.from_validation_error(error, field_prefix) from None

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        known = set(cls.model_fields) | set(_ALIASES)
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "see the documented fields"
                raise InvalidRequest(str(key), f"unknown sampling parameter; {hint}")
        for alias, name in _ALIASES.items():
            if alias in data:
                if name in data and data[name] != data[alias]:
                    raise InvalidRequest(
                        alias,
                        f"is an alias of {name}; give one of them, not both with different values",
                    )
                data[name] = data.pop(alias)
        return data

    @field_validator(*_RANGES, mode="after")
    @classmethod
    def _in_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.field_name is not None:
            message = _range_message(info.field_name, value)
            if message:
                raise ValueError(message)
        return value

    @field_validator("top_k", mode="after")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError(
                f"must be -1 or 0 (no cap, vLLM's 0) or a positive number of tokens; got {value}"
            )
        return value

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _logit_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        for token, bias in (value or {}).items():
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"bias for token {token} must be in [-100, 100]; got {bias:g} "
                    "(-100 effectively bans the token, 100 effectively forces it)"
                )
            if token < 0:
                raise ValueError(f"token id {token} is negative; token ids start at 0")
        return value

    @field_validator("stop_token_ids", "allowed_token_ids", "logprob_token_ids", mode="after")
    @classmethod
    def _token_ids(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        negative = [t for t in value if t < 0]
        if negative:
            raise ValueError(f"token ids must be >= 0; got {negative[:5]}")
        if info.field_name == "allowed_token_ids" and not value:
            raise ValueError("must not be empty (no token could be sampled); omit it instead")
        return value

    @field_validator("stop", "bad_words", mode="after")
    @classmethod
    def _no_empty_strings(
        cls, value: str | list[str] | None, info: ValidationInfo
    ) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if any(item == "" for item in items):
            raise ValueError(f"{info.field_name} strings must not be empty")
        return value

    @field_validator("stop_regex", mode="after")
    @classmethod
    def _stop_regex_compiles(cls, value: str | list[str] | None) -> str | list[str] | None:
        for pattern in [value] if isinstance(value, str) else value or []:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"{pattern!r} is not a valid regular expression: {error}"
                ) from None
        return value

    @field_validator("json_schema", "structural_tag", mode="after")
    @classmethod
    def _json_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        try:
            json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"must be a JSON-encoded string (json.dumps(...)); {error}") from None
        return value

    @field_validator("regex", mode="after")
    @classmethod
    def _regex_not_empty(cls, value: str | None) -> str | None:
        if value == "":
            raise ValueError("must not be empty; omit it for unconstrained output")
        return value

    @field_validator("choice", mode="after")
    @classmethod
    def _choice(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("must list at least one string; omit it for unconstrained output")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        problems: list[FieldError] = []
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            problems.append(
                FieldError(
                    given[1],
                    f"only one structured-output constraint may be set; got {', '.join(given)}",
                )
            )
        if not self.detokenize:
            needs_text = [n for n in ("stop", "stop_regex", "bad_words") if getattr(self, n)]
            if needs_text:
                problems.append(
                    FieldError(
                        needs_text[0],
                        "needs the output text, but detokenize is false; use stop_token_ids "
                        "or set detokenize to true",
                    )
                )
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            problems.append(
                FieldError(
                    "min_new_tokens",
                    f"must not exceed max_new_tokens ({self.max_new_tokens}); got {self.min_new_tokens}",
                )
            )
        if problems:
            raise InvalidRequest(problems[0].field, problems[0].message, problems)
        return self

    # Derived views (read-only; the fields above stay exactly what the user sent).

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def stop_regexes(self) -> list[str]:
        """`stop_regex` as a list."""
        if isinstance(self.stop_regex, str):
            return [self.stop_regex]
        return list(self.stop_regex or [])

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding: temperature 0 or top_k 1."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str | list[str]] | None:
        """The structured-output constraint as (field name, value), or None."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def processor_params(self) -> dict[str, Any] | None:
        """What a custom logit processor receives for this request: `extra_args` under
        `custom_params` (None when neither is set)."""
        if self.extra_args is None:
            return self.custom_params
        return {**self.extra_args, **(self.custom_params or {})}

    @property
    def keeps_stop_string(self) -> bool:
        """Whether a matched stop string stays in the output (`no_stop_trim` or vLLM's name)."""
        return self.no_stop_trim or self.include_stop_str_in_output

    def check(self, vocab_size: int) -> None:
        """Check the token ids against a vocabulary of `vocab_size` tokens; raises InvalidRequest."""
        fields: dict[str, list[int]] = {
            "stop_token_ids": self.stop_token_ids or [],
            "allowed_token_ids": self.allowed_token_ids or [],
            "logprob_token_ids": self.logprob_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
        }
        for field, ids in fields.items():
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise InvalidRequest(
                    field,
                    f"token ids {outside[:5]} are outside the vocabulary of {vocab_size} tokens "
                    f"(valid ids are 0..{vocab_size - 1})",
                )
        for field in ("logprobs", "prompt_logprobs"):
            count = getattr(self, field)
            if count is not None and count > vocab_size:
                raise InvalidRequest(
                    field,
                    f"must not exceed the vocabulary size {vocab_size} (-1 asks for all of it)",
                )
