"""The tensors of `POST /update_weights_from_tensor`, in forms that are safe to read, as one
flattened bucket for the engine (torch-free: bytes and metadata).

SGLang's body carries `serialized_named_tensors`: pickles (its `MultiprocessingSerializer`),
and unpickling runs whatever code the sender put in them, so a server must not read them from
the network. These forms carry the same tensors as plain data:

- `named_tensors`: `[{"name", "dtype", "shape", "data"}]`, `data` the base64 of the tensor's
  raw little-endian bytes (row-major);
- `flattened_bucket`: `{"data", "metadata": [{"name", "shape", "dtype", "start_idx",
  "end_idx"}]}`, SGLang's bucket layout: one base64 buffer, each tensor's byte range in it;
- `safetensors`: the base64 of a safetensors file (a JSON header, then the raw bytes).

Each becomes SGLang's bucket dict `{"flattened_tensor": bytes, "metadata": [...]}` (built in
the server's thread pool when the body is large): the engine reads it with
`load_format="flattened_bucket"` and checks every entry against the buffer.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from radixlm.sampling import InvalidRequest

#: safetensors' dtype codes -> torch's names (what the engine reads).
_SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}

Size = Annotated[int, Field(ge=0)]


class NamedTensorData(BaseModel):
    """One tensor as plain data."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    dtype: str = Field(min_length=1, description="torch's name: float32, bfloat16, int64, ...")
    shape: list[Size]
    data: str = Field(description="base64 of the raw little-endian bytes, row-major")


class BucketEntry(BaseModel):
    """Where one tensor lies in a flattened bucket's buffer (byte offsets)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    shape: list[Size]
    dtype: str = Field(min_length=1)
    start_idx: Size = Field(description="the first byte of the tensor in the buffer")
    end_idx: Size = Field(description="the byte after its last")
    numel: Size | None = Field(default=None, description="SGLang's; not read")


class FlattenedBucketData(BaseModel):
    """SGLang's flattened bucket as plain data: one buffer, each tensor's byte range in it."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="base64 of the flat buffer")
    metadata: list[BucketEntry] = Field(min_length=1)


def _decoded(text: str, field: str) -> bytearray:
    """The bytes of a base64 field (writable: the engine reads them without another copy)."""
    try:
        return bytearray(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError) as error:
        raise InvalidRequest(field, f"is not base64: {error}") from None


def bucket_from_named_tensors(tensors: list[NamedTensorData]) -> dict[str, Any]:
    """The tensors end to end in one buffer, with their byte ranges."""
    pieces: list[bytearray] = []
    metadata: list[dict[str, Any]] = []
    at = 0
    for index, tensor in enumerate(tensors):
        raw = _decoded(tensor.data, f"named_tensors[{index}].data")
        metadata.append(
            {
                "name": tensor.name,
                "shape": list(tensor.shape),
                "dtype": tensor.dtype,
                "start_idx": at,
                "end_idx": at + len(raw),
            }
        )
        pieces.append(raw)
        at += len(raw)
    return {"flattened_tensor": bytearray().join(pieces), "metadata": metadata}


def bucket_from_flattened(bucket: FlattenedBucketData) -> dict[str, Any]:
    metadata = [entry.model_dump(exclude={"numel"}) for entry in bucket.metadata]
    return {
        "flattened_tensor": _decoded(bucket.data, "flattened_bucket.data"),
        "metadata": metadata,
    }


def bucket_from_safetensors(text: str) -> dict[str, Any]:
    """A safetensors file's tensors: its header says where each lies in its data section."""
    blob = _decoded(text, "safetensors")
    if len(blob) < 8:
        raise InvalidRequest("safetensors", "is not a safetensors file (shorter than its header)")
    size = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8 : 8 + size])
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("safetensors", "is not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise InvalidRequest("safetensors", "is not a safetensors file (bad header)")
    metadata = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            start, end = (int(n) for n in entry["data_offsets"])
            shape = [int(n) for n in entry["shape"]]
        except (KeyError, TypeError, ValueError):
            raise InvalidRequest(
                "safetensors", f"{name}: not a tensor entry this server reads ({entry!r:.100})"
            ) from None
        metadata.append(
            {"name": name, "shape": shape, "dtype": dtype, "start_idx": start, "end_idx": end}
        )
    if not metadata:
        raise InvalidRequest("safetensors", "the file holds no tensor")
    return {"flattened_tensor": memoryview(blob)[8 + size :], "metadata": metadata}
