"""How `select` turns the model's scores of each choice into one decision.

Each method receives, per choice, the logprob entries of the choice's tokens
(`[logprob, token_id, text]`, SGLang's layout) and their mean (`normalized_prompt_logprobs`),
and returns the decision with the figures it used (they become `get_meta_info(name)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: One scored token: [logprob (None for a sequence's first token), token_id, text or None].
TokenLogprob = Sequence[Any]


@dataclass(frozen=True)
class ChoicesDecision:
    """The chosen string and the scores behind it."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class ChoicesMethod(Protocol):
    """A rule that picks one choice from the model's token logprobs."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Whether the backend must also score each choice alone (no prompt before it)."""
        ...

    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[TokenLogprob]],
        output_token_logprobs: Sequence[Sequence[TokenLogprob]],
        unconditional_token_logprobs: Sequence[Sequence[TokenLogprob]] | None = None,
    ) -> ChoicesDecision: ...


def _values(entries: Sequence[TokenLogprob]) -> list[float]:
    return [float(e[0]) for e in entries if e[0] is not None]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _first_best(scores: Sequence[float]) -> int:
    if not scores:
        raise ValueError("select() needs at least one choice")
    return max(range(len(scores)), key=lambda i: scores[i])


def _base_meta(
    normalized: Sequence[float],
    inputs: Sequence[Sequence[TokenLogprob]],
    outputs: Sequence[Sequence[TokenLogprob]],
) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": list(normalized),
        "input_token_logprobs": [list(x) for x in inputs],
        "output_token_logprobs": [list(x) for x in outputs],
    }


class TokenLengthNormalized:
    """The choice with the highest mean token logprob (the default)."""

    requires_unconditional_logprobs = False

    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[TokenLogprob]],
        output_token_logprobs: Sequence[Sequence[TokenLogprob]],
        unconditional_token_logprobs: Sequence[Sequence[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        best = _first_best(normalized_prompt_logprobs)
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[best], meta)

    def __repr__(self) -> str:
        return "token_length_normalized"


class GreedyTokenSelection:
    """Compare choices token by token: keep those with the best logprob at each position.

    A choice shorter than the longest is padded with its own mean logprob, so a choice that is
    a prefix of another competes on equal terms past its end.
    """

    requires_unconditional_logprobs = False

    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[TokenLogprob]],
        output_token_logprobs: Sequence[Sequence[TokenLogprob]],
        unconditional_token_logprobs: Sequence[Sequence[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        rows = [_values(entries) for entries in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = [r + [_mean(r) if r else -math.inf] * (width - len(r)) for r in rows]
        alive = list(range(len(choices)))
        for column in range(width):
            top = max(matrix[i][column] for i in alive)
            alive = [i for i in alive if matrix[i][column] == top]
            if len(alive) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[alive[0]], meta)

    def __repr__(self) -> str:
        return "greedy_token_selection"


class UnconditionalLikelihoodNormalized:
    """The choice whose tokens gain most from the prompt: mean of (logprob in context - logprob
    of the same token with the choice alone). The first unconditional token has no logprob and
    counts as 0."""

    requires_unconditional_logprobs = True

    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[TokenLogprob]],
        output_token_logprobs: Sequence[Sequence[TokenLogprob]],
        unconditional_token_logprobs: Sequence[Sequence[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError(
                "unconditional_likelihood_normalized needs the choices scored alone; "
                "this backend did not provide them"
            )
        gains: list[float] = []
        for choice, inputs, alone in zip(
            choices, input_token_logprobs, unconditional_token_logprobs, strict=True
        ):
            if len(inputs) != len(alone):
                raise ValueError(
                    f"choice {choice!r} has {len(inputs)} tokens after the prompt but "
                    f"{len(alone)} alone; its tokenization depends on the context"
                )
            gains.append(
                _mean(
                    [
                        float(a[0]) - float(b[0] if b[0] is not None else 0.0)
                        for a, b in zip(inputs, alone, strict=True)
                        if a[0] is not None
                    ]
                )
            )
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = [list(x) for x in unconditional_token_logprobs]
        meta["normalized_unconditional_prompt_logprobs"] = gains
        return ChoicesDecision(choices[_first_best(gains)], meta)

    def __repr__(self) -> str:
        return "unconditional_likelihood_normalized"


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def normalized_logprob(entries: Sequence[TokenLogprob]) -> float:
    """The mean logprob of the entries that have one (0.0 when none has)."""
    return _mean(_values(entries))
