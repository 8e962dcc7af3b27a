"""Linear layers whose weights are held quantized, behind the models' `LinearFactory`.

A `QuantizedLinear` is one projection or several merged ones (q/k/v, gate/up), like the
full-precision layers, and the loader fills it the same way: `load_weight(shard, leaf, tensor)`
with the checkpoint's leaf names. What those leaves are depends on where the values come from:

- quantized at load time: `weight` (full precision, staged until `finalize` quantizes it);
- GPTQ / AWQ: `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`), unpacked as they arrive;
- FP8: `weight` (float8 e4m3) and `weight_scale` (per tensor or per channel), `input_scale`
  accepted and unused (activations are not quantized);
- GGUF: `weight` only, in the layouts of `gguf_linear.GGUFLinear` (a subclass).

Load-time int4 picks, per layer, the largest group size not above the one asked for that
divides the layer's input (576 = 9 x 64 takes groups of 64 when 128 is asked); an input no
group size divides is padded with zero columns to a multiple of 32.

`finalize()` runs once after loading: it quantizes staged weights and builds the device's
matmul (`compute.py`). Biases, norms, embeddings and the LM head stay in the compute dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from radixlm import kernels
from radixlm.runtime.distributed import SINGLE
from radixlm.runtime.models.linear import Part, whole_sizes
from radixlm.runtime.quant import checkpoint, compute
from radixlm.runtime.quant.config import GROUP_SIZES, QuantConfig


def layer_group_size(in_features: int, asked: int) -> int:
    """The int4 group of a layer quantized at load time: the largest of `GROUP_SIZES` not
    above `asked` that divides `in_features`, else the smallest (the input is then padded)."""
    for group in sorted(GROUP_SIZES, reverse=True):
        if group <= asked and in_features % group == 0:
            return group
    return min(GROUP_SIZES)


def _shard_ranges(shards: Mapping[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    ranges: dict[str, tuple[int, int]] = {}
    start = 0
    for name, size in shards.items():
        ranges[name] = (start, start + size)
        start += size
    return ranges, start


class QuantizedLinear(nn.Module):
    """x @ W.T + b with W held in the `quant.format` layout (see the module docstring)."""

    qweight: torch.Tensor
    #: int8 / fp8: one scale per output row.
    scale: torch.Tensor
    #: int4: [out_features, in_features / group_size] scales and zero points.
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(
        self,
        in_features: int,
        shards: Mapping[str, int],
        bias: bool,
        quant: QuantConfig,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_ranges, self.out_features = _shard_ranges(shards)
        self.quant = quant
        self.dtype = dtype
        out, k = self.out_features, in_features
        #: This layer's int4 group, and its input width padded to whole groups.
        # A checkpoint's groups (`checkpoint_group`, -1: the whole row) are read as they are
        # stored and run as the largest of GROUP_SIZES that divides them, each group's scale
        # and zero repeated (exact): the kernels' fast paths take those sizes.
        self.group_size = self.checkpoint_group = quant.group_size
        if quant.format == "int4" and quant.source == "load_time":
            self.group_size = self.checkpoint_group = layer_group_size(k, quant.group_size)
        elif quant.format == "int4":
            self.checkpoint_group = k if quant.group_size == -1 else quant.group_size
            if k % self.checkpoint_group:
                raise ValueError(
                    f"this {quant.method} checkpoint's int4 groups of {quant.group_size} need "
                    f"in_features divisible by it; this layer has {k}"
                )
            self.group_size = next(
                (g for g in sorted(GROUP_SIZES, reverse=True) if self.checkpoint_group % g == 0),
                self.checkpoint_group,
            )
        self.padded_in = -(-k // self.group_size) * self.group_size
        kp = self.padded_in if quant.format == "int4" else k
        self.bias = (
            nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        )
        # Full-precision staging for load-time quantization (the dummy initialiser fills it too).
        self.weight: nn.Parameter | None = None
        if quant.source == "load_time":
            self.weight = nn.Parameter(torch.empty(out, k, dtype=dtype), requires_grad=False)
        if quant.format == "int4":
            groups = kp // self.group_size
            self.register_buffer("qweight", torch.zeros(out, kp // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.ones(out, groups, dtype=torch.float32))
            self.register_buffer("zeros", torch.full((out, groups), 8.0, dtype=torch.float32))
        else:
            storage = torch.int8 if quant.format == "int8" else torch.float8_e4m3fn
            self.register_buffer("qweight", torch.zeros(out, k, dtype=storage))
            self.register_buffer("scale", torch.ones(out, dtype=torch.float32))
        self._matmul: compute.Matmul | None = None

    # Loading ---------------------------------------------------------------------------------

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The leaf names a checkpoint must provide for each projection of this layer."""
        source = self.quant.source
        leaves: tuple[str, ...] = {
            "load_time": ("weight",),
            "gptq": ("qweight", "qzeros", "scales"),
            "awq": ("qweight", "qzeros", "scales"),
            "fp8": ("weight", "weight_scale"),
            "gguf": ("weight",),
        }[source]
        return leaves + (("bias",) if self.bias is not None else ())

    def _range(self, shard: str | None) -> tuple[int, int]:
        if shard is None:
            if len(self.shard_ranges) != 1:
                raise ValueError(
                    f"a merged layer needs a shard name, one of {list(self.shard_ranges)}"
                )
            shard = next(iter(self.shard_ranges))
        return self.shard_ranges[shard]

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into `shard`'s rows. Raises ValueError on a name the
        source does not have or a shape mismatch.

        After `finalize` (a weight update) a layer quantized at load time takes full-precision
        weights and biases: the rows are quantized at once, as `finalize` quantizes them (each
        output row on its own), and the layer runs again after the next `finalize`, which
        builds its matmul over the new values. Other sources raise RuntimeError then."""
        if self._matmul is not None or (self.weight is None and self.quant.source == "load_time"):
            self._update(shard, name, tensor)
            return
        begin, end = self._range(shard)
        rows = end - begin
        what = f"{shard}.{name}" if shard else name
        with torch.no_grad():
            if name == "bias":
                if self.bias is None:
                    raise ValueError(f"{what}: the checkpoint has a bias the model does not expect")
                _copy(self.bias[begin:end], tensor, what)
            elif self.quant.source == "load_time" and name == "weight":
                assert self.weight is not None
                _copy(self.weight[begin:end], tensor, what)
            elif self.quant.source in ("gptq", "awq"):
                self._load_int4(begin, end, name, tensor, what)
            elif self.quant.source == "fp8" and name in ("weight", "weight_scale", "input_scale"):
                self._load_fp8(begin, rows, name, tensor, what)
            else:
                raise ValueError(
                    f"{what}: a {self.quant.method} checkpoint has no such tensor for this layer "
                    f"(expected {', '.join(self.checkpoint_leaves())})"
                )

    def _load_int4(self, begin: int, end: int, name: str, tensor: torch.Tensor, what: str) -> None:
        rows, k, group = end - begin, self.in_features, self.checkpoint_group
        repeat = group // self.group_size  # stored groups -> the groups the kernels run
        awq = self.quant.source == "awq"
        try:
            if name == "qweight":
                values = (checkpoint.awq_values if awq else checkpoint.gptq_values)(tensor, k, rows)
                self.qweight[begin:end] = kernels.pack_int4(values.to(self.qweight.device))
            elif name == "qzeros":
                zeros = checkpoint.int4_zeros(tensor, k // group, rows, awq, self.quant.zero_offset)
                self.zeros[begin:end] = zeros.repeat_interleave(repeat, dim=1)
            elif name == "scales":
                scales = checkpoint.int4_scales(tensor, k // group, rows)
                self.scales[begin:end] = scales.repeat_interleave(repeat, dim=1)
            elif name == "g_idx" and not awq:
                checkpoint.check_trivial_g_idx(tensor, k, group)
            else:
                raise ValueError(
                    f"a {self.quant.method} checkpoint has no such tensor for this layer "
                    f"(expected {', '.join(self.checkpoint_leaves())})"
                )
        except ValueError as error:
            raise ValueError(f"{what}: {error}") from None

    def _load_fp8(self, begin: int, rows: int, name: str, tensor: torch.Tensor, what: str) -> None:
        end = begin + rows
        if name == "input_scale":
            return  # static activation scales: activations are not quantized here
        if name == "weight_scale":
            scale = tensor.to(torch.float32).reshape(-1)
            if scale.numel() not in (1, rows):
                raise ValueError(
                    f"{what}: expected one scale (per tensor) or {rows} (per channel), got shape "
                    f"{tuple(tensor.shape)}"
                )
            self.scale[begin:end] = scale.expand(rows) if scale.numel() == 1 else scale
            return
        if tuple(tensor.shape) != (rows, self.in_features):
            raise ValueError(
                f"{what}: checkpoint tensor has shape {tuple(tensor.shape)}, the model expects "
                f"{(rows, self.in_features)}"
            )
        if tensor.dtype == torch.float8_e4m3fn:
            self.qweight[begin:end] = tensor
        elif tensor.is_floating_point():
            # A layer the checkpoint left unquantized: quantize it here, per channel.
            weight, scale = kernels.quantize_fp8(tensor.to(torch.float32), per_channel=True)
            self.qweight[begin:end] = weight
            self.scale[begin:end] = scale.reshape(-1)
        else:
            raise ValueError(f"{what}: expected float8_e4m3fn weights, got {tensor.dtype}")

    def _update(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        """A weight update after `finalize` (see `load_weight`)."""
        if self.quant.source != "load_time" or self.qweight.numel() == 0:
            raise RuntimeError(
                f"the weights of a {self.quant.method} layer are fixed once loaded (only weights "
                "quantized at load time, and not fp8 on the CPU, can be updated); restart the "
                "engine to load other weights"
            )
        begin, end = self._range(shard)
        what = f"{shard}.{name}" if shard else name
        if name == "bias":
            if self.bias is None:
                raise ValueError(f"{what}: the checkpoint has a bias the model does not expect")
            with torch.no_grad():
                _copy(self.bias[begin:end], tensor, what)
            return
        if name != "weight":
            raise ValueError(f"{what}: a layer quantized at load time takes weight and bias only")
        if tuple(tensor.shape) != (end - begin, self.in_features):
            raise ValueError(
                f"{what}: checkpoint tensor has shape {tuple(tensor.shape)}, the model expects "
                f"{(end - begin, self.in_features)}"
            )
        self._matmul = None  # built again over the new values by the next finalize()
        with torch.no_grad():
            self._quantize_rows(begin, tensor.to(torch.float32))

    # After loading ---------------------------------------------------------------------------

    @torch.no_grad()
    def finalize(self) -> None:
        """Quantize staged weights, free them, and build this device's matmul (once)."""
        if self._matmul is not None:
            return
        if self.weight is not None:
            self._quantize_rows(0, self.weight.data.to(torch.float32))
            self.weight = None
        fmt = self.quant.format
        if fmt == "int4":
            matmul = compute.int4_grouped(self.qweight, self.scales, self.zeros, self.group_size)
            pad = self.padded_in - self.in_features
            self._matmul = (
                matmul if not pad else lambda x: matmul(torch.nn.functional.pad(x, (0, pad)))
            )
        elif fmt == "int8":
            build = compute.w8a8_int8 if self.quant.activations_int8 else compute.int8_weight_only
            self._matmul = build(self.qweight, self.scale)
        else:
            self._matmul = self._fp8_matmul()

    def _quantize_rows(self, begin: int, weight: torch.Tensor) -> None:
        """Quantize full-precision output rows [begin, begin + len(weight)) (every format
        quantizes each output row on its own)."""
        rows = slice(begin, begin + weight.shape[0])
        fmt = self.quant.format
        pad = self.padded_in - self.in_features if fmt == "int4" else 0
        if pad:
            weight = torch.nn.functional.pad(weight, (0, pad))
        if fmt == "int8":
            qweight, scale = kernels.quantize_int8(weight)
            self.qweight[rows].copy_(qweight)
            self.scale[rows].copy_(scale)
        elif fmt == "int4":
            # Asymmetric groups are fitted (float zero points, llama.cpp's Q4_1 / Q4_K way).
            symmetric = self.quant.symmetric
            qweight, scales, zeros = kernels.quantize_int4(
                weight, self.group_size, symmetric=symmetric, fit=not symmetric
            )
            self.qweight[rows].copy_(qweight)
            self.scales[rows].copy_(scales)
            self.zeros[rows].copy_(zeros)
        else:
            qweight, scale = kernels.quantize_fp8(weight, per_channel=True)
            self.qweight[rows].copy_(qweight)
            self.scale[rows].copy_(scale.reshape(-1))

    def _fp8_matmul(self) -> compute.Matmul:
        qweight, scale = self.qweight, self.scale
        if qweight.device.type == "cuda":
            return lambda x: kernels.fp8_linear(x, qweight, scale)
        # CPUs have no float8 GEMM: the weight is dequantized once, into the compute dtype.
        dense = kernels.dequantize_fp8(qweight, scale).to(self.dtype)
        self.qweight = torch.empty(0, dtype=qweight.dtype)
        return lambda x: torch.nn.functional.linear(x, dense.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._matmul is None:
            raise RuntimeError("a quantized layer runs only after finalize() (the loader calls it)")
        flat = x.reshape(-1, self.in_features)
        out = self._matmul(flat)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def _copy(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)


class QuantizedLinears:
    """The single-device factory for a quantized model (every projection quantized; the LM
    head stays in the compute dtype, packed for oneDNN when `packs_lm_head`)."""

    tp = SINGLE

    def __init__(self, quant: QuantConfig, dtype: torch.dtype, packs_lm_head: bool = False):
        self.quant = quant
        self.dtype = dtype
        self.packs_lm_head = packs_lm_head

    def merged_column(
        self, in_features: int, shards: Mapping[str, int | Part], bias: bool
    ) -> QuantizedLinear:
        sizes = whole_sizes(shards, "a quantized layer")
        return self._layer(in_features, sizes, bias)

    def row(self, in_features: int, out_features: int, bias: bool) -> QuantizedLinear:
        return self._layer(in_features, {"out": out_features}, bias)

    def _layer(self, in_features: int, sizes: Mapping[str, int], bias: bool) -> QuantizedLinear:
        if self.quant.source == "gguf":
            from radixlm.runtime.quant.gguf_linear import GGUFLinear

            return GGUFLinear(in_features, sizes, bias, self.quant, self.dtype)
        return QuantizedLinear(in_features, sizes, bias, self.quant, self.dtype)


def finalize_quantized(model: nn.Module) -> int:
    """Finalize every quantized layer of `model` (after its weights are loaded), and quantize
    its LM head (`quantize_lm_head`); returns how many layers there were."""
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    for layer in layers:
        layer.finalize()
    if layers:
        quantize_lm_head(model, layers[0].quant, layers[0].dtype)
    return len(layers)


def lm_head_source(model: Any) -> str | None:
    """The checkpoint name of the weight the model's int8 LM head was quantized from (the
    embedding table when tied), or None when it has no quantized head."""
    if model.quantized_head is None:
        return None
    return "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"


def reopen_lm_head(model: Any) -> None:
    """Before a weight update loads the weight of the LM head: drop its int8 copy (the next
    `finalize_quantized` makes it again from the new weight) and give an untied head back the
    full-precision table `quantize_lm_head` released (zeros until the update fills it)."""
    model.quantized_head = None
    head = model.lm_head
    if head is not None and head.weight.numel() == 0:
        embed = model.model.embed_tokens.weight
        head.weight.data = embed.new_zeros(head.per_rank, embed.shape[1])


#: Columns per scale of the int8 LM head (llama.cpp's Q8_0 block).
HEAD_GROUP = 32


class Int8GroupedHead(nn.Module):
    """An LM head in int8 with a float32 scale per group of `HEAD_GROUP` columns (the
    output matrix of llama.cpp's 8- and 4-bit files is Q8_0): per vocabulary row, a tied
    embedding's outlying columns cost 0.15 points of SmolLM2's perplexity; per 32 columns
    (an eighth more bytes) they do not. Grouped int8 kernels: Triton on CUDA; on the CPU
    radixlm's C kernel for decode rows, the weight dequantized at the call for more."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        values, scales = kernels.quantize_int8_grouped(weight.detach().float(), HEAD_GROUP)
        self.out_features, self.in_features = values.shape
        self.register_buffer("qweight", values)
        self.register_buffer("scales", scales)
        self._matmul = compute.int8_grouped(values, scales, HEAD_GROUP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x.reshape(-1, self.in_features))
        return out.reshape(*x.shape[:-1], self.out_features)


@torch.no_grad()
def quantize_lm_head(model: nn.Module, quant: QuantConfig, dtype: torch.dtype) -> bool:
    """Give `model` an int8 copy of its LM head when its layers were quantized at load time
    to int8, w8a8_int8 or int4, or come 4-bit from a GGUF file (as llama.cpp's 8- and 4-bit
    files quantize their output matrix; a GGUF file's own is itself Q8_0 or Q6_K): on a CPU
    the head of a small model with a large vocabulary is a quarter of the bytes each decode
    step reads (SmolLM2-135M's tied 49,152 x 576 head: 113 MB in float32, more than its 4-bit
    body). The head is int8 with a scale per 32 columns (`Int8GroupedHead`, llama.cpp's Q8_0;
    per vocabulary row when the hidden size is not a multiple of 32, and under w8a8_int8,
    which also quantizes its input). fp8 and
    GPTQ/AWQ checkpoints keep the head as it is. Returns whether the head was quantized. The
    embedding lookup keeps the full-precision matrix."""
    if quant.source not in ("load_time", "gguf") or quant.format == "fp8":
        return False
    if model.quantized_head is not None:
        return False
    weight = model.lm_head_weight
    head: nn.Module
    if not quant.activations_int8 and weight.shape[1] % HEAD_GROUP == 0:
        head = Int8GroupedHead(weight)
    else:
        if quant.source == "gguf":
            head_quant = QuantConfig(method="int8", format="int8", source="load_time")
        else:
            head_quant = dataclasses.replace(quant, format="int8")
        with weight.device:
            head = QuantizedLinear(
                weight.shape[1], {"out": weight.shape[0]}, False, head_quant, dtype
            )
        assert head.weight is not None
        head.weight.copy_(weight)
        head.finalize()
    model.quantized_head = head
    if model.lm_head is not None:  # untied: the full-precision head is no longer read
        model.lm_head.weight.data = weight.new_empty(0)
    return True
