"""ModelExecutor: runs a scheduled step on the ModelRunner and returns plain per-entry results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch
from radixlm.runtime.logprobs import TokenLogprob
from radixlm.runtime.model_runner import LogitsOutput, ModelRunner
from radixlm.runtime.multimodal.encoder_cache import EncoderCache
from radixlm.runtime.multimodal.inputs import MultimodalInputs
from radixlm.runtime.routed_experts import RoutedExpertsStore
from radixlm.runtime.sampling_batch import SamplingBatch, SamplingRequest
from radixlm.runtime.scheduler import ScheduledBatch
from radixlm.runtime.speculative.draft_model import DraftModelDrafter
from radixlm.runtime.speculative.eagle import EagleDrafter
from radixlm.runtime.speculative.verify import verify

if TYPE_CHECKING:
    from radixlm.runtime.tensor_parallel import StepSender

#: A request-table write: (row, first token index, slots).
RowWrite = tuple[int, int, Sequence[int]]


@dataclass(frozen=True)
class ForwardStep:
    """What every rank needs to run one forward: plain data (slot indices, token ids), sent
    from rank 0 to the other ranks under tensor parallelism."""

    writes: list[RowWrite]
    entries: list[BatchEntry]
    #: With LoRA: the (uid, directory) each adapter slot holds (see `AdapterSlots`).
    adapter_table: tuple[tuple[str, str] | None, ...] | None = None


def run_forward(runner: ModelRunner, step: ForwardStep) -> LogitsOutput:
    """Write the step's request-table rows and run its forward on this rank's runner."""
    table = runner.req_to_token_pool
    for row, start, slots in step.writes:
        table.write(row, start, slots)
    lora = runner.lora
    if lora is None:
        return runner.forward(ForwardBatch.build(step.entries, table.req_to_token))
    if step.adapter_table is not None:
        lora.sync(step.adapter_table)
    lora.set_batch([(len(e.input_ids), e.lora_slot) for e in step.entries])
    try:
        return runner.forward(ForwardBatch.build(step.entries, table.req_to_token))
    finally:
        lora.clear_batch()


@dataclass(frozen=True)
class StepResult:
    """Per entry of the step: the sampled token (None where the entry does not sample), its
    logprobs (None unless asked), and prompt logprobs (None unless asked)."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None]
    input_logprobs: list[list[TokenLogprob] | None]
    #: Per entry: the final hidden states [new tokens, hidden] (float32, CPU) when it asked.
    hidden_states: list[torch.Tensor | None] | None = None
    #: A step with draft tokens: per entry, how many of its drafts were accepted (they come
    #: before its token), and their logprobs when it asked (None: a step without drafts).
    accepted: list[int] | None = None
    draft_logprobs: list[list[TokenLogprob] | None] | None = None


@dataclass(frozen=True)
class InputLogprobAsk:
    """Prompt-logprob options of one entry: top alternatives and requested token ids."""

    top: int = 0
    token_ids: Sequence[int] | None = None


@dataclass(frozen=True)
class EntryInputs:
    """What an entry's sequence brings besides token ids: its prompt as embeddings
    ([prompt_len, hidden], for the prompt positions among its new tokens), whether its
    hidden states are returned, and its images and videos."""

    prompt_embeds: torch.Tensor | None = None
    return_hidden_states: bool = False
    multimodal: MultimodalInputs | None = None
    #: An encoder's token types of the prompt (a text pair's second segment is 1).
    token_type_ids: tuple[int, ...] | None = None


_NO_ASK = InputLogprobAsk()
_NO_INPUTS = EntryInputs()


class ModelExecutor:
    """Turns a `ScheduledBatch` into a `ForwardBatch`, runs it, samples the entries that
    sample. The only engine module that touches tensors."""

    def __init__(
        self,
        runner: ModelRunner,
        seed: int = 0,
        sender: StepSender | None = None,
        encoder_cache_size: int = 128,
        routed_store: RoutedExpertsStore | None = None,
        draft: DraftModelDrafter | EagleDrafter | None = None,
    ) -> None:
        self.runner = runner
        #: A STANDALONE draft model's or an EAGLE head's drafter: it follows every step's
        #: K/V (and features) on rank 0 alone.
        self.draft = draft
        #: The experts each KV slot's token was routed to (`enable_return_routed_experts`).
        self.routed_store = routed_store
        #: Vision-encoder outputs by image hash. The encoder runs here, on rank 0 alone: under
        #: tensor parallelism the other ranks receive the embeddings with the step.
        self.encoder_cache = EncoderCache(encoder_cache_size)
        #: Under tensor parallelism (rank 0): sends each step to the other ranks.
        self.sender = sender
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        #: The last step's sampling batch: the next step reuses its per-request tensors when
        #: it samples the same requests.
        self._last_sampling: SamplingBatch | None = None

    def run(
        self,
        batch: ScheduledBatch,
        sampling: Sequence[SamplingRequest | Sequence[SamplingRequest] | None],
        input_asks: Sequence[InputLogprobAsk | None],
        bitmask: torch.Tensor | None = None,
        inputs: Sequence[EntryInputs | None] | None = None,
    ) -> StepResult:
        """Compute the step. `sampling[i]` describes entry i when it samples (None otherwise;
        an entry with draft tokens gives one per verify row, its drafts before the row counted
        as output); `bitmask` has one row per sampling row, in order; `inputs[i]` (optional) gives
        entry i's prompt embeddings and hidden-state ask. Mutates the KV pool and the
        request table."""
        runner = self.runner
        writes: list[RowWrite] = []
        entries: list[BatchEntry] = []
        extras = inputs if inputs is not None else [None] * len(batch.entries)
        for entry, ask, extra in zip(batch.entries, input_asks, extras, strict=True):
            if entry.row_write is not None:
                start, slots = entry.row_write
                writes.append((entry.row, start, slots))
            if ask is None and extra is None:  # a plain token entry (most of a decode step)
                entries.append(
                    BatchEntry(
                        entry.row,
                        entry.input_ids,
                        entry.prefix_len,
                        entry.out_slots,
                        entry.logprob_start,
                        entry.logprob_targets,
                        lora_slot=entry.lora_slot,
                        num_logits=1 if entry.draft is None else len(entry.draft) + 1,
                    )
                )
                continue
            ask = ask or _NO_ASK
            extra = extra or _NO_INPUTS
            embeds = extra.prompt_embeds
            if embeds is not None:
                # The new tokens that are prompt positions take the given embeddings.
                start = entry.prefix_len
                end = min(start + len(entry.input_ids), embeds.shape[0])
                embeds = embeds[start:end] if end > start else None
            media: tuple[tuple[int, torch.Tensor], ...] = ()
            mrope: torch.Tensor | None = None
            if extra.multimodal is not None:
                media = self._media_embeds(extra.multimodal, entry.prefix_len, len(entry.input_ids))
                mrope = _mrope_positions(extra.multimodal, entry.prefix_len, len(entry.input_ids))
            entries.append(
                BatchEntry(
                    req_pool_index=entry.row,
                    input_ids=entry.input_ids,
                    prefix_len=entry.prefix_len,
                    out_slots=entry.out_slots,
                    input_logprob_start=entry.logprob_start,
                    input_logprob_targets=entry.logprob_targets,
                    top_logprobs_num=ask.top,
                    token_ids_logprob=ask.token_ids,
                    input_embeds=embeds,
                    media_embeds=media,
                    mrope_positions=mrope,
                    return_hidden_states=extra.return_hidden_states,
                    lora_slot=entry.lora_slot,
                    num_logits=1 if entry.draft is None else len(entry.draft) + 1,
                    token_type_ids=None
                    if extra.token_type_ids is None
                    else extra.token_type_ids[
                        entry.prefix_len : entry.prefix_len + len(entry.input_ids)
                    ],
                )
            )
        step = ForwardStep(writes, entries, batch.adapter_table)
        if self.sender is not None:
            # Under tensor parallelism every other rank runs the same step on its shard.
            with self.sender.lock:
                self.sender.send(step)
                out = run_forward(runner, step)
        else:
            out = run_forward(runner, step)
        if self.draft is not None:
            self.draft.follow(batch, out.captured)
        if self.routed_store is not None:
            ids = runner.model.model.routed.take()
            if ids is not None:
                slots = [slot for entry in entries for slot in entry.out_slots]
                self.routed_store.write(slots, ids)
        if any(entry.draft for entry in batch.entries):
            return self._verify(batch, out, sampling, bitmask)
        rows = [i for i, s in enumerate(sampling) if s is not None]
        tokens: list[int | None] = [None] * len(entries)
        logprobs: list[TokenLogprob | None] = [None] * len(entries)
        if rows:
            logits = out.next_token_logits
            if len(rows) != len(entries):
                logits = logits[torch.tensor(rows, device=logits.device)]
            requests = [s for s in sampling if isinstance(s, SamplingRequest)]
            sampling_batch = SamplingBatch.build(
                requests,
                runner.vocab_size,
                runner.device,
                grammar_bitmask=bitmask,
                generator=self.generator,
                previous=self._last_sampling,
            )
            self._last_sampling = sampling_batch
            sampled = runner.sample(logits, sampling_batch)
            if len(rows) == len(entries):
                tokens = list(sampled.token_ids)
                if sampled.logprobs is not None:
                    logprobs = list(sampled.logprobs)
            else:
                for k, row in enumerate(rows):
                    tokens[row] = sampled.token_ids[k]
                    if sampled.logprobs is not None:
                        logprobs[row] = sampled.logprobs[k]
        input_logprobs = out.input_logprobs or [None] * len(entries)
        return StepResult(tokens, logprobs, list(input_logprobs), out.hidden_states)

    def _verify(
        self,
        batch: ScheduledBatch,
        out: LogitsOutput,
        sampling: Sequence[SamplingRequest | Sequence[SamplingRequest] | None],
        bitmask: torch.Tensor | None,
    ) -> StepResult:
        """A step with draft tokens (speculative decoding): every sampling entry's rows are
        verified together (an entry without drafts has one row: a plain draw)."""
        runner = self.runner
        size = len(batch.entries)
        logits = out.next_token_logits
        keep: list[int] = []  # logits rows of the entries that sample
        requests: list[SamplingRequest] = []
        drafts: list[list[int]] = []
        at = 0
        for entry, asked in zip(batch.entries, sampling, strict=True):
            count = 1 if entry.draft is None else len(entry.draft) + 1
            if asked is not None:
                keep.extend(range(at, at + count))
                rows = [asked] if isinstance(asked, SamplingRequest) else list(asked)
                if len(rows) != count:
                    raise ValueError(f"{len(rows)} sampling rows for {count} rows of logits")
                requests.extend(rows)
                drafts.append(entry.draft or [])
            at += count
        tokens: list[int | None] = [None] * size
        logprobs: list[TokenLogprob | None] = [None] * size
        accepted = [0] * size
        draft_logprobs: list[list[TokenLogprob] | None] = [None] * size
        if requests:
            if len(keep) != logits.shape[0]:
                logits = logits.index_select(0, torch.tensor(keep, device=logits.device))
            sampling_batch = SamplingBatch.build(
                requests,
                runner.vocab_size,
                runner.device,
                grammar_bitmask=bitmask,
                generator=self.generator,
            )
            self._last_sampling = None
            with torch.inference_mode():
                found = verify(
                    runner.sampler,
                    logits,
                    sampling_batch,
                    drafts,
                    self.generator,
                    exact=runner.config.deterministic,
                )
            sampled = [i for i, s in enumerate(sampling) if s is not None]
            for k, index in enumerate(sampled):
                tokens[index] = found.tokens[k]
                accepted[index] = found.accepted[k]
                scored = found.logprobs[k]
                if scored is not None:
                    logprobs[index] = scored[-1]
                    draft_logprobs[index] = scored[:-1]
        input_logprobs = out.input_logprobs or [None] * size
        return StepResult(
            tokens,
            logprobs,
            list(input_logprobs),
            out.hidden_states,
            accepted=accepted,
            draft_logprobs=draft_logprobs,
        )

    def _media_embeds(
        self, inputs: MultimodalInputs, start: int, count: int
    ) -> tuple[tuple[int, torch.Tensor], ...]:
        """(row, embeddings) of the media positions among new tokens [start, start + count)."""
        spans = inputs.spans(start, count)
        if not spans:
            return ()
        model = self.runner.model
        encode = getattr(model, "encode_media", None)
        if encode is None:
            raise RuntimeError(f"{type(model).__name__} does not encode images")
        with torch.inference_mode():
            found = self.encoder_cache.embeddings([span.item for span in spans], encode)
        return tuple(
            (span.row, rows[span.first : span.first + span.count])
            for span, rows in zip(spans, found, strict=True)
        )


def _mrope_positions(inputs: MultimodalInputs, start: int, count: int) -> torch.Tensor | None:
    """[3, count] M-RoPE positions of new tokens [start, start + count): the prompt's own, then
    (generated tokens) the position plus the prompt's delta on every axis."""
    prompt = inputs.mrope_positions
    if prompt is None:
        return None
    length = prompt.shape[1]
    inside = prompt[:, start : min(start + count, length)]
    first_after = max(start, length)
    after = torch.arange(first_after, start + count, dtype=torch.int64) + inputs.mrope_delta
    return torch.cat([inside.to(torch.int64), after.expand(3, -1)], dim=1)
