"""Beam search bookkeeping (torch-free): candidates in, surviving and finished beams out.

`BeamSearch` follows transformers' beam search step by step (its `_beam_search` since the 2025
refactor, the same rules `BeamSearchScorer` applied before): each step keeps the best
`K = max(2, 1 + #eos) * beam_width` continuations of all live beams by cumulative logprob; the
best `beam_width` of those that did not finish live on; those among the first `beam_width` that
finished (EOS, or `max_tokens` generated) join the finished set, scored
`sum_logprobs / generated_len ** length_penalty` (`generated_len` counts the EOS token). The
engine feeds it the top-K logprobs of each live beam; it never touches the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from radixlm.sampling import (
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
    LogprobEntry,
)

EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True)
class BeamSearchParams:
    """What a beam search asks for. `early_stopping`: True stops once `beam_width` beams have
    finished; False stops when the best live beam, scored at its current length, cannot beat
    the worst finished one (transformers' heuristic); "never" scores it at `max_tokens` when
    `length_penalty > 0` (the canonical search)."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise InvalidRequest("beam_width", f"must be at least 1; got {self.beam_width}")
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be at least 1; got {self.max_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequest(
                "early_stopping", f"must be true, false or 'never'; got {self.early_stopping!r}"
            )


@dataclass(frozen=True)
class Beam:
    """A sequence under search: generated tokens, their logprobs and their sum."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    cumulative_logprob: float = 0.0

    def extend(self, token_id: int, logprob: float) -> Beam:
        return Beam(
            (*self.token_ids, token_id),
            (*self.logprobs, logprob),
            self.cumulative_logprob + logprob,
        )


@dataclass(frozen=True)
class FinishedBeam:
    """A result: the beam, its length-penalised score, and why it ended (`stop` at EOS,
    `length` at `max_tokens`)."""

    beam: Beam
    score: float
    finish: Literal["stop", "length"]


class BeamSearch:
    """The state of one beam search. `live` are the beams to extend next (best first);
    `advance` takes each one's top-K next tokens and performs one step; `done` says when to
    stop; `results()` gives the `beam_width` best finished beams, best first."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.live: list[Beam] = [Beam()]
        self.finished: list[FinishedBeam] = []  # best first, at most beam_width
        self._improvable = True
        # One beam is greedy decoding (transformers runs num_beams=1 as greedy search): the
        # first EOS ends it, which is what stopping at the first finished beam does.
        self._early_stopping: EarlyStopping = (
            True if params.beam_width == 1 else params.early_stopping
        )
        self.steps = 0

    @property
    def done(self) -> bool:
        full = len(self.finished) >= self.params.beam_width
        return not self.live or not self._improvable or (full and self._early_stopping is True)

    def advance(self, top: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One step. `top[i]` holds the best (token id, logprob) pairs after `live[i]` — at
        least `self.candidates` of them (or the whole vocabulary). Mutates the search."""
        if len(top) != len(self.live):
            raise ValueError(f"{len(top)} candidate lists for {len(self.live)} live beams")
        width = self.params.beam_width
        length = len(self.live[0].token_ids) + 1  # generated tokens after this step
        pool = sorted(
            (
                (beam.cumulative_logprob + logprob, rank, token, logprob)
                for rank, (beam, pairs) in enumerate(zip(self.live, top, strict=True))
                for token, logprob in pairs
            ),
            key=lambda c: (-c[0], c[1]),
        )[: self.candidates]
        at_limit = length >= self.params.max_tokens
        live: list[Beam] = []
        newly: list[FinishedBeam] = []
        for position, (_, rank, token, logprob) in enumerate(pool):
            beam = self.live[rank].extend(token, logprob)
            stop = token in self.eos_token_ids
            if not (stop or at_limit):
                if len(live) < width:
                    live.append(beam)
            elif position < width:
                # Only the first beam_width candidates may finish; the rest are spares.
                score = beam.cumulative_logprob / (length**self.params.length_penalty)
                newly.append(FinishedBeam(beam, score, "stop" if stop else "length"))
        full = len(self.finished) >= width and self._early_stopping is True
        if newly and self._improvable and not full:
            merged = sorted([*self.finished, *newly], key=lambda f: -f.score)
            self.finished = merged[:width]
        self.live = live
        self.steps += 1
        self._improvable = self._improvable and self._may_improve(length)

    def _may_improve(self, length: int) -> bool:
        """Whether the best live beam may still beat the worst finished one (always, until
        beam_width beams have finished)."""
        if len(self.finished) < self.params.beam_width or not self.live:
            return True
        penalty = self.params.length_penalty
        if self._early_stopping == "never" and penalty > 0.0:
            length = self.params.max_tokens
        best = self.live[0].cumulative_logprob / float(length**penalty)
        return best > self.finished[-1].score

    def results(self) -> list[FinishedBeam]:
        """The best `beam_width` beams, best first: the finished ones, topped up with live
        beams scored at their length when fewer finished (a vocabulary smaller than K)."""
        out = list(self.finished)
        penalty = self.params.length_penalty
        for beam in self.live[: self.params.beam_width - len(out)]:
            score = beam.cumulative_logprob / (max(1, len(beam.token_ids)) ** penalty)
            out.append(FinishedBeam(beam, score, "length"))
        return sorted(out, key=lambda f: -f.score)


# ----------------------------------------------------------------- driving it with requests


def step_request(prompt_ids: Sequence[int], search: BeamSearch) -> GenerateRequest:
    """One engine request per live beam: prefill `prompt + beam` (the radix cache holds all of
    it but the beam's newest token) and return its top-K next-token logprobs."""
    return GenerateRequest.parse(
        {
            "input_ids": [[*prompt_ids, *beam.token_ids] for beam in search.live],
            # One token, greedily: only the logprobs are read, the sampled token is dropped.
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "top_logprobs_num": search.candidates,
        }
    )


def step_candidates(outputs: Sequence[GenerateChunk]) -> list[list[tuple[int, float]]]:
    """Each final chunk's (token id, logprob) alternatives for its one generated position."""
    return [
        [(e.token_id, float(e.logprob or 0.0)) for e in (out.output_top_logprobs or ((),))[0]]
        for out in outputs
    ]


def result_chunks(
    search: BeamSearch,
    rid: str,
    prompt_ids: Sequence[int],
    cached_tokens: int,
    decode: Callable[[Sequence[int]], str],
) -> list[GenerateChunk]:
    """The results as final chunks (best first; `index` is the rank), with `score`
    (length-penalised) and `cumulative_logprob`."""
    out = []
    for index, result in enumerate(search.results()):
        ids = result.beam.token_ids
        stop = result.finish == "stop"
        out.append(
            GenerateChunk(
                rid=rid,
                index=index,
                text=decode(ids[:-1] if stop else ids),
                output_ids=tuple(ids),
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(ids),
                cached_tokens=cached_tokens,
                finish_reason=FinishReason(result.finish, ids[-1] if stop else None),
                score=result.score,
                cumulative_logprob=result.beam.cumulative_logprob,
                output_token_logprobs=tuple(
                    LogprobEntry(lp, tid) for lp, tid in zip(result.beam.logprobs, ids, strict=True)
                ),
            )
        )
    return out
