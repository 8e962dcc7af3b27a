"""Request preparation on the caller's side: validation, tokenization, grammar compile futures.

Everything that can be wrong with a request is found here, before it reaches the engine loop,
and raised as `InvalidRequest` naming the field. The loop only ever sees well-formed requests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from radixlm.runtime.grammar import GrammarService
from radixlm.runtime.output import LogprobOptions, RequestHandle, SequenceState, Sink
from radixlm.runtime.scheduler import Req
from radixlm.runtime.thinking import THINK_END, ThinkingBudget, end_of_thinking_token
from radixlm.runtime.tokenizer import SequenceOutput, TextDecoder
from radixlm.sampling import (
    CustomLogitProcessor,
    GenerateRequest,
    InvalidRequest,
    SamplingDefaults,
    SamplingParams,
)

T = TypeVar("T")


def _one(value: T | list[Any] | None, kind: type[T]) -> T | None:
    """The value of a single (split) request's per-item field."""
    if isinstance(value, list):
        raise InvalidRequest("request", "a single request takes one value per field; split() it")
    return value


@dataclass(frozen=True)
class FrontendLimits:
    """What the loaded model and engine accept."""

    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    custom_logit_processors: bool
    prefix_sharing: bool  # n > 1 siblings wait for the first prefill (only with the cache)


class RequestPreparer:
    """Turns one single `GenerateRequest` into a `RequestHandle` with its sequences."""

    def __init__(
        self,
        tokenizer: Any,
        defaults: SamplingDefaults,
        grammar: GrammarService,
        limits: FrontendLimits,
        incremental_streaming: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.grammar = grammar
        self.limits = limits
        self.incremental_streaming = incremental_streaming

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def prepare(self, item: GenerateRequest, sink: Sink) -> RequestHandle:
        """Validate and tokenize; start compiling the grammar. Raises InvalidRequest."""
        self._refuse_unsupported(item)
        prompt_ids = self._prompt_ids(item)
        params = self.defaults.apply(item.sampling_params)  # type: ignore[arg-type]
        params.check(self.limits.vocab_size)
        thinking_end = self._thinking_end(params)
        custom = _one(item.custom_logit_processor, str)
        if custom:
            self._check_custom(custom)
        logprobs = self._logprob_options(item, params, len(prompt_ids))
        future = self.grammar.submit(params)
        room = self.limits.context_length - len(prompt_ids)
        max_new = room if params.max_new_tokens is None else min(params.max_new_tokens, room)
        rid = _one(item.rid, str) or uuid.uuid4().hex
        handle = RequestHandle(
            rid=rid,
            params=params,
            prompt_ids=prompt_ids,
            sink=sink,
            stream=item.stream,
            incremental=self.incremental_streaming,
            logprobs=logprobs,
            custom_logit_processor=custom,
        )
        decoder = TextDecoder(
            self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        bad_words = self._bad_words(params)
        first: Req | None = None
        for index in range(params.n):
            req = Req(
                rid if params.n == 1 else f"{rid}#{index}",
                prompt_ids,
                max_new,
                input_logprob_start=logprobs.input_start,
                wait_for=first if self.limits.prefix_sharing else None,
            )
            output = SequenceOutput(
                params, decoder, self.limits.eos_token_ids, max_new, output_ids=req.output_ids
            )
            seed = None if params.seed is None else params.seed + index
            seq = SequenceState(
                handle,
                index,
                req,
                output,
                decoder,
                seed=seed,
                grammar_future=future,
                bad_words_ids=bad_words,
                thinking=None
                if thinking_end is None or params.thinking_token_budget is None
                else ThinkingBudget(thinking_end, params.thinking_token_budget),
            )
            req.payload = seq
            seq.record_input_logprobs([])  # the first prompt token's entry has no logprob
            req.grammar_pending = req.rewindable = future is not None
            handle.seqs.append(seq)
            first = first or req
        return handle

    @staticmethod
    def _refuse_unsupported(item: GenerateRequest) -> None:
        refused = {
            "input_embeds": "input embeddings are not supported; send text or input_ids",
            "image_data": "this engine serves text-only models; remove image_data",
            "audio_data": "this engine serves text-only models; remove audio_data",
            "lora_path": "LoRA adapters are not supported by this engine; remove lora_path",
        }
        for field, message in refused.items():
            if getattr(item, field) is not None:
                raise InvalidRequest(field, message)
        if item.return_hidden_states:
            raise InvalidRequest("return_hidden_states", "hidden states are not returned")

    def _prompt_ids(self, item: GenerateRequest) -> list[int]:
        if item.text is not None:
            field = "text"
            ids = self.encode(str(item.text))
        else:
            field = "input_ids"
            ids = [int(t) for t in item.input_ids or []]  # type: ignore[arg-type]
            outside = [t for t in ids if t >= self.limits.vocab_size]
            if outside:
                raise InvalidRequest(
                    field,
                    f"token ids {outside[:5]} are outside the vocabulary of "
                    f"{self.limits.vocab_size} tokens",
                )
        if not ids:
            raise InvalidRequest(field, "the prompt is empty (it encodes to no tokens)")
        limit = self.limits.context_length
        if len(ids) >= limit:
            raise InvalidRequest(
                field,
                f"the prompt has {len(ids)} tokens but the context holds {limit}, including at "
                "least one generated token; shorten the prompt",
            )
        return ids

    def _thinking_end(self, params: SamplingParams) -> int | None:
        """The token that ends the thinking, when the request sets a thinking_token_budget."""
        if params.thinking_token_budget is None:
            return None
        if params.constraint is not None:
            raise InvalidRequest(
                "thinking_token_budget",
                "cannot be combined with a structured-output constraint (the grammar would "
                "also shape the thinking); remove one of them",
            )
        end = end_of_thinking_token(self.tokenizer)
        if end is None or end >= self.limits.vocab_size:
            raise InvalidRequest(
                "thinking_token_budget",
                f"is not enforced for this model: its tokenizer has no single {THINK_END!r} "
                "token to end the thinking with; remove it",
            )
        return end

    def _check_custom(self, custom: str) -> None:
        if not self.limits.custom_logit_processors:
            raise InvalidRequest(
                "custom_logit_processor",
                "custom logit processors are disabled on this engine; start it with "
                "enable_custom_logit_processor=True to allow them",
            )
        try:
            CustomLogitProcessor.from_str(custom)
        except ValueError as error:
            raise InvalidRequest("custom_logit_processor", str(error)) from None

    @staticmethod
    def _logprob_options(
        item: GenerateRequest, params: SamplingParams, prompt_len: int
    ) -> LogprobOptions:
        enabled = bool(_one(item.return_logprob, bool)) or params.logprobs is not None
        enabled = enabled or params.prompt_logprobs is not None
        top = max(_one(item.top_logprobs_num, int) or 0, params.logprobs or 0)
        ids = item.token_ids_logprob or params.logprob_token_ids
        start: int | None = None
        start_len = _one(item.logprob_start_len, int)
        start_len = -1 if start_len is None else start_len
        if _one(item.return_logprob, bool) and start_len >= 0:
            start = min(start_len, prompt_len - 1)
        if params.prompt_logprobs is not None:
            start = 0
            top = max(top, params.prompt_logprobs)
        if top > 0 and not enabled:
            enabled = bool(_one(item.return_logprob, bool))
        return LogprobOptions(
            enabled=enabled,
            top=top if enabled else 0,
            token_ids=tuple(ids) if enabled and ids else None,  # type: ignore[arg-type]
            input_start=start if enabled else None,
            with_text=bool(_one(item.return_text_in_logprobs, bool)),
        )

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        found: list[tuple[int, ...]] = []
        for word in params.bad_words or []:
            for variant in (word, " " + word):
                ids = tuple(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in found:
                    found.append(ids)
        return tuple(found)
