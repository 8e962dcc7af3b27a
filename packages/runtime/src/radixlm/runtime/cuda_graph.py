"""CUDA graphs for decode steps: capture the model once per batch-size bucket, replay after.

Only built on CUDA with a backend that supports it; a CPU runner never imports a CUDA API from
here. A live decode batch of size b replays the smallest captured bucket >= b: its tensors are
copied into the static input buffers and the padding rows point at the pool's padding slot and
the request table's padding row, so they write and read nothing that belongs to a request.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from radixlm.runtime.attention.base import GraphableAttentionBackend
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory import KVPool, ReqToTokenPool
from radixlm.runtime.models import DecoderForCausalLM


def cuda_graphs_usable(device: torch.device, enabled: bool, backend: object) -> bool:
    """Whether decode steps should go through CUDA graphs on this runner."""
    return (
        enabled
        and device.type == "cuda"
        and torch.cuda.is_available()
        and bool(getattr(backend, "supports_cuda_graph", False))
    )


def bucket_for(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `batch_size` rows, or None when none does."""
    position = bisect.bisect_left(buckets, batch_size)
    return buckets[position] if position < len(buckets) else None


class CudaGraphRunner:
    """Captured decode graphs keyed by padded batch size; `replay` returns [b, vocab] logits."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        backend: GraphableAttentionBackend,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        batch_sizes: Sequence[int],
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.buckets = sorted(set(batch_sizes))
        self.max_batch_size = self.buckets[-1]
        device = kv_pool.device
        size = self.max_batch_size
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full(
            (size,), kv_pool.padding_slot, dtype=torch.int64, device=device
        )
        self.req_pool_indices = torch.full(
            (size,), req_pool.padding_row, dtype=torch.int64, device=device
        )
        self.prefix_lens = torch.zeros(size, dtype=torch.int64, device=device)
        self.extend_lens = torch.ones(size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int64, device=device)
        # The padding row reads the padding slot only.
        req_pool.req_to_token[req_pool.padding_row].fill_(kv_pool.padding_slot)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_pool: Any = None
        backend.init_graph_state(size)

    def _static_batch(self, batch_size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:batch_size],
            positions=self.positions[:batch_size],
            out_cache_loc=self.out_cache_loc[:batch_size],
            req_pool_indices=self.req_pool_indices[:batch_size],
            prefix_lens=self.prefix_lens[:batch_size],
            extend_lens=self.extend_lens[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            req_to_token=self.req_pool.req_to_token,
            prefix_lens_cpu=(0,) * batch_size,
            extend_lens_cpu=(1,) * batch_size,
            req_pool_indices_cpu=(self.req_pool.padding_row,) * batch_size,
        )

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller ones reuse its memory pool)."""
        self.memory_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch_size in reversed(self.buckets):
                batch = self._static_batch(batch_size)
                self.backend.prepare_graph_capture(batch)
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    self._run(batch)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.memory_pool, stream=stream):
                    self.outputs[batch_size] = self._run(batch)
                self.graphs[batch_size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode batch that fits a captured bucket and wants no prompt logprobs, no
        hidden states and no given embeddings."""
        return (
            bool(self.graphs)
            and batch.is_decode
            and not batch.input_logprobs
            and not batch.hidden_state_requests
            and batch.input_embeds is None
            and batch.mrope_positions is None
            and batch.batch_size <= self.max_batch_size
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [b, vocab] of a decode batch (its slots must already be in req_to_token)."""
        size = batch.batch_size
        padded = bucket_for(size, self.buckets)
        if padded is None:
            raise ValueError(
                f"decode batch of {size} exceeds the largest graph ({self.max_batch_size})"
            )
        self.input_ids[:size].copy_(batch.input_ids)
        self.positions[:size].copy_(batch.positions)
        self.out_cache_loc[:size].copy_(batch.out_cache_loc)
        self.req_pool_indices[:size].copy_(batch.req_pool_indices)
        self.prefix_lens[:size].copy_(batch.prefix_lens)
        self.seq_lens[:size].copy_(batch.seq_lens)
        if padded > size:
            self.input_ids[size:padded].zero_()
            self.positions[size:padded].zero_()
            self.out_cache_loc[size:padded].fill_(self.kv_pool.padding_slot)
            self.req_pool_indices[size:padded].fill_(self.req_pool.padding_row)
            self.prefix_lens[size:padded].zero_()
            self.seq_lens[size:padded].fill_(1)
        self.backend.prepare_graph_replay(self._static_batch(padded))
        self.graphs[padded].replay()
        return self.outputs[padded][:size]
