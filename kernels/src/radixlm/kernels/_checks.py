"""Argument checks shared by both backends: shapes and dtypes only, never device values."""

from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def rank(op: str, name: str, t: torch.Tensor, dims: int, shape: str) -> None:
    if t.dim() != dims:
        _fail(op, f"{name} must be {shape}, got shape {tuple(t.shape)}")


def floating(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATS:
        _fail(op, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def integer(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _INTS:
        _fail(op, f"{name} must be int32 or int64, got {t.dtype}")


def same_device(op: str, tensors: dict[str, torch.Tensor | None]) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        _fail(op, f"all tensors must be on one device, got {listed}")


def length(op: str, name: str, t: torch.Tensor, n: int, what: str) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        _fail(op, f"{name} must have shape [{what}] = [{n}], got {tuple(t.shape)}")


def attention(
    op: str,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    lens: dict[str, torch.Tensor],
    req_pool_indices: torch.Tensor | None,
    batch: int,
) -> None:
    rank(op, "q", q, 3, "[tokens, num_heads, head_dim]")
    rank(op, "k_pool", k_pool, 3, "[num_slots, num_kv_heads, head_dim]")
    floating(op, "q", q)
    if v_pool.shape != k_pool.shape:
        _fail(op, f"v_pool shape {tuple(v_pool.shape)} != k_pool shape {tuple(k_pool.shape)}")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        _fail(op, f"k_pool/v_pool dtype ({k_pool.dtype}/{v_pool.dtype}) must equal q's {q.dtype}")
    if k_pool.shape[2] != q.shape[2]:
        _fail(op, f"head_dim of q ({q.shape[2]}) and k_pool ({k_pool.shape[2]}) differ")
    if k_pool.shape[1] == 0 or q.shape[1] % k_pool.shape[1] != 0:
        _fail(
            op, f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k_pool.shape[1]})"
        )
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        _fail(op, "k_pool and v_pool need a unit stride on head_dim")
    rank(op, "req_to_token", req_to_token, 2, "[rows, max_context]")
    integer(op, "req_to_token", req_to_token)
    if req_to_token.stride(-1) != 1:
        _fail(op, "req_to_token needs a unit stride on its last dimension")
    for name, t in lens.items():
        integer(op, name, t)
        length(op, name, t, batch, "batch")
    if req_pool_indices is not None:
        integer(op, "req_pool_indices", req_pool_indices)
        length(op, "req_pool_indices", req_pool_indices, batch, "batch")
    elif req_to_token.shape[0] < batch:
        _fail(op, f"req_to_token has {req_to_token.shape[0]} rows for a batch of {batch}")
    tensors: dict[str, torch.Tensor | None] = {"q": q, "k_pool": k_pool, "v_pool": v_pool}
    tensors.update(req_to_token=req_to_token, req_pool_indices=req_pool_indices, **lens)
    same_device(op, tensors)
