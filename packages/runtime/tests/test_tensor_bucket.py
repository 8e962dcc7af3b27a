"""SGLang's flattened tensor bucket: tensors of several dtypes come back exactly from one flat
byte buffer, in every form a caller may send it; metadata that does not fit the buffer is
refused naming the entry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixlm.runtime.tensor_bucket import FlattenedTensorBucket, checked_bucket


def _named() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, generator=generator).to(torch.bfloat16)),  # 6 bytes
        ("b.weight", torch.randn(2, 5, generator=generator)),  # then float32 at byte 6
        ("c.ids", torch.arange(7, dtype=torch.int64)),
        ("d.scalar", torch.tensor(2.5, dtype=torch.float16)),
    ]


def _same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [name for name, _ in got] == [name for name, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_tensors_of_several_dtypes_come_back_exactly() -> None:
    bucket = FlattenedTensorBucket(named_tensors=_named())
    flat = bucket.get_flattened_tensor()
    assert flat.dtype == torch.uint8 and flat.numel() == 6 + 40 + 56 + 2
    assert [m.start_idx for m in bucket.get_metadata()] == [0, 6, 46, 102]
    _same(checked_bucket(bucket).reconstruct_tensors(), _named())


def test_a_dict_of_raw_bytes_with_dtype_names_reads_the_same() -> None:
    """The form a server hands over: bytes, dtype names, metadata as dicts or tuples."""
    bucket = FlattenedTensorBucket(named_tensors=_named())
    metadata: list[object] = [
        {"name": m.name, "shape": list(m.shape), "dtype": str(m.dtype), "start_idx": m.start_idx,
         "end_idx": m.end_idx}
        for m in bucket.get_metadata()[:2]
    ]  # fmt: skip
    metadata += [
        (m.name, m.shape, str(m.dtype).removeprefix("torch."), m.start_idx, m.end_idx)
        for m in bucket.get_metadata()[2:]
    ]
    raw = bytes(bucket.get_flattened_tensor().numpy())
    _same(checked_bucket({"flattened_tensor": raw, "metadata": metadata}).reconstruct_tensors(),
          _named())  # fmt: skip


def test_sglangs_bucket_objects_are_read_by_their_methods() -> None:
    ours = FlattenedTensorBucket(named_tensors=_named())
    entries = [SimpleNamespace(**{f: getattr(m, f) for f in m.__slots__}) for m in ours.metadata]
    theirs = SimpleNamespace(
        get_flattened_tensor=lambda: ours.flattened_tensor, get_metadata=lambda: entries
    )
    _same(checked_bucket(theirs).reconstruct_tensors(), _named())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"end_idx": 200}, r"metadata\[1\] \(b.weight\): start_idx 6 .. end_idx 200 is not within"),
        (
            {"shape": [2, 4]},
            r"metadata\[1\] \(b.weight\): shape \[2, 4\] of torch.float32 takes 32",
        ),
        ({"dtype": "float13"}, r"metadata\[1\] \(b.weight\): unknown dtype 'float13'"),
        ({"name": "a.weight"}, r"metadata\[1\] \(a.weight\): the name comes twice"),
        ({"start_idx": None}, r"metadata\[1\]: it has no start_idx"),
    ],
)
def test_metadata_that_does_not_fit_the_buffer_is_refused_naming_the_entry(
    change: dict[str, object], message: str
) -> None:
    bucket = FlattenedTensorBucket(named_tensors=_named())
    metadata = [
        {f: getattr(m, f) for f in ("name", "shape", "dtype", "start_idx", "end_idx")}
        for m in bucket.metadata
    ]
    metadata[1].update(change)
    with pytest.raises(ValueError, match=message):
        checked_bucket({"flattened_tensor": bucket.flattened_tensor, "metadata": metadata})
