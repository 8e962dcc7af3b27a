"""Copies of a prompt's K/V between an engine's KV pool and a flat byte buffer.

The buffer holds `[K|V, layer, token, kv_head, head_dim * itemsize]` bytes: the pool's own
dtype, byte for byte (float8 included), so the decode side's pool holds exactly what the
prefill side's computed. Both copies run on the engine's step thread, between steps (one
gather or scatter per layer and tensor), so they never race a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.runtime.disaggregation.protocol import KVLayout
from radixlm.runtime.memory import KVPool


def pool_layout(pool: KVPool, architecture: str) -> KVLayout:
    """The layout of `pool`'s K/V (what a peer's must equal)."""
    return KVLayout(
        architecture=architecture,
        num_layers=pool.num_layers,
        num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim,
        dtype=str(pool.dtype).removeprefix("torch."),
    )


def _shape(pool: KVPool, num_tokens: int) -> tuple[int, ...]:
    row = pool.head_dim * pool.dtype.itemsize
    return (2, pool.num_layers, num_tokens, pool.num_kv_heads, row)


def kv_nbytes(pool: KVPool, num_tokens: int) -> int:
    """Bytes of the K/V of `num_tokens` tokens."""
    return pool.bytes_per_token * num_tokens


def read_kv(pool: KVPool, slots: Sequence[int], out: torch.Tensor) -> None:
    """Gather the K/V of `slots` (in order) into `out` (uint8, `kv_nbytes` long, on the host)."""
    shape = _shape(pool, len(slots))
    host = out.view(shape)
    # On a GPU the gathers fill one device buffer, copied to the host once.
    target = (
        host
        if pool.device.type == "cpu"
        else torch.empty(shape, dtype=torch.uint8, device=pool.device)
    )
    index = torch.tensor(list(slots), dtype=torch.long, device=pool.device)
    for layer in range(pool.num_layers):
        for kind, buffers in enumerate((pool.k_buffers, pool.v_buffers)):
            torch.index_select(buffers[layer].view(torch.uint8), 0, index, out=target[kind, layer])
    if target is not host:
        host.copy_(target)


def write_kv(pool: KVPool, slots: Sequence[int], data: torch.Tensor) -> None:
    """Scatter K/V bytes read by `read_kv` (from a pool of the same layout) into `slots`."""
    source = data.view(_shape(pool, len(slots))).to(pool.device)
    index = torch.tensor(list(slots), dtype=torch.long, device=pool.device)
    for layer in range(pool.num_layers):
        for kind, buffers in enumerate((pool.k_buffers, pool.v_buffers)):
            buffers[layer].view(torch.uint8)[index] = source[kind, layer]
