"""What an engine streams back for a request: typed, frozen output chunks.

An engine yields `GenerateChunk`s; a server or client reads their attributes, and
`chunk.to_json()` gives SGLang's `/generate` response layout (`text`, `output_ids`, `index`,
`meta_info` with `finish_reason`, token counts and logprob triples) — the one place that
layout is written. `GenerateChunk.from_json` reads it back (a client of an HTTP server).

The types are immutable and made of builtins, so they pickle cheaply between processes.
`GenerateChunk` and `LogprobEntry` are named tuples rather than frozen dataclasses: an engine
makes one per streamed token, and a frozen dataclass takes three times as long to build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

FinishType = Literal["stop", "length", "abort"]

#: One position's alternatives: the top tokens or the requested ids (None where a position
#: has none, e.g. the first prompt token).
LogprobList = tuple["LogprobEntry", ...]


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a sequence ended, in SGLang's shape: `type` stop | length | abort, `matched` the
    stop token id or stop string (None otherwise), `message` a human-readable detail."""

    type: FinishType
    matched: int | str | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            out["message"] = self.message
        return out

    @classmethod
    def from_json(cls, value: Any) -> FinishReason | None:
        """From SGLang's dict (or a bare type string, as some servers send); None stays None."""
        if value is None:
            return None
        if isinstance(value, str):
            return cls(cast(FinishType, value))
        return cls(
            cast(FinishType, str(value.get("type"))), value.get("matched"), value.get("message")
        )


class LogprobEntry(NamedTuple):
    """One token's log-probability: SGLang's `[logprob, token_id, text]` triple (the logprob is
    None for the first prompt token; the text is None unless the request asked for texts)."""

    logprob: float | None
    token_id: int
    text: str | None = None

    def to_json(self) -> list[Any]:
        return [self.logprob, self.token_id, self.text]

    @classmethod
    def from_json(cls, triple: Sequence[Any]) -> LogprobEntry:
        text = triple[2] if len(triple) > 2 else None
        return cls(None if triple[0] is None else float(triple[0]), int(triple[1]), text)


class GenerateChunk(NamedTuple):
    """One output chunk of one sequence of a request.

    `text` and `output_ids` are cumulative (the sequence's output so far) unless the engine
    streams incrementally; a sequence's last chunk has a `finish_reason`. Logprob fields are
    None unless the request asked for them; streamed output logprobs hold only the new
    tokens' entries, with the running count in `output_token_logprobs_length`.
    """

    rid: str
    index: int  # type: ignore[assignment]  # SGLang's name; shadows tuple.index
    text: str
    output_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    e2e_latency: float = 0.0
    output_token_logprobs: tuple[LogprobEntry, ...] | None = None
    output_token_logprobs_length: int | None = None
    output_top_logprobs: tuple[LogprobList, ...] | None = None
    output_token_ids_logprobs: tuple[LogprobList, ...] | None = None
    input_token_logprobs: tuple[LogprobEntry, ...] | None = None
    input_top_logprobs: tuple[LogprobList | None, ...] | None = None
    input_token_ids_logprobs: tuple[LogprobList | None, ...] | None = None
    #: `return_hidden_states`: the prompt's rows first, then one vector per output token.
    hidden_states: tuple[Any, ...] | None = None
    #: The structured-output grammar in use: backend, kind, rollbacks (None without one).
    grammar: Mapping[str, Any] | None = None
    #: Beam search: the length-penalised score and the cumulative logprob.
    score: float | None = None
    cumulative_logprob: float | None = None
    #: vLLM's `flat_logprobs`: `to_json` writes logprobs as columns instead of triples.
    flat_logprobs: bool = False
    #: Other `meta_info` keys an engine reports (kept by `from_json`, written by `to_json`).
    extra: Mapping[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def finish_type(self) -> FinishType | None:
        return None if self.finish_reason is None else self.finish_reason.type

    def with_index(self, index: int) -> GenerateChunk:
        return self._replace(index=index)

    def to_json(self) -> dict[str, Any]:
        """SGLang's `/generate` response object for this chunk."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_json(),
            "e2e_latency": self.e2e_latency,
        }
        if self.grammar is not None:
            meta["grammar"] = dict(self.grammar)
        if self.score is not None:
            meta["score"] = self.score
        if self.cumulative_logprob is not None:
            meta["cumulative_logprob"] = self.cumulative_logprob
        if self.output_token_logprobs is not None or self.input_token_logprobs is not None:
            self._logprobs_json(meta)
        if self.hidden_states is not None:
            meta["hidden_states"] = list(self.hidden_states)
        if self.extra:
            meta.update(self.extra)
        return {
            "index": self.index,
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }

    def _logprobs_json(self, meta: dict[str, Any]) -> None:
        flat = self.flat_logprobs
        for key in _TOKEN_KEYS:
            entries = getattr(self, key)
            if entries is not None:
                meta[key] = _columns(entries) if flat else [list(e) for e in entries]
        if self.output_token_logprobs_length is not None:
            meta["output_token_logprobs_length"] = self.output_token_logprobs_length
        for key in _POSITION_KEYS:
            positions = getattr(self, key)
            if positions is not None:
                meta[key] = (
                    _flat_positions(positions)
                    if flat
                    else [None if p is None else [list(e) for e in p] for p in positions]
                )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GenerateChunk:
        """Read SGLang's `/generate` response object (nested logprob triples)."""
        meta = dict(data.get("meta_info") or {})
        known: dict[str, Any] = {}
        for key in _TOKEN_KEYS:
            rows = meta.pop(key, None)
            if isinstance(rows, list):
                known[key] = tuple(LogprobEntry.from_json(r) for r in rows)
        for key in _POSITION_KEYS:
            positions = meta.pop(key, None)
            if isinstance(positions, list):
                known[key] = tuple(
                    None if p is None else tuple(LogprobEntry.from_json(r) for r in p)
                    for p in positions
                )
        hidden = meta.pop("hidden_states", None)
        output_ids = data.get("output_ids") or ()
        return cls(
            rid=str(meta.pop("id", "")),
            index=int(data.get("index", 0) or 0),
            text=str(data.get("text", "") or ""),
            output_ids=tuple(int(t) for t in output_ids),
            prompt_tokens=int(meta.pop("prompt_tokens", 0) or 0),
            completion_tokens=int(meta.pop("completion_tokens", len(output_ids)) or 0),
            cached_tokens=int(meta.pop("cached_tokens", 0) or 0),
            finish_reason=FinishReason.from_json(meta.pop("finish_reason", None)),
            e2e_latency=float(meta.pop("e2e_latency", 0.0) or 0.0),
            output_token_logprobs_length=meta.pop("output_token_logprobs_length", None),
            hidden_states=None if hidden is None else tuple(hidden),
            grammar=meta.pop("grammar", None),
            score=meta.pop("score", None),
            cumulative_logprob=meta.pop("cumulative_logprob", None),
            extra=meta or None,
            **known,
        )


_TOKEN_KEYS = ("input_token_logprobs", "output_token_logprobs")
_POSITION_KEYS = (
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def _columns(entries: Sequence[LogprobEntry]) -> dict[str, list[Any]]:
    return {
        "logprobs": [e.logprob for e in entries],
        "token_ids": [e.token_id for e in entries],
        "texts": [e.text for e in entries],
    }


def _flat_positions(positions: Sequence[Sequence[LogprobEntry] | None]) -> dict[str, list[Any]]:
    """Every position's entries one after another, with `offsets` (positions + 1 long):
    position i's entries are `offsets[i]:offsets[i + 1]` (empty where it has none)."""
    offsets = [0]
    entries: list[LogprobEntry] = []
    for position in positions:
        entries.extend(position or ())
        offsets.append(len(entries))
    return {**_columns(entries), "offsets": offsets}
