"""A request's `image_data` / `video_data` -> decoded, processed items placed in its prompt.

Runs on the front end (off the event loop), before the request reaches the engine core; every
problem with an item is an `InvalidRequest` naming it (`image_data[1]`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.runtime.config import MediaConfig
from radixlm.runtime.multimodal.inputs import MediaItem, MediaKind, MultimodalInputs
from radixlm.runtime.multimodal.media import load_image, load_video, media_digest
from radixlm.runtime.multimodal.processor import MediaProcessor, Processed
from radixlm.sampling import InvalidRequest

#: Frames sampled from a video file (a list of frames is taken as it is).
DEFAULT_VIDEO_FRAMES = 8
_FIELDS: dict[MediaKind, str] = {"image": "image_data", "video": "video_data"}


@dataclass(frozen=True)
class _Entry:
    """One processed item before it has a place in the prompt."""

    kind: MediaKind
    field: str
    processed: Processed | None
    digest: bytes
    length: int
    embeddings: torch.Tensor | None = None
    #: What positions need besides the length (M-RoPE models: the item's patch grid).
    extra: dict[str, Any] | None = None


def _items(value: Any) -> list[Any]:
    """A single request's media field as a list of items (one item or a list of them)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


class MultimodalPreparer:
    """Places a request's images and videos in its prompt for one vision model."""

    def __init__(self, processor: MediaProcessor, config: MediaConfig, hidden_size: int) -> None:
        self.processor = processor
        self.config = config
        self.hidden_size = hidden_size

    def prepare(
        self, prompt_ids: Sequence[int], image_data: Any, video_data: Any
    ) -> tuple[list[int], MultimodalInputs]:
        """(the prompt's cache-key ids with every placeholder run expanded, its media)."""
        images = self._entries("image", _items(image_data))
        videos = self._entries("video", _items(video_data))
        ids, items = self._place(list(prompt_ids), {"image": images, "video": videos})
        inputs = MultimodalInputs(tuple(items))
        mrope = self.processor.mrope(ids, items)
        if mrope is not None:
            inputs = MultimodalInputs(tuple(items), mrope[0], mrope[1])
        return inputs.cache_key(ids), inputs

    # ------------------------------------------------------------------------- entries

    def _entries(self, kind: MediaKind, values: list[Any]) -> list[_Entry]:
        name = _FIELDS[kind]
        token = self.processor.image_token if kind == "image" else self.processor.video_token
        if values and token is None:
            raise InvalidRequest(name, f"this model does not take {kind}s; remove {name}")
        fields = [name if len(values) == 1 else f"{name}[{k}]" for k in range(len(values))]
        # Per item, its entries (a processor_output dict may hold several images).
        entries: list[list[_Entry]] = [[] for _ in values]
        raw: list[int] = []
        for k, value in enumerate(values):
            if isinstance(value, dict):
                entries[k] = self._formatted(kind, fields[k], value)
            elif isinstance(value, str | bytes) or (kind == "video" and isinstance(value, list)):
                raw.append(k)
            else:
                raise InvalidRequest(
                    fields[k],
                    "must be a file path, URL, data URL or base64 string; got "
                    f"{type(value).__name__}",
                )
        if raw:
            decoded = self._decode(kind, [values[k] for k in raw], [fields[k] for k in raw])
            for k, entry in zip(raw, decoded, strict=True):
                entries[k] = [entry]
        return [entry for group in entries for entry in group]

    def _decode(self, kind: MediaKind, values: list[Any], names: list[str]) -> list[_Entry]:
        if kind == "image":
            loaded = [load_image(v, self.config, n) for v, n in zip(values, names, strict=True)]
            digests = [image.digest for image in loaded]
            processed = self._process(names, lambda: self.processor.images(loaded))
        else:
            clips = [
                load_video(v, self.config, DEFAULT_VIDEO_FRAMES, n)
                for v, n in zip(values, names, strict=True)
            ]
            digests = [media_digest(frames) for frames in clips]
            processed = self._process(names, lambda: self.processor.videos(clips))
        return [
            _Entry(kind, name, p, digest, p.length)
            for name, p, digest in zip(names, processed, digests, strict=True)
        ]

    @staticmethod
    def _process(names: list[str], run: Any) -> list[Processed]:
        try:
            result: list[Processed] = run()
        except InvalidRequest:
            raise
        except Exception as error:  # the HF processor refusing an odd image
            field = names[0] if len(names) == 1 else names[0].partition("[")[0]
            raise InvalidRequest(field, f"could not be processed for this model: {error}") from None
        return result

    def _formatted(self, kind: MediaKind, field: str, data: dict[str, Any]) -> list[_Entry]:
        """SGLang's dict formats: `processor_output` and `precomputed_embedding`."""
        form = data.get("format")
        if form == "processor_output":
            try:
                processed = self.processor.processor_output(data, kind)
            except (KeyError, ValueError, TypeError, RuntimeError) as error:
                raise InvalidRequest(field, f"is not a valid processor output: {error}") from None
            return [
                _Entry(kind, field, p, _tensor_digest(b"pixels", p.pixel_values, p.extra), p.length)
                for p in processed
            ]
        if form == "precomputed_embedding":
            try:
                feature = torch.as_tensor(data["feature"], dtype=torch.float32)
            except (KeyError, ValueError, TypeError, RuntimeError):
                raise InvalidRequest(
                    field, "a precomputed_embedding needs `feature`: a [positions, hidden] array"
                ) from None
            if feature.dim() == 3 and feature.shape[0] == 1:
                feature = feature[0]
            if feature.dim() != 2 or feature.shape[1] != self.hidden_size:
                raise InvalidRequest(
                    field,
                    f"feature has shape {list(feature.shape)} but this model takes "
                    f"[positions, {self.hidden_size}]",
                )
            if not bool(torch.isfinite(feature).all()):
                raise InvalidRequest(field, "feature holds a NaN or infinite value")
            length = self.processor.embedding_length(int(feature.shape[0]), data)
            extra = _grid_extra(kind, data)
            digest = _tensor_digest(b"embedding", feature, extra)
            return [_Entry(kind, field, None, digest, length, feature, extra)]
        raise InvalidRequest(
            field,
            f"a dict item needs format 'processor_output' or 'precomputed_embedding'; got {form!r}",
        )

    # --------------------------------------------------------------------------- placing

    def _place(
        self, ids: list[int], entries: dict[MediaKind, list[_Entry]]
    ) -> tuple[list[int], list[MediaItem]]:
        """Expand each placeholder run to its item's length (a run already of that length, as
        a processor writes it, is kept)."""
        tokens: dict[int, MediaKind] = {}
        for kind, token_id in (
            ("image", self.processor.image_token_id),
            ("video", self.processor.video_token_id),
        ):
            if token_id is not None:
                tokens[token_id] = kind  # type: ignore[assignment]
        runs: list[tuple[int, int, MediaKind]] = []
        k = 0
        while k < len(ids):
            found = tokens.get(ids[k])
            if found is None:
                k += 1
                continue
            start = k
            while k < len(ids) and ids[k] == ids[start]:
                k += 1
            runs.append((start, k - start, found))
        for kind, given in entries.items():
            placed = [r for r in runs if r[2] == kind]
            if len(placed) != len(given):
                self._count_mismatch(kind, len(placed), len(given))
        out: list[int] = []
        items: list[MediaItem] = []
        used = {"image": 0, "video": 0}
        last = 0
        for start, length, kind in runs:
            entry = entries[kind][used[kind]]
            used[kind] += 1
            if length not in (1, entry.length):
                raise InvalidRequest(
                    entry.field,
                    f"its placeholder run in the prompt has {length} tokens; give one "
                    f"placeholder per {kind} (it is expanded to {entry.length}) or exactly "
                    f"{entry.length}",
                )
            out.extend(ids[last:start])
            items.append(
                MediaItem(
                    kind=kind,
                    offset=len(out),
                    length=entry.length,
                    digest=entry.digest,
                    pixel_values=None if entry.processed is None else entry.processed.pixel_values,
                    extra=entry.extra or ({} if entry.processed is None else entry.processed.extra),
                    embeddings=entry.embeddings,
                )
            )
            out.extend([ids[start]] * entry.length)
            last = start + length
        out.extend(ids[last:])
        return out, items

    def _count_mismatch(self, kind: MediaKind, placed: int, given: int) -> None:
        token = self.processor.image_token if kind == "image" else self.processor.video_token
        noun = kind if given == 1 else f"{kind}s"
        raise InvalidRequest(
            _FIELDS[kind],
            f"{given} {noun} given but the prompt has {placed} {kind} placeholder(s); put "
            f"{token!r} in the prompt once where each {kind} goes",
        )


def _grid_extra(kind: MediaKind, data: dict[str, Any]) -> dict[str, Any]:
    """The patch grid a `precomputed_embedding` may carry (`image_grid_thw` /
    `video_grid_thw`, and a video's `second_per_grid_ts`): M-RoPE models place it by it."""
    grid = data.get("video_grid_thw" if kind == "video" else "image_grid_thw")
    if grid is None:
        return {}
    rows = torch.as_tensor(grid, dtype=torch.int64).reshape(-1, 3).tolist()
    extra: dict[str, Any] = {"grid_thw": tuple(int(v) for v in rows[0])}
    seconds = data.get("second_per_grid_ts")
    if kind == "video" and seconds is not None:
        extra["second_per_grid_t"] = float(torch.as_tensor(seconds).reshape(-1)[0])
    return extra


def _tensor_digest(domain: bytes, tensor: torch.Tensor, extra: dict[str, Any]) -> bytes:
    digest = hashlib.sha256(domain)
    digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    digest.update(str(list(tensor.shape)).encode())
    for key in sorted(extra):
        value = extra[key]
        digest.update(key.encode())
        digest.update(
            value.detach().contiguous().numpy().tobytes()
            if isinstance(value, torch.Tensor)
            else repr(value).encode()
        )
    return digest.digest()


def multimodal_preparer(
    model_path: str,
    architectures: Sequence[str],
    tokenizer: Any,
    config: MediaConfig,
    hidden_size: int,
) -> MultimodalPreparer | None:
    """The media handling of the model at `model_path` (its processor read from that
    directory, never from a hub); None for a text-only model."""
    from radixlm.runtime.multimodal.processor import MEDIA_PROCESSORS, media_processor

    architecture = next((a for a in architectures if a in MEDIA_PROCESSORS), None)
    if architecture is None:
        return None
    from transformers import AutoConfig

    from radixlm.runtime.loader import resolve_model_path

    path = resolve_model_path(model_path)
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    processor = media_processor(architecture, path, hf_config, tokenizer)
    return None if processor is None else MultimodalPreparer(processor, config, hidden_size)
