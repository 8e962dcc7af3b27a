"""What the two OpenAI routes share: request fields to SamplingParams, engine chunks to OpenAI
logprobs, usage and finish reasons, the per-choice bookkeeping of a stream and its SSE events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from radixlm.sampling import GenerateChunk, InvalidRequest, LogprobEntry, SamplingParams
from radixlm.server.errors import APIError, as_api_error
from radixlm.server.openai_models import SamplingFields, StreamOptions
from radixlm.server.streams import DONE_EVENT, EngineStreams, sse

M = TypeVar("M", bound=BaseModel)

# Request fields copied as they are into SamplingParams (when the client sent them).
_DIRECT = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "sampling_seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "stop_regex",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
    "strict_constraint",
    "thinking_token_budget",
    "custom_params",
)
# SamplingParams field -> the OpenAI request field it came from (for error messages).
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# (request field, the SamplingParams constraint it sets): SGLang's and radixlm's own names,
# then vLLM's `structured_outputs` keys and its older `guided_*` fields.
_CONSTRAINTS = (
    ("regex", "regex"),
    ("json_schema", "json_schema"),
    ("ebnf", "ebnf"),
    ("structural_tag", "structural_tag"),
    ("choice", "choice"),
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "ebnf"),
)
_STRUCTURED_OUTPUTS = (
    ("json_", "json", "json_schema"),
    ("regex", "regex", "regex"),
    ("choice", "choice", "choice"),
    ("grammar", "grammar", "ebnf"),
    ("structural_tag", "structural_tag", "structural_tag"),
)
_JSON_FIELDS = ("json_schema", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint as the client sent it: the request field (for errors)
    and the SamplingParams field and value it becomes."""

    param: str
    field: str
    value: Any


def requested_constraints(request: SamplingFields) -> list[Constraint]:
    """Every constraint the request's fields set, in field order (at most one is allowed)."""
    found: list[Constraint] = []

    def add(param: str, target: str, value: Any) -> None:
        if value is not None:
            found.append(
                Constraint(param, target, _json_text(value) if target in _JSON_FIELDS else value)
            )

    for name, target in _CONSTRAINTS:
        add(name, target, getattr(request, name))
    outputs = request.structured_outputs
    if outputs is not None:
        for attribute, key, target in _STRUCTURED_OUTPUTS:
            add(f"structured_outputs.{key}", target, getattr(outputs, attribute))
        if outputs.json_object:
            add("structured_outputs.json_object", "json_schema", {"type": "object"})
    unsupported = [
        ("structured_outputs.whitespace_pattern", outputs.whitespace_pattern if outputs else None),
        ("guided_whitespace_pattern", request.guided_whitespace_pattern),
    ]
    for param, value in unsupported:
        if value is not None:
            raise InvalidRequest(
                param,
                "is not supported per request; JSON whitespace is the server's setting "
                "(--json-whitespace compact|any); omit it",
            )
    if request.guided_decoding_backend is not None:
        raise InvalidRequest(
            "guided_decoding_backend",
            "is not chosen per request; the server's --grammar-backend picks the backend "
            "(auto by default); omit it",
        )
    return found


def param_names(
    request: SamplingFields, max_tokens_name: str = "max_tokens", constraint: str | None = None
) -> dict[str, str]:
    """SamplingParams field -> the request field the client sent it as, for the errors of one
    OpenAI call (the engine's errors name SamplingParams fields). `constraint` names the field
    a route-derived constraint came from (response_format, tool_choice)."""
    names = {**_OPENAI_NAMES, "max_new_tokens": max_tokens_name}
    if request.sampling_seed is not None and request.seed is None:
        names["seed"] = "sampling_seed"
    for found in requested_constraints(request):
        names[found.field] = found.param
    if constraint is not None:
        names["json_schema"] = constraint
    return names


def parse_body(model: type[M], body: Mapping[str, Any]) -> M:
    """Validate a JSON object into `model`; InvalidRequest naming the field otherwise."""
    try:
        return model.model_validate(dict(body))
    except ValidationError as error:
        raise InvalidRequest.from_validation_error(error) from None


def _json_text(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def sampling_params(
    request: SamplingFields,
    max_tokens_name: str = "max_tokens",
    *,
    unset_max_tokens: Any = ...,
    **overrides: Any,
) -> SamplingParams:
    """SamplingParams from the fields the client sent (unsent ones keep the engine's defaults).

    `overrides` are SamplingParams fields the route derived (a constraint, max_new_tokens).
    `unset_max_tokens`, when given, is max_new_tokens for a request that sent no max_tokens
    (None: until the context is full).
    """
    values: dict[str, Any] = {}
    sent = request.model_fields_set
    for name in _DIRECT:
        if name in sent and getattr(request, name) is not None:
            values[name] = getattr(request, name)
    constraints = requested_constraints(request)
    derived = overrides.get("json_schema")
    if len(constraints) + (derived is not None) > 1:
        given = [c.param for c in constraints]
        raise InvalidRequest(
            given[1] if derived is None else given[0],
            f"only one constraint may shape the output; got {', '.join(given)}"
            + ("" if derived is None else " besides the route's own (response_format or tools)"),
        )
    for found in constraints:
        values[found.field] = found.value
    if request.max_tokens is not None:
        values["max_new_tokens"] = request.max_tokens
    if request.min_tokens is not None:
        values["min_new_tokens"] = request.min_tokens
    if request.logit_bias is not None:
        bias: dict[int, float] = {}
        for key, value in request.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequest(
                    "logit_bias", f"keys must be token ids (integers as strings); got {key!r}"
                ) from None
        values["logit_bias"] = bias
    if request.repetition_detection is not None:
        values["repetition_detection"] = request.repetition_detection.model_dump()
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "max_new_tokens" not in values and unset_max_tokens is not ...:
        values["max_new_tokens"] = unset_max_tokens
    try:
        return SamplingParams.parse(values)
    except InvalidRequest as error:
        renamed = param_names(request, max_tokens_name)
        raise InvalidRequest(renamed.get(error.field, error.field), error.message) from None


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` only when `cached` is
    given (the server reports it with `--enable-cache-report`, as SGLang does)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def token_text(entry: LogprobEntry, tokenizer: Any) -> str:
    """The text of a logprob entry (decoded when the engine left it out)."""
    if entry.text is not None:
        return entry.text
    return str(tokenizer.decode([entry.token_id]))


Positions = list[tuple[LogprobEntry, ...] | None]


def new_tokens(chunk: GenerateChunk, output_len: int, sent: int) -> list[LogprobEntry]:
    """The chunk's output logprob entries for tokens not sent yet (cumulative or incremental)."""
    entries = list(chunk.output_token_logprobs or ())
    return entries[sent:] if len(entries) >= output_len else entries


def new_tops(chunk: GenerateChunk, output_len: int, sent: int) -> Positions:
    """The chunk's output top logprobs for tokens not sent yet (cumulative or incremental)."""
    entries: Positions = list(chunk.output_top_logprobs or ())
    return entries[sent:] if len(entries) >= output_len else entries


def completion_logprobs(
    tokens: list[LogprobEntry], tops: Positions, tokenizer: Any, offset: int
) -> dict[str, Any]:
    """OpenAI completions' `logprobs` object for some tokens; `offset` is the first's position."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    out["text_offset"] = []
    for i, entry in enumerate(tokens):
        text = token_text(entry, tokenizer)
        out["tokens"].append(text)
        out["token_logprobs"].append(entry.logprob)
        top = tops[i] if i < len(tops) else None
        out["top_logprobs"].append(
            None if top is None else {token_text(t, tokenizer): t.logprob for t in top}
        )
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_entry(entry: LogprobEntry, tokenizer: Any) -> dict[str, Any]:
    text = token_text(entry, tokenizer)
    return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: list[LogprobEntry], tops: Positions, tokenizer: Any) -> dict[str, Any]:
    """OpenAI chat's `logprobs` object (`{"content": [...]}`) for some tokens."""
    content = []
    for i, entry in enumerate(tokens):
        item = _chat_entry(entry, tokenizer)
        top = tops[i] if i < len(tops) else None
        item["top_logprobs"] = [_chat_entry(t, tokenizer) for t in top or []]
        content.append(item)
    return {"content": content}


@dataclass
class ChoiceProgress:
    """What a stream already sent for one choice."""

    chars: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False
    completion_tokens: int = 0


@dataclass
class StreamUsage:
    """Token counts of a streamed request: prompts once per prompt, completions per choice;
    the cached prompt tokens in its summary when `report_cached`."""

    report_cached: bool = True
    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)

    def update(self, stream: int, choice: int, chunk: GenerateChunk) -> ChoiceProgress:
        self.prompt[stream] = chunk.prompt_tokens
        self.cached[stream] = chunk.cached_tokens
        progress = self.choices.setdefault(choice, ChoiceProgress())
        progress.completion_tokens = chunk.completion_tokens
        return progress

    def summary(self) -> dict[str, Any]:
        completion = sum(p.completion_tokens for p in self.choices.values())
        cached = sum(self.cached.values()) if self.report_cached else None
        return usage(sum(self.prompt.values()), completion, cached)


def now() -> int:
    return int(time.time())


#: The choices to send for one engine chunk: (stream, chunk, usage so far) -> choice dicts.
ChoiceDeltas = Callable[[int, GenerateChunk, StreamUsage], list[dict[str, Any]]]


async def stream_events(
    streams: EngineStreams,
    options: StreamOptions | None,
    chunk: Callable[..., dict[str, Any]],
    choice_deltas: ChoiceDeltas,
    report_cached: bool,
) -> AsyncIterator[str]:
    """The SSE events of a streamed OpenAI call: an event per choice delta (`chunk([choice])`,
    with the usage so far under `continuous_usage_stats`), the usage when `include_usage`
    (with the cached prompt tokens when `report_cached`), an error event if the engine
    fails, then `[DONE]`. Closes `streams` when done."""
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    tally = StreamUsage(report_cached)
    try:
        async for stream, engine_chunk in streams:
            for choice in choice_deltas(stream, engine_chunk, tally):
                stats: Any = tally.summary() if continuous else None
                yield sse(chunk([choice], stats) if include_usage else chunk([choice]))
        if include_usage:
            yield sse(chunk([], tally.summary()))
    except Exception as error:
        yield sse((as_api_error(error) or APIError(500, f"engine error: {error}")).body())
    finally:
        await streams.aclose()
    yield DONE_EVENT
