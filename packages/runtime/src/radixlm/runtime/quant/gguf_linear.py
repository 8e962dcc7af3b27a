"""The linear layer of a GGUF file: rows that arrive 4-bit, 8-bit in groups, or in float.

A GGUF file chooses a type per tensor, so one layer's rows (q, k and v of a merged layer, or a
whole projection) may come as `Int4Rows` (Q4_0 / Q4_1 / Q4_K, converted exactly into the int4
layout, groups of 32), `Int8GroupRows` (Q8_0: int8 with a scale per group of 32) or a float
tensor (a type with no kernel here, dequantized). `finalize` runs the kernel every row can take:
the int4 kernels when all rows are int4, the grouped int8 kernels when all are Q8_0 (Triton
on CUDA; on the CPU radixlm's C kernel for decode rows, a dequantized product per call for
more), otherwise a float copy of every row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from radixlm import kernels
from radixlm.runtime.quant import compute
from radixlm.runtime.quant.config import QuantConfig
from radixlm.runtime.quant.linear import QuantizedLinear

_INT4, _INT8_GROUPS, _FLOAT = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Int4Rows:
    """Rows of a weight already in the int4 layout: `qweight` [rows, K / 2] packed codes
    (`radixlm.kernels.pack_int4`), `scales` and `zeros` [rows, K / group_size] float32, the
    value of code q being (q - zero) * scale."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1] * 2)


@dataclasses.dataclass(frozen=True)
class Int8GroupRows:
    """Rows of int8 values [rows, K] with a float32 scale per group of `group_size` along K
    (`radixlm.kernels.int8_grouped_linear`'s layout; llama.cpp's Q8_0 at 32)."""

    values: torch.Tensor
    scales: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.values.shape[1])


class GGUFLinear(QuantizedLinear):
    """A `QuantizedLinear` (int4, groups of 32) that also takes Q8_0 and float rows."""

    def __init__(
        self,
        in_features: int,
        shards: Mapping[str, int],
        bias: bool,
        quant: QuantConfig,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(in_features, shards, bias, quant, dtype)
        #: The kind each row arrived as (0: not yet).
        self.row_kinds = torch.zeros(self.out_features, dtype=torch.uint8)
        self._int8: torch.Tensor | None = None
        self._int8_scales: torch.Tensor | None = None

    def load_weight(self, shard: str | None, name: str, tensor: object) -> None:
        """Copy one GGUF tensor (`weight`: `Int4Rows`, `Int8GroupRows` or float) into
        `shard`'s rows; the bias as QuantizedLinear does."""
        if name != "weight" or not isinstance(tensor, (Int4Rows, Int8GroupRows)):
            if name == "weight" and isinstance(tensor, torch.Tensor):
                self._load_float(shard, tensor)
                return
            super().load_weight(shard, name, tensor)  # type: ignore[arg-type]
            return
        begin, end = self._range(shard)
        what = f"{shard}.weight" if shard else "weight"
        if tuple(tensor.shape) != (end - begin, self.in_features):
            raise ValueError(
                f"{what}: the GGUF tensor has shape {tuple(tensor.shape)}, the model expects "
                f"{(end - begin, self.in_features)}"
            )
        device = self.qweight.device
        if isinstance(tensor, Int4Rows) and tensor.group_size == self.group_size:
            self.qweight[begin:end] = tensor.qweight.to(device)
            self.scales[begin:end] = tensor.scales.to(device)
            self.zeros[begin:end] = tensor.zeros.to(device)
            self.row_kinds[begin:end] = _INT4
        elif isinstance(tensor, Int8GroupRows) and tensor.group_size == self.group_size:
            if self._int8 is None or self._int8_scales is None:
                shape = (self.out_features, self.in_features)
                self._int8 = torch.zeros(shape, dtype=torch.int8, device=device)
                self._int8_scales = torch.zeros(
                    self.out_features, self.in_features // self.group_size, device=device
                )
            self._int8[begin:end] = tensor.values.to(device)
            self._int8_scales[begin:end] = tensor.scales.to(device)
            self.row_kinds[begin:end] = _INT8_GROUPS
        else:
            self._load_float(shard, _dequantized(tensor))

    def _load_float(self, shard: str | None, tensor: torch.Tensor) -> None:
        begin, end = self._range(shard)
        if tuple(tensor.shape) != (end - begin, self.in_features):
            raise ValueError(
                f"{shard or 'weight'}: the GGUF tensor has shape {tuple(tensor.shape)}, the "
                f"model expects {(end - begin, self.in_features)}"
            )
        if self.weight is None:  # the first float rows
            shape = (self.out_features, self.in_features)
            self.weight = nn.Parameter(
                torch.zeros(shape, dtype=self.dtype, device=self.qweight.device),
                requires_grad=False,
            )
        with torch.no_grad():
            self.weight[begin:end] = tensor.to(device=self.weight.device, dtype=self.dtype)
        self.row_kinds[begin:end] = _FLOAT

    @torch.no_grad()
    def finalize(self) -> None:
        """Build the matmul every row can take (see the module docstring), once."""
        if self._matmul is not None:
            return
        kinds = set(self.row_kinds.tolist())
        if kinds == {_INT4}:
            self.weight = None
            super().finalize()
            return
        values, scales = self._int8, self._int8_scales
        if kinds == {_INT8_GROUPS} and values is not None and scales is not None:
            self._matmul = compute.int8_grouped(values, scales, self.group_size)
        else:
            self._matmul = self._float_matmul()
        # The int4 buffers are not read by either path.
        self.qweight = torch.empty(0, dtype=self.qweight.dtype)
        self.scales = self.zeros = torch.empty(0)

    def cpu_int8_operands(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The int8 values [N, K] and float32 scales [N, K / 32] of a finalized layer whose
        rows are all Q8_0 on the CPU (kept in that layout there), else None."""
        values, scales = self._int8, self._int8_scales
        if values is None or scales is None or values.device.type != "cpu":
            return None
        return values, scales

    def _float_matmul(self) -> compute.Matmul:
        """Every row in a float copy (some row has no kernel here, or the rows differ)."""
        dense = torch.zeros(self.out_features, self.in_features, dtype=self.dtype)
        dense = dense.to(self.qweight.device)
        kinds = self.row_kinds.to(dense.device)[:, None]
        if self.weight is not None:
            dense = torch.where(kinds == _FLOAT, self.weight.data, dense)
        if (kinds == _INT4).any():
            int4 = kernels.dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)
            dense = torch.where(kinds == _INT4, int4.to(self.dtype), dense)
        if self._int8 is not None and self._int8_scales is not None:
            int8 = kernels.dequantize_int8_grouped(self._int8, self._int8_scales, self.group_size)
            dense = torch.where(kinds == _INT8_GROUPS, int8.to(self.dtype), dense)
        self.weight, self._int8, self._int8_scales = None, None, None
        return lambda x: torch.nn.functional.linear(x, dense.to(x.dtype))


def _dequantized(rows: Int4Rows | Int8GroupRows) -> torch.Tensor:
    if isinstance(rows, Int4Rows):
        return kernels.dequantize_int4(rows.qweight, rows.scales, rows.zeros, rows.group_size)
    return kernels.dequantize_int8_grouped(rows.values, rows.scales, rows.group_size)
