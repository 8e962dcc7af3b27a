"""API speculative execution: fewer API calls for programs with several gens in a row.

Completion models: one call generates ahead (at least `num_api_spec_tokens`, no stop strings);
the gens that follow take their values from that text, cut at their stop strings, while the
program's constant text matches it. A gen the text does not cover makes a real call.

Chat models: an assistant turn's text and gens are held back; when the turn ends one call
produces the whole turn, which is matched against the turn's template to fill the variables
(retried up to `max_tries` times when it does not fit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from radixlm.lang.backends.base import Completion, GenerateCall
from radixlm.sampling import SamplingParams

Generate = Callable[[GenerateCall], Completion]


class SpeculationMismatch(RuntimeError):
    """A chat model's speculative answer never fit the template of the assistant turn."""


def _first_text(completion: Completion) -> str:
    text = completion.text
    return text[0] if isinstance(text, list) else text


def _earliest(text: str, needles: list[str], start: int = 0) -> tuple[int, str | None]:
    found, which = -1, None
    for needle in needles:
        at = text.find(needle, start)
        if at != -1 and (found == -1 or at < found):
            found, which = at, needle
    return found, which


def _ahead(params: SamplingParams, num_tokens: int) -> SamplingParams:
    """`params` without stop strings, generating `num_tokens` (at least the gen's own budget)."""
    values = params.model_dump(exclude_unset=True)
    values["max_new_tokens"] = max(params.max_new_tokens or 0, num_tokens)
    values.pop("stop", None)
    values.pop("stop_regex", None)
    return SamplingParams.parse(values)


def speculable(call: GenerateCall) -> bool:
    """Whether a gen can take its value from speculated text: it has stop strings and asks for
    nothing a cut of plain text cannot give (constraints, dtypes, logprobs, n > 1)."""
    params = call.params
    return bool(
        params.stop_strings
        and params.constraint is None
        and call.dtype is None
        and params.n == 1
        and not call.logprobs.return_logprob
    )


class CompletionSpeculation:
    """The generated-ahead text of one program state on a completion model."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.buffer = ""

    def gen(self, call: GenerateCall, generate: Generate) -> Completion:
        """The gen's value: cut from the buffer (refilled by one call when empty), or a real
        call when the gen cannot be speculated or the buffer holds none of its stop strings."""
        if not speculable(call):
            self.buffer = ""
            return generate(call)
        fresh, ahead = None, call
        if not self.buffer:
            ahead = replace(call, params=_ahead(call.params, self.num_tokens))
            fresh = generate(ahead)
            self.buffer = _first_text(fresh)
        at, stop = _earliest(self.buffer, call.params.stop_strings)
        if at == -1:
            self.buffer = ""
            if fresh is not None and ahead.params.max_new_tokens == call.params.max_new_tokens:
                return fresh  # the same call as the gen's own, minus stop strings it never hit
            return generate(call)
        value, self.buffer = self.buffer[:at], self.buffer[at:]
        return Completion(
            value, {"speculative": True, "finish_reason": {"type": "stop", "matched": stop}}
        )

    def consume(self, text: str) -> None:
        """The program added `text`: keep the buffer only if it predicted exactly that."""
        self.buffer = self.buffer[len(text) :] if self.buffer.startswith(text) else ""


@dataclass(frozen=True)
class TurnPart:
    """A piece of a held-back assistant turn: constant text, or a gen (text None)."""

    text: str | None = None  # constant text, or None for a gen
    name: str | None = None
    stops: tuple[str, ...] = ()


class ChatSpeculation:
    """The held-back assistant turn of one program state on a chat model."""

    def __init__(self, num_tokens: int, max_tries: int = 3) -> None:
        self.num_tokens = num_tokens
        self.max_tries = max_tries
        self.collecting = False
        self.parts: list[TurnPart] = []
        self.first_call: GenerateCall | None = None
        self.deferred: set[str] = set()

    def begin(self) -> None:
        self.collecting, self.parts, self.first_call = True, [], None

    def add_text(self, text: str) -> None:
        self.parts.append(TurnPart(text=text))

    def add_gen(self, call: GenerateCall) -> None:
        if self.first_call is None:
            self.first_call = call
        if call.name is not None:
            self.deferred.add(call.name)
        self.parts.append(TurnPart(name=call.name, stops=tuple(call.params.stop_strings)))

    def finish(self, generate: Generate) -> list[tuple[str, TurnPart]]:
        """Run the turn: [(text, part), ...] in order, gens filled in. Ends collecting."""
        self.collecting = False
        parts, first = self.parts, self.first_call
        self.parts, self.first_call = [], None
        try:
            if first is None:
                return [(p.text or "", p) for p in parts]
            turn = first.params.model_dump(exclude_unset=True)
            turn["max_new_tokens"] = self.num_tokens  # the budget of the whole turn
            turn.pop("stop", None)
            turn.pop("stop_regex", None)
            call = replace(first, params=SamplingParams.parse(turn))
            answers = []
            for _ in range(self.max_tries):
                answer = _first_text(generate(call))
                values = match_template(parts, answer)
                if values is not None:
                    return values
                answers.append(answer)
            names = [p.name for p in parts if p.text is None]
            raise SpeculationMismatch(
                f"the chat model's answer did not fit the assistant turn that fills {names} "
                f"after {self.max_tries} tries (last answer: {answers[-1][:200]!r}); describe the "
                "expected format in the prompt, or raise num_api_spec_tokens"
            )
        finally:
            self.deferred.clear()


def match_template(parts: list[TurnPart], answer: str) -> list[tuple[str, TurnPart]] | None:
    """Split `answer` along the constant texts and stop strings of `parts`; None if it does not
    fit. Whitespace before a constant text is forgiven (chat models reformat it)."""
    out: list[tuple[str, TurnPart]] = []
    at = 0
    for i, part in enumerate(parts):
        if part.text is not None:
            if answer.startswith(part.text, at):
                at += len(part.text)
            else:
                skip = len(answer) - len(answer[at:].lstrip())
                if not answer.startswith(part.text.lstrip(), skip):
                    return None
                at = skip + len(part.text.lstrip())
            out.append((part.text, part))
            continue
        end, _ = _earliest(answer, list(part.stops), at)
        following = parts[i + 1] if i + 1 < len(parts) else None
        if end == -1 and following is not None and following.text and following.text.strip():
            end = answer.find(following.text.strip(), at)
        if end == -1:
            if following is not None:
                return None
            end = len(answer)
        out.append((answer[at:end], part))
        at = end
    return out
