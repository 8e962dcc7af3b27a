"""The safe forms of `/update_weights_from_tensor`'s tensors become one flattened bucket
(torch-free): each tensor's bytes, byte range and torch dtype name, whichever form carried
it; undecodable data is refused naming the field."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable

import pytest

from radixlm.sampling import InvalidRequest
from radixlm.server.tensor_payload import (
    FlattenedBucketData,
    NamedTensorData,
    bucket_from_flattened,
    bucket_from_named_tensors,
    bucket_from_safetensors,
)

A = struct.pack("<3f", 1.0, 2.0, 3.0)  # float32 [3]
B = bytes([0x80, 0x3F])  # bfloat16 [1]: 1.0
WANT = [
    {"name": "a", "shape": [3], "dtype": "float32", "start_idx": 0, "end_idx": 12},
    {"name": "b", "shape": [1], "dtype": "bfloat16", "start_idx": 12, "end_idx": 14},
]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _safetensors_file() -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
        "b": {"dtype": "BF16", "shape": [1], "data_offsets": [12, 14]},
    }
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + A + B


def test_named_tensors_lie_end_to_end_in_one_buffer() -> None:
    tensors = [
        NamedTensorData(name="a", dtype="float32", shape=[3], data=_b64(A)),
        NamedTensorData(name="b", dtype="bfloat16", shape=[1], data=_b64(B)),
    ]
    bucket = bucket_from_named_tensors(tensors)
    assert bytes(bucket["flattened_tensor"]) == A + B and bucket["metadata"] == WANT


def test_a_flattened_bucket_keeps_its_byte_ranges() -> None:
    data = FlattenedBucketData.model_validate({"data": _b64(A + B), "metadata": WANT})
    bucket = bucket_from_flattened(data)
    assert bytes(bucket["flattened_tensor"]) == A + B and bucket["metadata"] == WANT


def test_a_safetensors_files_header_gives_each_tensors_range_and_torch_dtype() -> None:
    bucket = bucket_from_safetensors(_b64(_safetensors_file()))
    assert bytes(bucket["flattened_tensor"]) == A + B and bucket["metadata"] == WANT


@pytest.mark.parametrize(
    ("call", "field", "message"),
    [
        (lambda: bucket_from_safetensors("%%%"), "safetensors", "is not base64"),
        (lambda: bucket_from_safetensors(_b64(b"\x05\0\0\0\0\0\0\0{nope")), "safetensors",
         "bad header"),
        (lambda: bucket_from_safetensors(_b64(_safetensors_file().replace(b"BF16", b"BF99"))),
         "safetensors", "b: not a tensor entry"),
        (lambda: bucket_from_named_tensors(
            [NamedTensorData(name="a", dtype="float32", shape=[3], data="x")]),
         "named_tensors[0].data", "is not base64"),
    ],
)  # fmt: skip
def test_what_cannot_be_read_is_refused_naming_the_field(
    call: Callable[[], object], field: str, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as error:
        call()
    assert error.value.field == field
