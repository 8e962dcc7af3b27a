"""STANDALONE drafts: a smaller model (or a quantized copy of the target) proposes its greedy
continuation, one batched draft forward per draft position.

The draft model keeps K/V of its own for the same sequences, in a pool indexed by the
target's slot ids (SGLang's layout): a slot's draft K/V belongs to the token whose target K/V
is in that slot, so the radix cache serves both, and the request table is the target's.

- Every target forward writes slots: their draft K/V is stale from then on (`follow`). Prefill
  chunks of requests that speculate are run through the draft model in the same step, so
  their draft K/V is current; what is missing when a request drafts (decodes of steps
  without drafts, a prefix another request computed) is computed then, in one extend.
- Drafting writes the draft K/V of the request's last token and of its drafts but the last
  into scratch slots past the target's ones (the target has not allocated their slots yet);
  once the step has verified them (`accepted`), the K/V of the kept ones is copied into
  their real slots before anything else runs.

Proposals are the draft's argmax: a single proposed token per position, which `verify`
accepts with the target's probability of it, so sampled outputs keep the target's
distribution at any temperature.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from radixlm.runtime.config import (
    AttentionConfig,
    EngineConfig,
    LoraConfig,
    ParallelConfig,
    RunnerConfig,
    SamplerConfig,
)
from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch
from radixlm.runtime.loader import ModelInfo, load_model
from radixlm.runtime.model_runner import ModelRunner, kv_cache_dtype
from radixlm.runtime.models import DecoderForCausalLM
from radixlm.runtime.speculative.costs import DraftCosts, StepCost, measure_step_cost

if TYPE_CHECKING:
    from radixlm.runtime.scheduler import Req, ScheduledBatch

logger = logging.getLogger("radixlm.runtime.speculative")


class DraftModel:
    """A STANDALONE draft model, loaded before the target's runner so that the target's KV
    pool leaves room for the draft's K/V of the same slots."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative
        assert spec.draft_model_path is not None, "STANDALONE has a draft model path"
        target = config.runner
        model = dataclasses.replace(
            target.model,
            model_path=spec.draft_model_path,
            quantization=spec.draft_model_quantization,
            revision=None,
            context_length=None,
        )
        self.config = RunnerConfig(
            model=model,
            memory=target.memory,
            # Draft steps change shape with every depth: no CUDA graphs of them.
            attention=AttentionConfig(backend=target.attention.backend, cuda_graph=False),
            sampler=SamplerConfig(),
            parallel=ParallelConfig(),
            lora=LoraConfig(),
        )
        self.model: DecoderForCausalLM
        self.info: ModelInfo
        self.model, self.info = load_model(model)

    def kv_bytes_per_token(self) -> int:
        """What the draft's K/V of one token takes (its pool mirrors the target's slots)."""
        arch = self.info.arch
        dtype = kv_cache_dtype(self.config.memory.kv_cache_dtype, self.info.dtype)
        return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype.itemsize

    def drafter(
        self,
        target: ModelRunner,
        max_draft: int,
        disable_by_batch_size: int | None,
        step_tokens: int | None,
        target_cost: StepCost | None,
    ) -> DraftModelDrafter:
        """The drafter over a runner of the draft model whose pool mirrors `target`'s slots
        (and has scratch room for every running request's drafts) over `target`'s table.
        With `target_cost` (measured), the draft's own cost is measured too; without, a
        draft step costs its weights' share of the target's."""
        page = target.kv_pool.page_size
        scratch = target.req_to_token_pool.max_requests * max_draft
        scratch += -scratch % page
        runner = ModelRunner(
            self.config,
            self.model,
            self.info,
            kv_slots=target.kv_pool.num_slots + scratch,
            req_to_token_pool=target.req_to_token_pool,
        )
        if self.info.arch.vocab_size != target.vocab_size:
            logger.warning(
                "the draft model's vocabulary has %d tokens, the target's %d: drafts past the "
                "target's are never proposed; the two should share a tokenizer",
                self.info.arch.vocab_size,
                target.vocab_size,
            )
        if target_cost is None:
            # Unmeasured: reading the weights dominates both steps.
            target_cost = StepCost.assumed()
            own = target_cost.scaled(runner.weight_bytes / max(target.weight_bytes, 1))
        else:
            own = measure_step_cost(runner, target_cost.points[-1][0])
        logger.info(
            "STANDALONE draft %s: a draft step of one row costs %.2f of the target's",
            self.config.model.model_path,
            own.seconds(1) / target_cost.seconds(1),
        )
        return DraftModelDrafter(
            runner,
            target.kv_pool.num_slots,
            target.vocab_size,
            max_draft,
            disable_by_batch_size,
            step_tokens,
            DraftCosts(target_cost, own, step_tokens),
        )


class DraftModelDrafter:
    """Drafts from a draft model's runner whose pool holds the target's `target_slots` slots
    and scratch slots after them, over the target's request table."""

    def __init__(
        self,
        runner: ModelRunner,
        target_slots: int,
        target_vocab_size: int,
        max_draft: int,
        disable_by_batch_size: int | None = None,
        step_tokens: int | None = None,
        costs: DraftCosts | None = None,
    ) -> None:
        pool = runner.kv_pool
        if pool.num_slots < target_slots + max_draft:
            raise ValueError(
                f"the draft pool holds {pool.num_slots} slots: not the target's {target_slots} "
                f"and scratch room for {max_draft} drafts"
            )
        self.runner = runner
        self.max_draft = max_draft
        self.disable_by_batch_size = disable_by_batch_size
        self.step_tokens = step_tokens
        #: The target's and the draft model's step costs (unmeasured: the same).
        self.costs = costs or DraftCosts(StepCost.assumed(), StepCost.assumed(), step_tokens)
        #: A request missing the draft's K/V of more than this many of its tokens (outside a
        #: prefill: it decoded without drafts) drafts no more.
        self.max_catch_up = 8 * max_draft
        self._table = runner.req_to_token_pool
        self._vocab = target_vocab_size
        self._scratch_base = target_slots
        self._scratch_slots = pool.num_slots - target_slots
        #: Per slot: the draft K/V there belongs to the token whose target K/V is there.
        self._valid = torch.zeros(pool.num_slots + 1, dtype=torch.bool)
        #: This step's drafting: each request's scratch slots (its last token's, then its
        #: drafts' but the last).
        self._scratch: dict[Req, list[int]] = {}
        #: Verified K/V to copy from scratch slots into real ones, before the next forward.
        self._copies: list[tuple[int, int]] = []

    def threshold(self, size: int) -> float:
        """See the scheduler's `Drafter`."""
        return self.costs.threshold(size)

    # ------------------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, asks: Sequence[tuple[Req, int]]) -> list[list[int]]:
        """Per (request, count): the draft model's greedy continuation of `count` tokens, in
        `count` batched forwards (the first also computes what draft K/V is missing)."""
        self._flush()
        self._scratch.clear()
        context = self.runner.context_length
        drafts: list[list[int]] = [[] for _ in asks]
        live: list[tuple[int, Req, int]] = []  # (index in asks, request, count)
        room = self._scratch_slots
        for index, (req, count) in enumerate(asks):
            count = min(count, context - req.seq_len)
            if count <= 0 or count > room:
                continue
            if req.kv_len - self._first_missing(req, req.kv_len) > self.max_catch_up:
                # It decoded long without drafts (a full batch): computing the draft's K/V
                # of all that would cost more than its drafts are likely to save.
                continue
            room -= count
            live.append((index, req, count))
        if not live:
            return drafts
        entries: list[BatchEntry] = []
        at = self._scratch_base
        for _index, req, count in live:
            scratch = list(range(at, at + count))
            at += count
            self._scratch[req] = scratch
            entries.append(self._catch_up(req, scratch[0]))
        tokens = self._forward(entries)
        for (index, _req, _count), token in zip(live, tokens, strict=True):
            drafts[index].append(token)
        for depth in range(1, max(count for _i, _r, count in live)):
            live = [item for item in live if item[2] > depth]
            entries = [
                BatchEntry(
                    req.row,  # type: ignore[arg-type]
                    [drafts[index][-1]],
                    req.kv_len + depth,
                    [self._scratch[req][depth]],
                )
                for index, req, _count in live
            ]
            for (index, _req, _count), token in zip(live, self._forward(entries), strict=True):
                drafts[index].append(token)
        return drafts

    def _catch_up(self, req: Req, scratch: int) -> BatchEntry:
        """The entry that computes `req`'s missing draft K/V (into its own slots) and its last
        token's (into `scratch`)."""
        end = req.kv_len
        start = self._first_missing(req, end)
        assert req.row is not None
        if req.row_synced < start:  # the table row must hold the slots the draft attends to
            self._table.write(req.row, req.row_synced, req.kv_slots[req.row_synced : start])
        if start < end:
            self._valid[torch.tensor(req.kv_slots[start:end], dtype=torch.int64)] = True
        req.draft_kv_len = end
        return BatchEntry(
            req.row, req.tokens(start, end + 1), start, [*req.kv_slots[start:end], scratch]
        )

    def _first_missing(self, req: Req, end: int) -> int:
        """The first of `req`'s first `end` positions without current draft K/V (`end`: none)."""
        known = req.draft_kv_len
        if known >= end:
            return end
        stale = ~self._valid[torch.tensor(req.kv_slots[known:end], dtype=torch.int64)]
        found = stale.nonzero()
        return end if found.numel() == 0 else known + int(found[0, 0])

    def _forward(self, entries: list[BatchEntry]) -> list[int]:
        """Run the draft model over `entries`; the argmax after each one's last token."""
        out = self.runner.forward(ForwardBatch.build(entries, self._table.req_to_token))
        logits = out.next_token_logits[:, : self._vocab]
        return logits.argmax(dim=-1).tolist()

    # ------------------------------------------------------------------- after target steps

    def refilled(self, slots: Sequence[int]) -> None:
        """The target's K/V of `slots` came from elsewhere (a hierarchical cache's lower
        tier), not from a forward this drafter followed: their draft K/V is not current."""
        if slots:
            self._valid[torch.tensor(list(slots), dtype=torch.int64)] = False

    def accepted(self, req: Req, slots: Sequence[int]) -> None:
        """`slots` hold `req`'s last token and its accepted drafts: their draft K/V, computed
        while drafting, moves there from the scratch slots (before the next forward)."""
        scratch = self._scratch.pop(req, None)
        if scratch is not None:
            self._copies.extend(zip(scratch, slots, strict=False))

    @torch.inference_mode()
    def follow(self, batch: ScheduledBatch, captured: torch.Tensor | None = None) -> None:
        """After a target forward: the slots it wrote hold new tokens, whose draft K/V is not
        there; the prefill chunks of requests that speculate get theirs now (with whatever
        came before them that was missing)."""
        self._flush()
        written = [slot for entry in batch.entries for slot in entry.out_slots]
        if not written:
            return
        self._valid[torch.tensor(written, dtype=torch.int64)] = False
        fills: list[BatchEntry] = []
        for entry in batch.entries:
            req = entry.req
            if not entry.is_prefill or not req.speculate or req.row is None:
                continue
            end = entry.prefix_len + len(entry.input_ids)
            start = self._first_missing(req, entry.prefix_len)
            if req.row_synced < start:
                self._table.write(req.row, req.row_synced, req.kv_slots[req.row_synced : start])
            fills.append(
                BatchEntry(req.row, req.tokens(start, end), start, req.kv_slots[start:end])
            )
            req.draft_kv_len = end
        if fills:
            self._forward(fills)
            filled = [slot for entry in fills for slot in entry.out_slots]
            self._valid[torch.tensor(filled, dtype=torch.int64)] = True

    def _flush(self) -> None:
        """Copy verified K/V from scratch slots into the slots of the tokens they belong to."""
        if not self._copies:
            return
        source, target = zip(*self._copies, strict=True)
        self._copies.clear()
        pool = self.runner.kv_pool
        src = torch.tensor(source, dtype=torch.int64, device=pool.device)
        dst = torch.tensor(target, dtype=torch.int64, device=pool.device)
        for buffers in (pool.k_buffers, pool.v_buffers):
            for layer in buffers:
                layer[dst] = layer[src]
        self._valid[dst.cpu()] = True
