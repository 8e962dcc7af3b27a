"""SGLang's flattened tensor bucket: many tensors laid end to end in one flat byte buffer, with
where each one lies, so that thousands of small weights reach the engine (another process, a
socket) in one piece: `Engine.update_weights_from_tensor(bucket, load_format="flattened_bucket")`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class FlattenedTensorMetadata:
    """Where one tensor lies in a bucket's flat buffer: its elements `start_idx` to `end_idx`
    (bytes, for the uint8 buffer SGLang and radixlm build; `numel` of them), read as `dtype`
    and reshaped to `shape`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Tensors of any dtypes as the bytes of one flat uint8 tensor, with their metadata
    (SGLang's class of this name, with its methods). Built from (name, tensor) pairs on the
    trainer's side; `checked_bucket` reads one (or SGLang's, or a dict) on the engine's."""

    #: SGLang's flag for callers: tensors of several dtypes may share a bucket.
    supports_multi_dtypes = True

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
        flattened_tensor: torch.Tensor | None = None,
        metadata: Iterable[FlattenedTensorMetadata] | None = None,
    ) -> None:
        if named_tensors is not None:
            pieces: list[torch.Tensor] = []
            entries: list[FlattenedTensorMetadata] = []
            at = 0
            for name, tensor in named_tensors:
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                entries.append(
                    FlattenedTensorMetadata(
                        str(name), tuple(tensor.shape), tensor.dtype, at, at + raw.numel(),
                        raw.numel(),
                    )
                )  # fmt: skip
                pieces.append(raw)
                at += raw.numel()
            if not pieces:
                raise ValueError("a flattened bucket needs at least one tensor")
            self.flattened_tensor = torch.cat(pieces)
            self.metadata = entries
        elif flattened_tensor is not None and metadata is not None:
            self.flattened_tensor = flattened_tensor
            self.metadata = list(metadata)
        else:
            raise ValueError("give named_tensors, or flattened_tensor and metadata")

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs: views of the flat buffer, or copies where a tensor does not
        start at a multiple of its element size (tensors of several dtypes lie end to end)."""
        flat = self.flattened_tensor
        found = []
        for m in self.metadata:
            piece = flat[m.start_idx : m.end_idx]
            if piece.storage_offset() * flat.element_size() % m.dtype.itemsize:
                piece = piece.clone()
            found.append((m.name, piece.view(m.dtype).reshape(m.shape)))
        return found


_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx")


def checked_bucket(value: Any) -> FlattenedTensorBucket:
    """The bucket `value` gives, checked entry by entry: a `FlattenedTensorBucket` (radixlm's
    or SGLang's: anything with `get_flattened_tensor()` and `get_metadata()`), or a mapping
    with `flattened_tensor` (a 1-D tensor, or bytes: the raw little-endian contents) and
    `metadata`, whose entries have `name`, `shape`, `dtype` (a torch dtype or its name),
    `start_idx`, `end_idx` (attributes, keys, or a tuple in that order). Raises ValueError
    naming the first entry that does not fit the buffer."""
    if hasattr(value, "get_flattened_tensor") and hasattr(value, "get_metadata"):
        flat, raw = value.get_flattened_tensor(), value.get_metadata()
    elif isinstance(value, Mapping) and {"flattened_tensor", "metadata"} <= value.keys():
        flat, raw = value["flattened_tensor"], value["metadata"]
    else:
        raise ValueError(
            "a flattened bucket is a FlattenedTensorBucket or a dict with flattened_tensor and "
            f"metadata; got {type(value).__name__}"
        )
    flat = _flat_tensor(flat)
    entries = [_entry(index, item) for index, item in enumerate(raw)]
    if not entries:
        raise ValueError("the bucket's metadata is empty")
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        where = f"metadata[{index}] ({entry.name})"
        if entry.name in seen:
            raise ValueError(f"{where}: the name comes twice")
        seen.add(entry.name)
        if not 0 <= entry.start_idx <= entry.end_idx <= flat.numel():
            raise ValueError(
                f"{where}: start_idx {entry.start_idx} .. end_idx {entry.end_idx} is not "
                f"within the flat tensor's {flat.numel()} elements"
            )
        span = (entry.end_idx - entry.start_idx) * flat.element_size()
        needed = math.prod(entry.shape) * entry.dtype.itemsize
        if span != needed:
            raise ValueError(
                f"{where}: shape {list(entry.shape)} of {entry.dtype} takes {needed} bytes; "
                f"start_idx .. end_idx spans {span}"
            )
    return FlattenedTensorBucket(flattened_tensor=flat, metadata=entries)


def _flat_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, bytes | bytearray | memoryview):
        view = memoryview(value).cast("B")
        if not len(view):
            return torch.empty(0, dtype=torch.uint8)
        if view.readonly:
            view = memoryview(bytearray(view))
        return torch.frombuffer(view, dtype=torch.uint8)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"flattened_tensor must be a tensor or bytes; got {type(value).__name__}")
    if value.dim() != 1 or not value.is_contiguous():
        raise ValueError(
            f"flattened_tensor must be a contiguous 1-D tensor; got shape {list(value.shape)}"
        )
    return value


def _entry(index: int, item: Any) -> FlattenedTensorMetadata:
    where = f"metadata[{index}]"
    values: list[Any]
    if isinstance(item, Mapping):
        values = [item.get(field) for field in _FIELDS]
    elif isinstance(item, tuple | list):
        values = list(item[: len(_FIELDS)]) + [None] * (len(_FIELDS) - len(item))
    else:
        values = [getattr(item, field, None) for field in _FIELDS]
    missing = [field for field, value in zip(_FIELDS, values, strict=True) if value is None]
    if missing:
        raise ValueError(f"{where}: it has no {missing[0]}")
    name, shape, dtype, start, end = values
    try:
        dims = tuple(int(n) for n in shape)
        start, end = int(start), int(end)
    except (TypeError, ValueError):
        raise ValueError(f"{where} ({name}): shape, start_idx and end_idx are integers") from None
    if any(n < 0 for n in dims):
        raise ValueError(f"{where} ({name}): shape {list(dims)} has a negative size")
    return FlattenedTensorMetadata(str(name), dims, _dtype(dtype, f"{where} ({name})"), start,
                                   end, end - start)  # fmt: skip


def _dtype(value: Any, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(
            f"{where}: unknown dtype {value!r} (torch's names: float32, bfloat16, ...)"
        )
    return found
