"""SamplingBatch: the per-request sampling values of one step, collected into tensors.

The scheduler describes each request with a `SamplingRequest` (its `SamplingParams` plus the
state the sampler needs: prompt and output ids so far, EOS ids, tokenized bad words, logprob
options). `SamplingBatch.build` turns a list of them into tensors once per step; the sampler
then works on whole tensors. Dense `[batch, vocab]` tensors are only built for the features
some request in the batch uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, step) — splitmix64, 24 bits.

    24 bits so the value is exact in float32 and never rounds up to 1.0.
    """
    x = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 40) / float(1 << 24)


# Built per sampling request each step: slots, not frozen (see forward_batch.BatchEntry).
@dataclass(slots=True)
class SamplingRequest:
    """One request's sampling inputs at this step (plain data the scheduler owns).

    `output_ids` are the tokens generated so far (their count is the step used for the seed
    and for `min_new_tokens`). `bad_words_ids` are the request's `bad_words` tokenized by the
    engine. `seed` overrides `params.seed` (the engine derives one per completion when n > 1).
    `forced_token_id`: the one token this step may produce (the end of thinking once a
    `thinking_token_budget` is spent); it overrides every other mask.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()
    bad_words_ids: Sequence[Sequence[int]] = ()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: Sequence[int] | None = None
    custom_logit_processor: str | None = None
    seed: int | None = None
    forced_token_id: int | None = None

    @property
    def effective_seed(self) -> int | None:
        return self.seed if self.seed is not None else self.params.seed


@dataclass
class CustomProcessorGroup:
    """Rows of the batch that use the same custom logit processor."""

    processor: str
    rows: list[int]
    params: list[dict[str, Any] | None]


@dataclass
class SamplingBatch:
    """Tensors for one sampling step; rows follow the order of the requests."""

    size: int
    vocab_size: int
    device: torch.device
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    temperatures: torch.Tensor  # [B] float32 (1.0 on greedy rows)
    top_ks: torch.Tensor  # [B] int64, 0 = off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    needs_filter: bool
    uniforms: torch.Tensor  # [B] float32 in [0, 1)
    repetition_penalties: torch.Tensor | None = None  # [B]
    repetition_mask: torch.Tensor | None = None  # [B, V] bool: token in prompt or output
    frequency_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] float32
    logit_bias: torch.Tensor | None = None  # [B, V] float32
    banned: torch.Tensor | None = None  # [B, V] bool
    allowed: torch.Tensor | None = None  # [B, V] bool
    grammar_bitmask: torch.Tensor | None = None  # [B, words] int32
    forced_rows: torch.Tensor | None = None  # [F] int64: rows that must produce one token
    forced_ids: torch.Tensor | None = None  # [F] int64: that token
    return_logprob: bool = False
    #: Some row is greedy (its argmax is wanted; True where a caller does not say).
    any_greedy: bool = True
    logprob_rows: list[bool] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    token_ids_logprob: list[Sequence[int] | None] = field(default_factory=list)
    custom_processors: list[CustomProcessorGroup] = field(default_factory=list)

    #: What depends only on the requests (not on their progress), kept for the next step.
    static: _Static | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        requests: Sequence[SamplingRequest],
        vocab_size: int,
        device: torch.device | str = "cpu",
        grammar_bitmask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        previous: SamplingBatch | None = None,
    ) -> SamplingBatch:
        """Collect the requests' values into tensors on `device`.

        `grammar_bitmask` is `[B, ceil(vocab / 32)]` int32 in xgrammar's layout (all bits set on
        rows without a grammar). Unseeded rows draw their uniform from `generator` (or torch's
        default generator; a CPU generator); seeded rows from (seed, number of output tokens) alone, so they get
        the same token whatever else is in the batch. `previous`: the last step's batch; when
        it was built from the very same request objects in the same order (a decode step of
        an unchanged batch), its per-request tensors are reused and only what depends on the
        requests' progress (uniforms of seeded rows, penalties, bans) is built again.
        """
        device = torch.device(device)
        static = previous.static if previous is not None else None
        if static is None or not static.fits(requests, vocab_size, device):
            static = _Static.build(requests, vocab_size, device)
        size = len(requests)
        if static.all_greedy:
            uniforms = static.no_draws  # an all-greedy batch draws nothing
        else:
            uniforms = torch.rand(size, generator=generator)
            if static.seeded:
                rows = [row for row, _ in static.seeded]
                values = [seeded_uniform(s, len(requests[r].output_ids)) for r, s in static.seeded]
                uniforms[rows] = torch.tensor(values, dtype=torch.float32)
        batch = cls(
            size=size,
            vocab_size=vocab_size,
            device=device,
            greedy=static.greedy,
            all_greedy=static.all_greedy,
            any_greedy=static.any_greedy,
            temperatures=static.temperatures,
            top_ks=static.top_ks,
            top_ps=static.top_ps,
            min_ps=static.min_ps,
            needs_filter=static.needs_filter,
            uniforms=uniforms if device.type == "cpu" else uniforms.to(device),
            logit_bias=static.logit_bias,
            allowed=static.allowed,
            grammar_bitmask=None if grammar_bitmask is None else grammar_bitmask.to(device),
            return_logprob=static.return_logprob,
            logprob_rows=static.logprob_rows,
            top_logprobs_nums=static.top_logprobs_nums,
            token_ids_logprob=static.token_ids_logprob,
            custom_processors=static.custom_processors,
            static=static,
        )
        if static.penalised:
            batch._build_penalties(requests)
        if static.may_ban or static.may_force:
            batch._build_bans(requests)
        return batch

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.size, self.vocab_size, dtype=dtype, device=self.device)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _build_penalties(self, requests: Sequence[SamplingRequest]) -> None:
        params = [r.params for r in requests]
        vocab = self.vocab_size
        if any(p.repetition_penalty != 1.0 for p in params):
            rows: list[int] = []
            cols: list[int] = []
            for row, request in enumerate(requests):
                if request.params.repetition_penalty != 1.0:
                    seen = {t for t in (*request.prompt_ids, *request.output_ids) if 0 <= t < vocab}
                    rows.extend([row] * len(seen))
                    cols.extend(seen)
            mask = self._dense(torch.bool)
            mask[self._index(rows), self._index(cols)] = True
            self.repetition_mask = mask
            self.repetition_penalties = torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=self.device
            )
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            rows, cols = [], []
            for row, request in enumerate(requests):
                p = request.params
                if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                    ids = [t for t in request.output_ids if 0 <= t < vocab]
                    rows.extend([row] * len(ids))
                    cols.extend(ids)
            counts = self._dense(torch.float32)
            ones = torch.ones(len(rows), dtype=torch.float32, device=self.device)
            counts.index_put_((self._index(rows), self._index(cols)), ones, accumulate=True)
            self.output_counts = counts
            self.frequency_penalties = torch.tensor(
                [p.frequency_penalty for p in params], dtype=torch.float32, device=self.device
            )
            self.presence_penalties = torch.tensor(
                [p.presence_penalty for p in params], dtype=torch.float32, device=self.device
            )

    def _build_bans(self, requests: Sequence[SamplingRequest]) -> None:
        """The masks that change as requests progress: forced tokens, the stop and EOS ids
        banned before `min_new_tokens`, bad words that the next token would complete."""
        vocab = self.vocab_size
        forced = [
            (row, r.forced_token_id)
            for row, r in enumerate(requests)
            if r.forced_token_id is not None and 0 <= r.forced_token_id < vocab
        ]
        if forced:
            self.forced_rows = self._index([row for row, _ in forced])
            self.forced_ids = self._index([token for _, token in forced])
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for row, request in enumerate(requests):
            p = request.params
            banned: set[int] = set()
            if len(request.output_ids) < p.min_new_tokens:
                banned.update(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned.update(request.eos_token_ids)
            if request.bad_words_ids:
                banned.update(_bad_word_completions(request))
            banned = {t for t in banned if 0 <= t < vocab}
            ban_rows.extend([row] * len(banned))
            ban_cols.extend(banned)
        if ban_rows:
            mask = self._dense(torch.bool)
            mask[self._index(ban_rows), self._index(ban_cols)] = True
            self.banned = mask


@dataclass
class _Static:
    """The part of a SamplingBatch that depends only on its requests' settings, built once
    for a run of steps over the same request objects."""

    requests: tuple[SamplingRequest, ...]
    vocab_size: int
    device: torch.device
    greedy: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    needs_filter: bool
    seeded: list[tuple[int, int]]  # (row, seed) of the rows with a seed
    no_draws: torch.Tensor  # [B] zeros: the uniforms of an all-greedy batch
    penalised: bool  # some row has a repetition, frequency or presence penalty
    may_ban: bool  # some row has min_new_tokens or bad words
    may_force: bool  # some row has a forced token
    logit_bias: torch.Tensor | None
    allowed: torch.Tensor | None
    return_logprob: bool
    logprob_rows: list[bool]
    top_logprobs_nums: list[int]
    token_ids_logprob: list[Sequence[int] | None]
    custom_processors: list[CustomProcessorGroup]

    def fits(
        self, requests: Sequence[SamplingRequest], vocab_size: int, device: torch.device
    ) -> bool:
        """Whether these are the same request objects, in the same order, for the same vocab."""
        mine = self.requests
        return (
            len(mine) == len(requests)
            and vocab_size == self.vocab_size
            and device == self.device
            and all(a is b for a, b in zip(mine, requests, strict=True))
        )

    @classmethod
    def build(
        cls, requests: Sequence[SamplingRequest], vocab_size: int, device: torch.device
    ) -> _Static:
        params = [r.params for r in requests]
        greedy = [p.is_greedy for p in params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [0 if p.top_k < 0 or p.top_k >= vocab_size else p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        needs_filter = any(
            not g and (k > 0 or tp < 1.0 or mp > 0.0)
            for g, k, tp, mp in zip(greedy, top_ks, top_ps, min_ps, strict=True)
        )
        seeded = [
            (row, seed) for row, r in enumerate(requests) if (seed := r.effective_seed) is not None
        ]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_values: list[float] = []
        allow_rows: list[int] = []
        allow_cols: list[int] = []
        restricted: list[int] = []
        groups: dict[str, CustomProcessorGroup] = {}
        for row, request in enumerate(requests):
            p = request.params
            for token, bias in (p.logit_bias or {}).items():
                if 0 <= int(token) < vocab_size:
                    bias_rows.append(row)
                    bias_cols.append(int(token))
                    bias_values.append(float(bias))
            if p.allowed_token_ids is not None:
                restricted.append(row)
                ids = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
                allow_rows.extend([row] * len(ids))
                allow_cols.extend(ids)
            name = request.custom_logit_processor
            if name:
                group = groups.setdefault(name, CustomProcessorGroup(name, [], []))
                group.rows.append(row)
                group.params.append(p.processor_params)
        size = len(requests)
        logit_bias = allowed = None
        if bias_rows:
            logit_bias = torch.zeros(size, vocab_size, dtype=torch.float32, device=device)
            logit_bias[index(bias_rows), index(bias_cols)] = floats(bias_values)
        if restricted:
            allowed = torch.zeros(size, vocab_size, dtype=torch.bool, device=device)
            unrestricted = sorted(set(range(size)) - set(restricted))
            if unrestricted:
                allowed[index(unrestricted)] = True
            allowed[index(allow_rows), index(allow_cols)] = True
        return cls(
            requests=tuple(requests),
            vocab_size=vocab_size,
            device=device,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            temperatures=floats(temperatures),
            top_ks=index(top_ks),
            top_ps=floats(top_ps),
            min_ps=floats(min_ps),
            needs_filter=needs_filter,
            seeded=seeded,
            no_draws=torch.zeros(size, dtype=torch.float32, device=device),
            penalised=any(
                p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0
                for p in params
            ),
            may_ban=any(
                p.min_new_tokens > 0 or r.bad_words_ids
                for p, r in zip(params, requests, strict=True)
            ),
            may_force=any(r.forced_token_id is not None for r in requests),
            logit_bias=logit_bias,
            allowed=allowed,
            return_logprob=any(r.return_logprob for r in requests),
            logprob_rows=[r.return_logprob for r in requests],
            top_logprobs_nums=[r.top_logprobs_num for r in requests],
            token_ids_logprob=[r.token_ids_logprob for r in requests],
            custom_processors=list(groups.values()),
        )


def _bad_word_completions(request: SamplingRequest) -> set[int]:
    """Tokens that would complete one of the request's bad-word sequences right now.

    A one-token sequence is always banned; a longer one bans its last token when the context
    (prompt + output) ends with the sequence's other tokens.
    """
    banned: set[int] = set()
    context: list[int] | None = None
    for sequence in request.bad_words_ids:
        if not sequence:
            continue
        head = list(sequence[:-1])
        if not head:
            banned.add(sequence[-1])
            continue
        if context is None:
            longest = max(len(s) for s in request.bad_words_ids)
            tail = list(request.output_ids[-longest:])
            if len(tail) < longest:
                tail = list(request.prompt_ids[-(longest - len(tail)) :]) + tail
            context = tail
        if len(context) >= len(head) and context[len(context) - len(head) :] == head:
            banned.add(sequence[-1])
    return banned
