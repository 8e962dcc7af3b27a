"""triton: radixlm-kernels' paged attention over the token-granular KV pool.

On CUDA the kernels run as Triton; on CPU they run in Triton's interpreter when
`TRITON_INTERPRET=1` was set before radixlm.kernels compiled its first kernel (tests), and as
the kernels' torch references otherwise. Decode steps are CUDA-graph safe: the kernels read
every length from device tensors.
"""

from __future__ import annotations

import contextlib

import torch

from radixlm import kernels
from radixlm.runtime.attention.base import AttentionLayer
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory import KVPool


class TritonBackend:
    """Paged decode / extend attention kernels; graphable for decode."""

    name = "triton"
    supports_cuda_graph = True

    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool
        self._batch: ForwardBatch | None = None
        self._decode = False
        self._max_extend_len = 1

    def prepare(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._decode = batch.is_decode
        self._max_extend_len = max(batch.extend_lens_cpu)

    # CUDA graphs: the static batch's tensors are the metadata, so nothing else is allocated.
    def init_graph_state(self, max_batch_size: int) -> None:
        del max_batch_size

    def prepare_graph_capture(self, batch: ForwardBatch) -> None:
        self.prepare(batch)

    def prepare_graph_replay(self, batch: ForwardBatch) -> None:
        self.prepare(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer
    ) -> torch.Tensor:
        batch = self._batch
        if batch is None:
            raise RuntimeError("prepare(batch) must run before forward")
        k_pool = self.kv_pool.k_buffers[layer.layer_id]
        v_pool = self.kv_pool.v_buffers[layer.layer_id]
        force = (
            kernels.use_backend("triton")
            if not q.is_cuda and kernels.interpreter_enabled()
            else contextlib.nullcontext()
        )
        with force:
            kernels.store_kv(k.contiguous(), v.contiguous(), k_pool, v_pool, batch.out_cache_loc)
            if self._decode:
                out = kernels.decode_attention(
                    q,
                    k_pool,
                    v_pool,
                    batch.req_to_token,
                    batch.seq_lens,
                    batch.req_pool_indices,
                    scale=layer.scaling,
                    sliding_window=layer.sliding_window,
                )
            else:
                out = kernels.extend_attention(
                    q,
                    k_pool,
                    v_pool,
                    batch.req_to_token,
                    batch.prefix_lens,
                    batch.extend_lens,
                    batch.req_pool_indices,
                    scale=layer.scaling,
                    sliding_window=layer.sliding_window,
                    max_extend_len=self._max_extend_len,
                )
        return out.reshape(q.shape[0], -1)
