"""The sampler: logits of a batch -> next tokens (and log-probabilities), vectorised over rows.

Order of operations on each row: custom logit processor (when enabled) -> repetition penalty
(prompt + output, HF semantics) -> frequency and presence penalties (output) -> logit_bias ->
bans (min_new_tokens stop ids, bad words) -> allowed_token_ids -> grammar bitmask -> a forced
token (the end of thinking once `thinking_token_budget` is spent) -> greedy
argmax, or temperature -> softmax -> top-k -> top-p (over the top-k survivors) -> min-p ->
inverse-CDF draw with the row's uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels import (
    apply_token_bitmask_inplace,
    greedy_tokens,
    sample_from_probs,
    sample_tokens,
)
from radixlm.kernels.reference import inverse_cdf
from radixlm.runtime.config import SamplerConfig
from radixlm.runtime.logprobs import TokenLogprob, collect_logprobs
from radixlm.runtime.sampling_batch import SamplingBatch
from radixlm.sampling import CustomLogitProcessor


@dataclass(frozen=True)
class SampleOutput:
    """The step's tokens: `next_token_ids` on the device, `token_ids` on the host; `logprobs`
    per row (None on rows that did not ask) when any row asked."""

    next_token_ids: torch.Tensor
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None


class CustomProcessorsDisabled(RuntimeError):
    """A request names a custom logit processor but the runtime does not enable them."""


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition (divide positive / multiply negative logits of seen tokens), then
    frequency and presence penalties over output-token counts. Mutates `logits`."""
    if batch.repetition_mask is not None and batch.repetition_penalties is not None:
        penalty = batch.repetition_penalties[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(batch.repetition_mask, penalised, logits))
    if batch.output_counts is not None:
        assert batch.frequency_penalties is not None and batch.presence_penalties is not None
        counts = batch.output_counts
        logits -= batch.frequency_penalties[:, None] * counts
        logits -= batch.presence_penalties[:, None] * (counts > 0).to(logits.dtype)


def apply_masks(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """logit_bias, banned tokens, allowed tokens, the grammar bitmask, then forced tokens
    (which override all of them). Mutates `logits`."""
    if batch.logit_bias is not None:
        logits += batch.logit_bias
    if batch.banned is not None:
        logits.masked_fill_(batch.banned, float("-inf"))
    if batch.allowed is not None:
        logits.masked_fill_(~batch.allowed, float("-inf"))
    if batch.grammar_bitmask is not None:
        apply_token_bitmask_inplace(logits, batch.grammar_bitmask)
    if batch.forced_rows is not None and batch.forced_ids is not None:
        logits[batch.forced_rows] = float("-inf")
        logits[batch.forced_rows, batch.forced_ids] = 0.0


def _processes(batch: SamplingBatch) -> bool:
    """Whether any processing before temperature applies to the batch."""
    return bool(
        batch.custom_processors
        or batch.repetition_mask is not None
        or batch.output_counts is not None
        or batch.logit_bias is not None
        or batch.banned is not None
        or batch.allowed is not None
        or batch.grammar_bitmask is not None
        or batch.forced_rows is not None
    )


class Sampler:
    """Turns float32 logits [B, V] into next tokens under a SamplingBatch."""

    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config or SamplerConfig()
        self._processors: dict[str, CustomLogitProcessor] = {}

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Everything before temperature, on a copy of the logits (the float32 logits
        themselves when nothing applies: nothing is written to them then)."""
        if not _processes(batch):
            return logits.float()
        logits = logits.float().clone()
        self._apply_custom(logits, batch)
        apply_penalties(logits, batch)
        apply_masks(logits, batch)
        return logits

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Sample one token per row. Does not mutate `logits`."""
        if logits.shape[0] != batch.size:
            raise ValueError(f"{logits.shape[0]} rows of logits for {batch.size} requests")
        raw = logits.float()
        processed = self.process_logits(raw, batch)
        scaled: torch.Tensor | None = None
        if batch.all_greedy:
            next_ids = greedy_tokens(processed)
            scaled = processed
        else:
            # (a batch of sampled rows only takes no argmax: a full pass over its logits)
            greedy_ids = greedy_tokens(processed) if batch.any_greedy else None
            if batch.needs_filter:
                scaled = processed / batch.temperatures[:, None]
                next_ids = self.draw(scaled, batch, greedy_ids)
            else:  # the temperature inside the draw (radixlm's C kernel on the CPU)
                next_ids = sample_tokens(processed, batch.temperatures, batch.uniforms)
                if greedy_ids is not None:
                    next_ids = torch.where(batch.greedy, greedy_ids, next_ids)
        logprobs = None
        if batch.return_logprob:
            if self.config.logprobs_mode == "raw":
                source = raw
            else:
                source = scaled if scaled is not None else processed / batch.temperatures[:, None]
            all_rows = collect_logprobs(
                torch.log_softmax(source, dim=-1),
                next_ids,
                batch.top_logprobs_nums,
                batch.token_ids_logprob,
            )
            logprobs = [
                lp if wanted else None
                for lp, wanted in zip(all_rows, batch.logprob_rows, strict=True)
            ]
        return SampleOutput(next_ids, next_ids.tolist(), logprobs)

    @staticmethod
    def draw(
        scaled: torch.Tensor, batch: SamplingBatch, greedy_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Each row's token from its temperature-scaled logits: its argmax (`greedy_ids`, None
        when no row is greedy) on a greedy row, else a draw with the row's uniform after
        top-k / top-p / min-p."""
        probs = torch.softmax(scaled, dim=-1).nan_to_num_(0.0)
        if batch.needs_filter:
            drawn = sample_from_probs(
                probs, batch.top_ks, batch.top_ps, batch.min_ps, batch.uniforms
            )
        else:
            drawn = inverse_cdf(probs, batch.uniforms)
        if greedy_ids is None:
            return drawn
        return torch.where(batch.greedy, greedy_ids, drawn)

    def _apply_custom(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        if not batch.custom_processors:
            return
        if not self.config.enable_custom_logit_processor:
            raise CustomProcessorsDisabled(
                "a request uses a custom logit processor, but they are disabled; enable them "
                "with SamplerConfig(enable_custom_logit_processor=True)"
            )
        for group in batch.custom_processors:
            processor = self._processors.get(group.processor)
            if processor is None:
                processor = CustomLogitProcessor.from_str(group.processor)()
                self._processors[group.processor] = processor
            rows = torch.tensor(group.rows, dtype=torch.int64, device=logits.device)
            logits[rows] = processor(logits[rows], group.params).to(logits.dtype)
