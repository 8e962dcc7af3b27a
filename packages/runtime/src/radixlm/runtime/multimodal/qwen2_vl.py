"""Qwen2-VL / Qwen2.5-VL media: images and videos kept near their own resolution and cut into
patches by the model's Hugging Face image processor, and the prompt's M-RoPE positions.

Videos: transformers' Qwen2-VL video processor needs torchvision, so a video's frames go
through the model's image processor instead (set up with the video processor's settings, one
frame per temporal slice), and each `temporal_patch_size` consecutive frames are stacked into
one temporal patch, the last frame repeated to fill the final one — the layout transformers'
video processor produces. Its resize is PIL's bicubic where torchvision's would be used, so
pixel values may differ from that processor's in the last bits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.models.qwen2_vl import QWEN2_5_VL, vision_channels
from radixlm.runtime.multimodal.inputs import MediaItem
from radixlm.runtime.multimodal.media import LoadedImage
from radixlm.runtime.multimodal.processor import Processed
from radixlm.sampling import InvalidRequest

#: Frames per second assumed for a video given as frames (the sampling rate of Qwen's own
#: video pipeline); Qwen2.5-VL spaces the temporal positions of a video by it.
DEFAULT_VIDEO_FPS = 2.0
# Transformers' Qwen2-VL video processor's size when its config gives none.
_VIDEO_DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
# Video processor settings that shape a frame as they shape an image.
_FRAME_SETTINGS = (
    "size",
    "min_pixels",
    "max_pixels",
    "patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "resample",
    "rescale_factor",
    "do_resize",
    "do_rescale",
    "do_normalize",
    "do_convert_rgb",
)


def _token_text(tokenizer: Any, token_id: int) -> str:
    text = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(text, str):
        raise ValueError(f"the tokenizer has no token {token_id}")
    return text


def _video_settings(path: Path) -> dict[str, Any]:
    """The video processor's saved settings (older checkpoints keep them with the image
    processor's), restricted to those that shape a frame."""
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        file = path / name
        if file.is_file():
            saved = json.loads(file.read_text("utf-8"))
            settings = {key: saved[key] for key in _FRAME_SETTINGS if key in saved}
            if not {"size", "min_pixels", "max_pixels"} & settings.keys():
                settings["size"] = dict(_VIDEO_DEFAULT_SIZE)
            return settings
    return {"size": dict(_VIDEO_DEFAULT_SIZE)}


class Qwen2VLMediaProcessor:
    """Qwen2-VL and Qwen2.5-VL: an image takes t*h*w / merge^2 positions for its patch grid
    (t, h, w) (t = 1; a video's t is its frame count / temporal_patch_size); positions are
    M-RoPE's, three per token."""

    def __init__(self, path: Path, hf_config: Any, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
            str(path), local_files_only=True
        )
        vision = hf_config.vision_config
        self.merge = int(vision.spatial_merge_size)
        self.patch = int(vision.patch_size)
        self.temporal = int(vision.temporal_patch_size)
        self.patch_values = vision_channels(vision) * self.temporal * self.patch * self.patch
        for name, value in (
            ("patch_size", self.patch),
            ("merge_size", self.merge),
            ("temporal_patch_size", self.temporal),
        ):
            found = getattr(self.image_processor, name, value)
            if found != value:
                raise ValueError(
                    f"the image processor's {name} ({found}) differs from the vision "
                    f"config's ({value})"
                )
        settings = {**_video_settings(path), "temporal_patch_size": 1}
        self.frame_processor = type(self.image_processor)(**settings)
        # Qwen2.5-VL spaces a video's temporal positions by its time per temporal patch.
        architectures = list(getattr(hf_config, "architectures", None) or [])
        self.tokens_per_second: float | None = None
        if QWEN2_5_VL in architectures:
            self.tokens_per_second = float(getattr(vision, "tokens_per_second", 2))
        start = _token_text(tokenizer, int(hf_config.vision_start_token_id))
        end = _token_text(tokenizer, int(hf_config.vision_end_token_id))
        self.image_token_id: int | None = int(hf_config.image_token_id)
        self.video_token_id: int | None = int(hf_config.video_token_id)
        self.image_token: str | None = start + _token_text(tokenizer, self.image_token_id) + end
        self.video_token: str | None = start + _token_text(tokenizer, self.video_token_id) + end

    # ----------------------------------------------------------------------------- media

    def images(self, images: Sequence[LoadedImage]) -> list[Processed]:
        out = self.image_processor(images=[i.image for i in images], return_tensors="pt")
        return self._split(out["pixel_values"], out["image_grid_thw"], [{}] * len(images))

    def videos(self, videos: Sequence[Sequence[LoadedImage]]) -> list[Processed]:
        return [self._video(frames) for frames in videos]

    def _video(self, frames: Sequence[LoadedImage]) -> Processed:
        out = self.frame_processor(images=[f.image for f in frames], return_tensors="pt")
        grids = out["image_grid_thw"].tolist()
        if any(grid != grids[0] for grid in grids):
            sizes = sorted({f.image.size for f in frames})
            raise ValueError(f"the frames of a video must have one size; got {sizes}")
        _, h, w = (int(v) for v in grids[0])
        count, per_frame = len(frames), h * w
        pixels = out["pixel_values"].to(torch.float32).reshape(count, per_frame, -1)
        if count % self.temporal:
            filler = pixels[-1:].expand(self.temporal - count % self.temporal, -1, -1)
            pixels = torch.cat([pixels, filler])
        t = pixels.shape[0] // self.temporal
        # [t, temporal, patches, C, p, p] -> [t, patches, C, temporal, p, p]
        stacked = pixels.reshape(t, self.temporal, per_frame, -1, self.patch, self.patch)
        stacked = stacked.permute(0, 2, 3, 1, 4, 5).reshape(t * per_frame, -1)
        grid = (t, h, w)
        extra = {"grid_thw": grid, "second_per_grid_t": self.temporal / DEFAULT_VIDEO_FPS}
        return Processed(stacked.contiguous(), t * h * w // self.merge**2, extra)

    def processor_output(self, data: dict[str, Any], kind: str) -> list[Processed]:
        """`pixel_values` + `image_grid_thw` (images) or `pixel_values_videos` +
        `video_grid_thw` (+ `second_per_grid_ts`) (videos), as Qwen2-VL's HF processor gives
        them; one item per grid row."""
        video = kind == "video"
        pixel_key = "pixel_values_videos" if video else "pixel_values"
        grid_key = "video_grid_thw" if video else "image_grid_thw"
        if pixel_key not in data and "pixel_values" in data:
            pixel_key = "pixel_values"
        if pixel_key not in data or grid_key not in data:
            raise ValueError(f"a {kind} processor output needs `{pixel_key}` and `{grid_key}`")
        pixels = torch.as_tensor(data[pixel_key], dtype=torch.float32)
        grids = torch.as_tensor(data[grid_key], dtype=torch.int64).reshape(-1, 3)
        extras: list[dict[str, Any]] = [{} for _ in range(len(grids))]
        if video:
            seconds = data.get("second_per_grid_ts")
            if seconds is None:
                seconds = [self.temporal / DEFAULT_VIDEO_FPS] * len(grids)
            seconds = torch.as_tensor(seconds, dtype=torch.float64).reshape(-1).tolist()
            if len(seconds) != len(grids):
                raise ValueError(
                    f"second_per_grid_ts has {len(seconds)} values for {len(grids)} videos"
                )
            extras = [{"second_per_grid_t": float(s)} for s in seconds]
        return self._split(pixels, grids, extras)

    def _split(
        self, pixels: torch.Tensor, grids: torch.Tensor, extras: list[dict[str, Any]]
    ) -> list[Processed]:
        """Per-item `Processed` from the concatenated patches of several items."""
        if pixels.dim() != 2 or pixels.shape[1] != self.patch_values:
            raise ValueError(
                f"pixel values must have shape [patches, {self.patch_values}]; "
                f"got {list(pixels.shape)}"
            )
        total = 0
        found: list[Processed] = []
        for row, extra in zip(grids.tolist(), extras, strict=True):
            t, h, w = (int(v) for v in row)
            if min(t, h, w) < 1 or h % self.merge or w % self.merge:
                raise ValueError(
                    f"grid {[t, h, w]} is not a patch grid whose height and width are "
                    f"multiples of {self.merge}"
                )
            count = t * h * w
            if total + count > pixels.shape[0]:
                raise ValueError(f"the grids need more than the {pixels.shape[0]} patch rows given")
            values = pixels[total : total + count].to(torch.float32).contiguous()
            found.append(
                Processed(values, count // self.merge**2, {"grid_thw": (t, h, w), **extra})
            )
            total += count
        if total != pixels.shape[0]:
            raise ValueError(f"the grids take {total} patch rows but {pixels.shape[0]} are given")
        return found

    def embedding_length(self, rows: int, data: dict[str, Any]) -> int:
        return rows

    # --------------------------------------------------------------------------- M-RoPE

    def mrope(
        self, prompt_ids: Sequence[int], items: Sequence[MediaItem]
    ) -> tuple[torch.Tensor, int] | None:
        """Text advances every axis by one per token; an item's tokens take (time, row,
        column) of its merged grid offset by the position where it starts, and the text after
        it continues one past the item's largest position (Qwen's reference and transformers
        4's rule). Returns ([3, len(prompt_ids)] positions, the delta of later positions)."""
        length = len(prompt_ids)
        positions = torch.empty(3, length, dtype=torch.int64)
        cursor = 0  # prompt index
        next_position = 0
        for item in items:
            grid = item.extra.get("grid_thw")
            if grid is None:
                field = "image_data" if item.kind == "image" else "video_data"
                raise InvalidRequest(
                    field,
                    "a precomputed_embedding cannot be placed by this model (its positions "
                    f"need the {item.kind}'s patch grid); send the {item.kind} itself or a "
                    "processor_output",
                )
            text = item.offset - cursor
            positions[:, cursor : item.offset] = torch.arange(next_position, next_position + text)
            next_position += text
            block = self._grid_positions(item, grid) + next_position
            if block.shape[1] != item.length:
                raise ValueError(f"grid {grid} gives {block.shape[1]} positions, not {item.length}")
            positions[:, item.offset : item.end] = block
            next_position = int(block.max()) + 1
            cursor = item.end
        positions[:, cursor:] = torch.arange(next_position, next_position + length - cursor)
        delta = int(positions.max()) + 1 - length if length else 0
        return positions, delta

    def _grid_positions(self, item: MediaItem, grid: Sequence[int]) -> torch.Tensor:
        t, h, w = (int(v) for v in grid)
        times = torch.arange(t)
        if item.kind == "video" and self.tokens_per_second is not None:
            seconds = float(item.extra.get("second_per_grid_t", self.temporal / DEFAULT_VIDEO_FPS))
            times = (times * (self.tokens_per_second * seconds)).long()
        axes = torch.meshgrid(
            times, torch.arange(h // self.merge), torch.arange(w // self.merge), indexing="ij"
        )
        return torch.stack(axes).reshape(3, -1)
