"""ForwardBatch: one model step over a mixed batch of extend and decode requests, as plain data.

Every request in a batch *extends* its sequence by some new tokens: a prefill (or a chunk of
one) after a cached prefix of `prefix_len` tokens, or a decode step (one new token). The new
tokens of all requests are concatenated request after request; per-request arrays have one
entry per request in the same order. The scheduler builds it (`ForwardBatch.build`), the runner
consumes it; nothing in it is mutated by the runner except the request-to-token table, whose
row for each request receives the new tokens' slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


# Built per request each step: slots and no frozen-setattr cost (a frozen dataclass of this
# many fields takes several µs to construct; the step builds one per running request).
@dataclass(slots=True)
class BatchEntry:
    """One request's part of a step, as the scheduler knows it.

    `input_ids` are the new tokens (their K/V are computed now), `prefix_len` tokens of the
    request are already in the KV pool (their slots are in `req_to_token[req_pool_index]`),
    and `out_slots` are the pool slots the new tokens' K/V go to.
    `input_logprob_targets`, when given, asks for prompt log-probabilities: position
    `input_logprob_start + i` of this chunk is scored against token `input_logprob_targets[i]`
    (the token that follows it in the prompt).
    """

    req_pool_index: int
    input_ids: Sequence[int]
    prefix_len: int
    out_slots: Sequence[int]
    input_logprob_start: int = 0
    input_logprob_targets: Sequence[int] | None = None
    top_logprobs_num: int = 0
    token_ids_logprob: Sequence[int] | None = None
    #: [k, hidden] embeddings that replace the id lookup of the first k new tokens (a prompt
    #: given as `input_embeds`; its ids are cache-key pseudo ids, never looked up).
    input_embeds: torch.Tensor | None = None
    #: (row among the new tokens, [k, hidden]) pairs: k rows from that row on take these
    #: embeddings (an image's or a video's; their ids are cache-key pseudo ids).
    media_embeds: tuple[tuple[int, torch.Tensor], ...] = ()
    #: [3, new tokens] three-axis positions of the new tokens (M-RoPE models); None: the
    #: ordinary positions on every axis.
    mrope_positions: torch.Tensor | None = None
    #: Return the final hidden states of this request's new tokens.
    return_hidden_states: bool = False
    #: The slot of the request's LoRA adapter in the runner's pool (-1: none).
    lora_slot: int = -1
    #: Logits wanted after this many of the last new tokens (more than 1: the rows that
    #: verify draft tokens, speculative decoding).
    num_logits: int = 1
    #: An encoder's token types of the new tokens (a text pair's second segment is 1).
    token_type_ids: Sequence[int] | None = None


@dataclass(frozen=True)
class InputLogprobRequest:
    """Which positions of which requests get prompt log-probabilities, and against what."""

    batch_index: int
    start: int
    targets: tuple[int, ...]
    top_logprobs_num: int = 0
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ForwardBatch:
    """Device tensors for the model plus host copies of the lengths (no device sync needed).

    Shapes: T = total new tokens, B = requests.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 — position of each new token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64 — KV pool slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64 — row of each request in req_to_token
    prefix_lens: torch.Tensor  # [B] int64 — tokens already cached
    extend_lens: torch.Tensor  # [B] int64 — new tokens (1 for a decode)
    seq_lens: torch.Tensor  # [B] int64 — prefix_lens + extend_lens
    req_to_token: torch.Tensor  # [rows, max_context] int32 — the shared slot table
    prefix_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]
    req_pool_indices_cpu: tuple[int, ...]
    input_logprobs: tuple[InputLogprobRequest, ...] = ()
    #: Given embeddings [E, hidden] and the rows of the new tokens they stand for [E].
    input_embeds: torch.Tensor | None = None
    input_embeds_rows: torch.Tensor | None = None
    #: Batch indices of the requests whose new tokens' hidden states are returned.
    hidden_state_requests: tuple[int, ...] = ()
    #: [3, T] three-axis positions (M-RoPE) when an entry has them, else None.
    mrope_positions: torch.Tensor | None = None
    #: Per request, the last new tokens whose logits are wanted (None: 1 each, the last).
    logit_counts: tuple[int, ...] | None = None
    #: [T] token types (encoders; None: all 0).
    token_type_ids: torch.Tensor | None = None

    def logit_rows(self) -> torch.Tensor | None:
        """The rows of the new tokens whose logits are wanted, in order (None: each request's
        last row)."""
        if self.logit_counts is None:
            return None
        rows: list[int] = []
        end = 0
        for length, count in zip(self.extend_lens_cpu, self.logit_counts, strict=True):
            end += length
            rows.extend(range(end - count, end))
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    @property
    def model_positions(self) -> torch.Tensor:
        """What the model's rotary embedding takes: the M-RoPE positions when there are any."""
        return self.positions if self.mrope_positions is None else self.mrope_positions

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens_cpu(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu, strict=True))

    @property
    def is_decode(self) -> bool:
        """Every request adds exactly one token (a pure decode step)."""
        return all(e == 1 for e in self.extend_lens_cpu)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def build(
        cls,
        entries: Sequence[BatchEntry],
        req_to_token: torch.Tensor,
        device: torch.device | str | None = None,
    ) -> ForwardBatch:
        """Assemble a batch from per-request entries (host lists -> one transfer per array)."""
        if not entries:
            raise ValueError("a forward batch needs at least one request")
        device = torch.device(device) if device is not None else req_to_token.device
        if all(
            len(e.input_ids) == 1
            and len(e.out_slots) == 1
            and e.input_logprob_targets is None
            and e.input_embeds is None
            and not e.media_embeds
            and e.mrope_positions is None
            and not e.return_hidden_states
            and e.num_logits == 1
            for e in entries
        ):
            return cls._decode(entries, req_to_token, device)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logprob_requests: list[InputLogprobRequest] = []
        embeds: list[torch.Tensor] = []
        embeds_rows: list[int] = []
        for index, entry in enumerate(entries):
            count = len(entry.input_ids)
            if count == 0:
                raise ValueError(f"request {index} has no new tokens")
            if len(entry.out_slots) != count:
                raise ValueError(
                    f"request {index}: {len(entry.out_slots)} output slots for {count} new tokens"
                )
            offset = len(input_ids)
            input_ids.extend(entry.input_ids)
            if entry.input_embeds is not None and len(entry.input_embeds):
                given = len(entry.input_embeds)
                if given > count:
                    raise ValueError(f"request {index}: {given} embeddings for {count} new tokens")
                embeds.append(entry.input_embeds)
                embeds_rows.extend(range(offset, offset + given))
                # Their ids are pseudo ids (outside the vocabulary): look up a valid row instead.
                input_ids[offset : offset + given] = [0] * given
            for row, rows in entry.media_embeds:
                given = len(rows)
                if row < 0 or row + given > count:
                    raise ValueError(
                        f"request {index}: media rows [{row}, {row + given}) fall outside its "
                        f"{count} new tokens"
                    )
                embeds.append(rows)
                embeds_rows.extend(range(offset + row, offset + row + given))
                input_ids[offset + row : offset + row + given] = [0] * given
            positions.extend(range(entry.prefix_len, entry.prefix_len + count))
            slots.extend(entry.out_slots)
            if entry.input_logprob_targets is not None:
                targets = tuple(entry.input_logprob_targets)
                if (
                    entry.input_logprob_start < 0
                    or entry.input_logprob_start + len(targets) > count
                ):
                    raise ValueError(
                        f"request {index}: input logprob positions "
                        f"[{entry.input_logprob_start}, {entry.input_logprob_start + len(targets)})"
                        f" fall outside its {count} new tokens"
                    )
                if targets:
                    logprob_requests.append(
                        InputLogprobRequest(
                            batch_index=index,
                            start=entry.input_logprob_start,
                            targets=targets,
                            top_logprobs_num=entry.top_logprobs_num,
                            token_ids=None
                            if entry.token_ids_logprob is None
                            else tuple(entry.token_ids_logprob),
                        )
                    )
        prefix = [e.prefix_len for e in entries]
        extend = [len(e.input_ids) for e in entries]
        counts: tuple[int, ...] | None = None
        if any(e.num_logits != 1 for e in entries):
            counts = tuple(e.num_logits for e in entries)
            for index, (count, length) in enumerate(zip(counts, extend, strict=True)):
                if not 1 <= count <= length:
                    raise ValueError(
                        f"request {index}: logits after {count} of its {length} new tokens"
                    )
        mrope: torch.Tensor | None = None
        if any(e.mrope_positions is not None for e in entries):
            parts = []
            for entry, start, count in zip(entries, prefix, extend, strict=True):
                if entry.mrope_positions is not None:
                    parts.append(entry.mrope_positions.to(torch.int64))
                else:
                    parts.append(torch.arange(start, start + count).expand(3, count))
            mrope = torch.cat(parts, dim=1).to(device, non_blocking=True)

        def tensor(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        types: torch.Tensor | None = None
        if any(e.token_type_ids is not None for e in entries):
            types = tensor(
                [t for e in entries for t in (e.token_type_ids or [0] * len(e.input_ids))]
            )

        return cls(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            out_cache_loc=tensor(slots),
            req_pool_indices=tensor([e.req_pool_index for e in entries]),
            prefix_lens=tensor(prefix),
            extend_lens=tensor(extend),
            seq_lens=tensor([p + e for p, e in zip(prefix, extend, strict=True)]),
            req_to_token=req_to_token,
            prefix_lens_cpu=tuple(prefix),
            extend_lens_cpu=tuple(extend),
            req_pool_indices_cpu=tuple(e.req_pool_index for e in entries),
            input_logprobs=tuple(logprob_requests),
            input_embeds=torch.cat(embeds).to(device, non_blocking=True) if embeds else None,
            input_embeds_rows=tensor(embeds_rows) if embeds else None,
            hidden_state_requests=tuple(i for i, e in enumerate(entries) if e.return_hidden_states),
            mrope_positions=mrope,
            logit_counts=counts,
            token_type_ids=types,
        )

    @classmethod
    def _decode(
        cls, entries: Sequence[BatchEntry], req_to_token: torch.Tensor, device: torch.device
    ) -> ForwardBatch:
        """A batch in which every request adds one plain token: its arrays in one host
        tensor (one transfer), the per-request ones as views of it."""
        size = len(entries)
        prefix = tuple(e.prefix_len for e in entries)
        rows = tuple(e.req_pool_index for e in entries)
        values = [e.input_ids[0] for e in entries]
        values += prefix  # positions (and the prefix lengths)
        values += [e.out_slots[0] for e in entries]
        values += rows
        values += [1] * size  # extend lengths
        values += [p + 1 for p in prefix]  # sequence lengths
        packed = torch.tensor(values, dtype=torch.int64)
        if packed.device != device:
            packed = packed.to(device, non_blocking=True)
        ids, positions, slots, indices, extend, seq_lens = packed.view(6, size)
        return cls(
            input_ids=ids,
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices=indices,
            prefix_lens=positions,
            extend_lens=extend,
            seq_lens=seq_lens,
            req_to_token=req_to_token,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=(1,) * size,
            req_pool_indices_cpu=rows,
        )

    def write_req_to_token(self) -> None:
        """Record the new tokens' slots in the request-to-token table (mutates that table)."""
        if self.num_tokens == self.batch_size:  # one new token per request (a decode step)
            slots = self.out_cache_loc.to(self.req_to_token.dtype)
            self.req_to_token[self.req_pool_indices, self.prefix_lens] = slots
            return
        rows = torch.repeat_interleave(
            self.req_pool_indices, self.extend_lens, output_size=self.num_tokens
        )
        starts = torch.repeat_interleave(
            self.prefix_lens, self.extend_lens, output_size=self.num_tokens
        )
        offsets = torch.arange(self.num_tokens, device=self.device) - torch.repeat_interleave(
            torch.cumsum(self.extend_lens, 0) - self.extend_lens,
            self.extend_lens,
            output_size=self.num_tokens,
        )
        self.req_to_token[rows, starts + offsets] = self.out_cache_loc.to(self.req_to_token.dtype)
