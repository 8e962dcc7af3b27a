"""torch_native: scaled_dot_product_attention over K/V gathered from the pool (CPU and CUDA).

Decode-like requests (one new token) are attended in one padded SDPA call; requests that add
several tokens are attended one by one (their cost is dominated by the projections anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixlm.runtime.attention.base import AttentionLayer
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory import KVPool


@dataclass
class _Extend:
    token_start: int
    extend_len: int
    prefix_len: int
    slots: torch.Tensor  # [prefix + extend] int64


@dataclass
class _Metadata:
    out_cache_loc: torch.Tensor
    decode_tokens: torch.Tensor | None = None  # [Bd] positions of decode tokens in the batch
    decode_slots: torch.Tensor | None = None  # [Bd, Lmax] slots (padding -> 0)
    decode_lens: torch.Tensor | None = None  # [Bd]
    decode_positions: torch.Tensor | None = None  # [Lmax]
    extends: list[_Extend] = field(default_factory=list)
    masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)


class TorchNativeBackend:
    """SDPA over gathered K/V; works on every device torch supports."""

    name = "torch_native"
    supports_cuda_graph = False

    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool
        self._meta: _Metadata | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        meta = _Metadata(out_cache_loc=batch.out_cache_loc)
        device = batch.device
        table = batch.req_to_token
        rows = batch.req_pool_indices
        rows_cpu = batch.req_pool_indices_cpu
        decode_index: list[int] = []
        token_start = 0
        for index, (prefix, extend) in enumerate(
            zip(batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True)
        ):
            if extend == 1:
                decode_index.append(index)
            else:
                total = prefix + extend
                slots = table[rows_cpu[index], :total].long()
                meta.extends.append(_Extend(token_start, extend, prefix, slots))
            token_start += extend
        if decode_index:
            starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
            chosen = torch.tensor(decode_index, dtype=torch.int64, device=device)
            lens = batch.seq_lens.index_select(0, chosen)
            max_len = max(batch.prefix_lens_cpu[i] + 1 for i in decode_index)
            positions = torch.arange(max_len, device=device)
            slots = table[rows.index_select(0, chosen), :max_len].long()
            meta.decode_tokens = starts.index_select(0, chosen)
            meta.decode_slots = slots.masked_fill(positions[None, :] >= lens[:, None], 0)
            meta.decode_lens = lens
            meta.decode_positions = positions
        self._meta = meta

    def _decode_mask(self, meta: _Metadata, window: int | None) -> torch.Tensor:
        key = ("decode", 0, window)
        mask = meta.masks.get(key)
        if mask is None:
            assert meta.decode_positions is not None and meta.decode_lens is not None
            positions, lens = meta.decode_positions, meta.decode_lens
            mask = positions[None, :] < lens[:, None]
            if window is not None:
                mask &= positions[None, :] >= lens[:, None] - window
            mask = mask[:, None, None, :]
            meta.masks[key] = mask
        return mask

    def _extend_mask(
        self, meta: _Metadata, index: int, item: _Extend, window: int | None
    ) -> torch.Tensor | None:
        if item.prefix_len == 0 and window is None:
            return None  # plain causal: SDPA's is_causal
        key = ("extend", index, window)
        mask = meta.masks.get(key)
        if mask is None:
            device = item.slots.device
            total = item.prefix_len + item.extend_len
            q_pos = torch.arange(item.prefix_len, total, device=device)[:, None]
            k_pos = torch.arange(total, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            meta.masks[key] = mask
        return mask

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("prepare(batch) must run before forward")
        self.kv_pool.store(layer.layer_id, meta.out_cache_loc, k, v)
        k_pool = self.kv_pool.k_buffers[layer.layer_id]
        v_pool = self.kv_pool.v_buffers[layer.layer_id]
        out = torch.empty_like(q)
        window = layer.sliding_window
        gqa = layer.num_heads != layer.num_kv_heads
        if meta.decode_tokens is not None and meta.decode_slots is not None:
            qd = q.index_select(0, meta.decode_tokens)[:, :, None, :]  # [Bd, H, 1, D]
            kd = k_pool[meta.decode_slots].transpose(1, 2).to(q.dtype)  # [Bd, Hkv, L, D]
            vd = v_pool[meta.decode_slots].transpose(1, 2).to(q.dtype)
            od = F.scaled_dot_product_attention(
                qd,
                kd,
                vd,
                attn_mask=self._decode_mask(meta, window),
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            out.index_copy_(0, meta.decode_tokens, od[:, :, 0, :])
        for index, item in enumerate(meta.extends):
            end = item.token_start + item.extend_len
            qe = q[item.token_start : end].transpose(0, 1)[None]  # [1, H, E, D]
            ke = k_pool[item.slots].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, L, D]
            ve = v_pool[item.slots].transpose(0, 1)[None].to(q.dtype)
            mask = self._extend_mask(meta, index, item, window)
            oe = F.scaled_dot_product_attention(
                qe,
                ke,
                ve,
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            out[item.token_start : end] = oe[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)
