"""Which quantized weight format a model runs with.

Two sources: the operator asks for one at load time (`quantization="int8"`, ...: a
full-precision checkpoint is quantized as it loads), or the checkpoint is already quantized and
says so in the `quantization_config` of its config.json (GPTQ and AWQ int4, FP8). Both end as a
`QuantConfig`, whose `format` is one of the three layouts the linear layers hold in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from radixlm.runtime.config import QUANTIZATION_GROUP_SIZES
from radixlm.runtime.config import QUANTIZATION_METHODS as QUANTIZATION_METHODS

#: What `quantization=` accepts. int8: weight-only int8, per output channel. w8a8_int8: the same
#: weights, and activations quantized to int8 per token at each call (SGLang's name). int4:
#: weight-only int4 in groups along the input. fp8: weight-only float8 e4m3, per output channel.
#: gptq / awq / fp8 also name pre-quantized checkpoints (read from their config.json).
GROUP_SIZES = QUANTIZATION_GROUP_SIZES

#: The in-memory layouts (see `radixlm.kernels.quant`).
Format = Literal["int8", "int4", "fp8"]
#: Where the quantized values come from.
Source = Literal["load_time", "gptq", "awq", "fp8", "gguf"]


class QuantizationError(ValueError):
    """The quantization asked for, or the one a checkpoint declares, cannot be used; the message
    says what to change."""


@dataclass(frozen=True)
class QuantConfig:
    """A model's quantized weights: their layout, where they come from, their parameters.

    `group_size` matters for int4 only (-1, from a checkpoint: one group per row); `symmetric` for int4 quantized at load time (the zero
    point is then 8). `zero_offset` is added to the zero points a GPTQ checkpoint stores (1 for
    its original format, which stores `zero - 1`). `activations_int8` quantizes activations per
    token at each call (w8a8_int8).
    """

    method: str
    format: Format
    source: Source
    group_size: int = 128
    symmetric: bool = False
    zero_offset: int = 0
    activations_int8: bool = False

    def describe(self) -> str:
        """A short human-readable summary (logged, and in get_server_info)."""
        where = "quantized at load time" if self.source == "load_time" else "from the checkpoint"
        groups = f"groups of {self.group_size}"
        if self.source == "load_time" and self.group_size > min(GROUP_SIZES):
            groups += " (smaller where a layer's input size needs it)"
        detail = {
            "int8": "int8 weights per output channel",
            "int4": f"int4 weights in {groups}",
            "fp8": "float8 e4m3 weights per output channel",
        }[self.format]
        if self.source == "gguf":
            return (
                "gguf: Q4_0 / Q4_1 / Q4_K weights kept as int4 in groups of 32, Q8_0 as int8 "
                "where a grouped int8 kernel runs, other types dequantized to the compute dtype"
            )
        if self.activations_int8:
            detail += ", int8 activations per token"
        return f"{self.method}: {detail}, {where}"


def _load_time(method: str, group_size: int, symmetric: bool) -> QuantConfig:
    if method == "int4" and group_size not in GROUP_SIZES:
        raise QuantizationError(
            f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}; "
            f"got {group_size}"
        )
    fmt: Format = "int4" if method == "int4" else "fp8" if method == "fp8" else "int8"
    return QuantConfig(
        method=method,
        format=fmt,
        source="load_time",
        group_size=group_size,
        symmetric=symmetric,
        activations_int8=method == "w8a8_int8",
    )


def _int4_checkpoint(method: str, raw: Mapping[str, Any]) -> QuantConfig:
    bits = raw.get("bits", raw.get("w_bit", 4))
    if bits != 4:
        raise QuantizationError(
            f"this {method.upper()} checkpoint has {bits}-bit weights; radixlm reads 4-bit "
            f"{method.upper()} checkpoints only"
        )
    group = raw.get("group_size", raw.get("q_group_size", 128))
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise QuantizationError(
            f"this {method.upper()} checkpoint has group_size {group}; a group size is a "
            "positive number of input columns, or -1 (one group per row)"
        )
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(
                f"this AWQ checkpoint uses the {version!r} layout; radixlm reads AWQ's 'gemm' "
                "layout only"
            )
        if raw.get("zero_point", True) is False:
            raise QuantizationError("AWQ checkpoints without zero points are not read")
        return QuantConfig(method="awq", format="int4", source="awq", group_size=group)
    checkpoint_format = str(raw.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantizationError(
            f"this GPTQ checkpoint's checkpoint_format is {checkpoint_format!r}; radixlm reads "
            "'gptq' and 'gptq_v2'"
        )
    return QuantConfig(
        method="gptq",
        format="int4",
        source="gptq",
        group_size=group,
        symmetric=bool(raw.get("sym", True)),
        zero_offset=1 if checkpoint_format == "gptq" else 0,
    )


def _fp8_checkpoint(raw: Mapping[str, Any]) -> QuantConfig:
    if raw.get("weight_block_size"):
        raise QuantizationError(
            f"this FP8 checkpoint has block-wise scales (weight_block_size "
            f"{raw['weight_block_size']}); radixlm reads per-tensor and per-channel FP8 scales"
        )
    return QuantConfig(method="fp8", format="fp8", source="fp8")


def checkpoint_quantization(raw_config: Mapping[str, Any]) -> QuantConfig | None:
    """The quantization a checkpoint's config.json declares, or None for a full-precision one.

    Raises QuantizationError for a method or variant radixlm does not read.
    """
    raw = raw_config.get("quantization_config")
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        raise QuantizationError("config.json's quantization_config must be an object")
    method = str(raw.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return _int4_checkpoint(method, raw)
    if method == "fp8":
        return _fp8_checkpoint(raw)
    raise QuantizationError(
        f"this checkpoint is quantized with {method or 'an unnamed method'!r}; radixlm reads "
        "GPTQ and AWQ int4 and FP8 (per-tensor or per-channel) checkpoints, or quantizes a "
        "full-precision checkpoint itself (quantization int8, w8a8_int8, int4 or fp8)"
    )


def resolve_quantization(
    asked: str | None,
    raw_config: Mapping[str, Any],
    group_size: int = 32,
    symmetric: bool = False,
) -> QuantConfig | None:
    """The quantization to run: the checkpoint's, or the one asked for at load time.

    Raises QuantizationError when the two disagree, when gptq/awq is asked for a checkpoint
    that is not quantized so, or when the method is unknown.
    """
    if asked is not None and asked not in QUANTIZATION_METHODS:
        raise QuantizationError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {asked!r}"
        )
    if asked == "gguf":
        raise QuantizationError(
            "quantization 'gguf' reads a GGUF file's own weights; this checkpoint is a Hugging "
            "Face directory (pass a .gguf file as the model path, or another method)"
        )
    stored = checkpoint_quantization(raw_config)
    if asked == "none":
        if stored is not None:
            raise QuantizationError(
                f"the checkpoint is quantized with {stored.method}; quantization 'none' runs "
                "full-precision and GGUF checkpoints only (drop it)"
            )
        return None
    if stored is not None:
        if asked is not None and asked != stored.method:
            raise QuantizationError(
                f"the checkpoint is already quantized with {stored.method}; drop quantization "
                f"{asked!r} (or pass {stored.method!r})"
            )
        return stored
    if asked in ("gptq", "awq"):
        raise QuantizationError(
            f"quantization {asked!r} reads a {asked.upper()} checkpoint, but this checkpoint's "
            "config.json has no quantization_config; to quantize a full-precision checkpoint "
            "at load time pass int8, w8a8_int8, int4 or fp8"
        )
    if asked is None:
        return None
    return _load_time(asked, group_size, symmetric)


def gguf_file_quantization(asked: str | None, group_size: int) -> QuantConfig | None:
    """A GGUF file's layers: its 4-bit tensors kept as int4 (None or "gguf" asked), or every
    tensor dequantized and quantized again at load time by the method asked for."""
    if asked in (None, "gguf"):
        return QuantConfig(method="gguf", format="int4", source="gguf", group_size=32)
    if asked == "none":
        return None
    if asked in ("gptq", "awq"):
        raise QuantizationError(
            f"quantization {asked!r} reads a {asked.upper()} checkpoint; this is a GGUF file "
            "(drop --quantization to keep its own 4-bit weights, or pass int8, w8a8_int8, "
            "int4 or fp8 to quantize it again)"
        )
    return resolve_quantization(asked, {}, group_size)
