"""GPTQ and AWQ int4 tensors, unpacked into the layout radixlm's linear layers hold.

Both store eight 4-bit values in each int32, but along different axes and in different orders:

- GPTQ: `qweight` [K / 8, N] packs along the input (value i of a word is input row 8r + i),
  `qzeros` [K / g, N / 8] along the output, `scales` [K / g, N]; its original format stores
  each zero point minus one. `g_idx` [K] maps input rows to groups.
- AWQ ("gemm" layout): `qweight` [K, N / 8] and `qzeros` [K / g, N / 8] both pack along the
  output, value i of a word being column 8c + AWQ_ORDER[i]; `scales` [K / g, N].

The in-memory layout is output-major (`radixlm.kernels.quant`): values [N, K] two per byte,
`scales` and `zeros` [N, K / g]; the dequantized weight is (q - zero) * scale either way.
"""

from __future__ import annotations

import torch

#: The order of the eight 4-bit values in an AWQ word: value i holds column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 holding eight values per word along R -> [8R, C] int32 in 0..15."""
    values = (packed[:, None, :] >> _SHIFTS.to(packed.device)[None, :, None]) & 0xF
    return values.reshape(packed.shape[0] * 8, packed.shape[1])


def unpack_int32_columns(
    packed: torch.Tensor, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """[R, C] int32 holding eight values per word along C -> [R, 8C] int32 in 0..15.

    `order[i]` is the column (within its group of eight) that value i of a word holds; None
    means value i holds column i.
    """
    values = (packed[:, :, None] >> _SHIFTS.to(packed.device)[None, None, :]) & 0xF
    if order is not None:
        inverse = [0] * 8
        for position, column in enumerate(order):
            inverse[column] = position
        values = values[:, :, inverse]
    return values.reshape(packed.shape[0], packed.shape[1] * 8)


def pack_int32_rows(values: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_int32_rows` (for test fixtures that write GPTQ checkpoints)."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows // 8, 8, cols)
    words = (grouped << _SHIFTS.to(torch.int64)[None, :, None]).sum(1)
    return _to_int32(words)


def pack_int32_columns(values: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack_int32_columns` (for test fixtures that write GPTQ/AWQ files)."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows, cols // 8, 8)
    if order is not None:
        grouped = grouped[:, :, list(order)]
    words = (grouped << _SHIFTS.to(torch.int64)[None, None, :]).sum(2)
    return _to_int32(words)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # Wrap the unsigned 32-bit words into int32 (the top nibble sets the sign bit).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, the model expects {shape}"
        )
    if tensor.dtype != dtype:
        raise ValueError(f"{name}: checkpoint tensor is {tensor.dtype}, expected {dtype}")


def gptq_values(qweight: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
    """A GPTQ `qweight` [K / 8, N] -> the 4-bit values [N, K] (uint8)."""
    _expect("qweight", qweight, (in_features // 8, out_features), torch.int32)
    return unpack_int32_rows(qweight).t().to(torch.uint8)


def awq_values(qweight: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
    """An AWQ `qweight` [K, N / 8] -> the 4-bit values [N, K] (uint8)."""
    _expect("qweight", qweight, (in_features, out_features // 8), torch.int32)
    return unpack_int32_columns(qweight, AWQ_ORDER).t().to(torch.uint8)


def int4_zeros(
    qzeros: torch.Tensor, groups: int, out_features: int, awq: bool, offset: int
) -> torch.Tensor:
    """`qzeros` [K / g, N / 8] (GPTQ or AWQ packing) -> zero points [N, K / g] (float32)."""
    _expect("qzeros", qzeros, (groups, out_features // 8), torch.int32)
    values = unpack_int32_columns(qzeros, AWQ_ORDER if awq else None)
    return (values + offset).t().to(torch.float32)


def int4_scales(scales: torch.Tensor, groups: int, out_features: int) -> torch.Tensor:
    """`scales` [K / g, N] -> [N, K / g] (float32)."""
    if tuple(scales.shape) != (groups, out_features):
        raise ValueError(
            f"scales: checkpoint tensor has shape {tuple(scales.shape)}, the model expects "
            f"{(groups, out_features)}"
        )
    return scales.t().to(torch.float32)


def check_trivial_g_idx(g_idx: torch.Tensor, in_features: int, group_size: int) -> None:
    """GPTQ's `g_idx` must map input row k to group k // g: act-order (desc_act) checkpoints,
    whose rows are permuted, are not read."""
    expected = torch.arange(in_features, device=g_idx.device) // group_size
    if tuple(g_idx.shape) != (in_features,) or not torch.equal(g_idx.to(expected.dtype), expected):
        raise ValueError(
            "g_idx: this GPTQ checkpoint was quantized with act-order (desc_act), which permutes "
            "the input rows; radixlm reads GPTQ checkpoints made with desc_act=false"
        )
