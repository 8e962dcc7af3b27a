"""The attention-backend interface every backend satisfies, and the per-layer attention spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radixlm.runtime.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    """What a backend needs to know about one attention layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    #: A query at position p sees keys at positions (p - sliding_window, p]; None: all of them.
    sliding_window: int | None = None


class AttentionBackend(Protocol):
    """Stores new K/V into the KV pool and attends over each request's cached + new tokens.

    Life cycle per step: `prepare(batch)` once (builds index/mask metadata; no model state),
    then `forward(q, k, v, layer)` once per layer, in layer order. The metadata from `prepare`
    is valid until the next `prepare`.
    """

    name: str
    #: Whether decode steps through this backend can be captured into CUDA graphs.
    supports_cuda_graph: bool

    def prepare(self, batch: ForwardBatch) -> None:
        """Build the metadata of this step (mutates only the backend's own state)."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer
    ) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] -> output [T, heads * D].

        Writes k and v into the pool at the batch's `out_cache_loc` (mutates the pool).
        """
        ...


class GraphableAttentionBackend(AttentionBackend, Protocol):
    """A backend whose decode step can be captured once and replayed (CUDA graphs).

    `init_graph_state(max_batch_size)` allocates static metadata buffers;
    `prepare_graph_capture(batch)` points the metadata at those buffers for a batch built from
    static input tensors; `prepare_graph_replay(batch)` refreshes the buffers in place from a
    (padded) live batch without reallocating anything.
    """

    def init_graph_state(self, max_batch_size: int) -> None: ...

    def prepare_graph_capture(self, batch: ForwardBatch) -> None: ...

    def prepare_graph_replay(self, batch: ForwardBatch) -> None: ...
