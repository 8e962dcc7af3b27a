"""Per model family: how images and videos become pixel tensors and how many prompt positions
each takes, using the model's own Hugging Face image processor (read from its directory)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from radixlm.runtime.multimodal.inputs import MediaItem
from radixlm.runtime.multimodal.media import LoadedImage


@dataclass(frozen=True)
class Processed:
    """One item after the processor: its tensor, other outputs the encoder reads, and the
    number of prompt positions (= embedding rows) it takes."""

    pixel_values: torch.Tensor
    length: int
    extra: dict[str, Any] = field(default_factory=dict)


class MediaProcessor(Protocol):
    """What the front end needs from a vision model's processing."""

    #: The text that stands for one image / video in a prompt (None: not taken), and the
    #: placeholder token id whose run the prompt holds there.
    image_token: str | None
    image_token_id: int | None
    video_token: str | None
    video_token_id: int | None

    def images(self, images: Sequence[LoadedImage]) -> list[Processed]: ...

    def videos(self, videos: Sequence[Sequence[LoadedImage]]) -> list[Processed]: ...

    def processor_output(self, data: dict[str, Any], kind: str) -> list[Processed]:
        """SGLang's `processor_output` format: an HF processor's output for this item."""
        ...

    def embedding_length(self, rows: int, data: dict[str, Any]) -> int:
        """The positions a `precomputed_embedding` of `rows` rows takes."""
        ...

    def mrope(
        self, prompt_ids: Sequence[int], items: Sequence[MediaItem]
    ) -> tuple[torch.Tensor, int] | None:
        """M-RoPE positions [3, len(prompt_ids)] and the delta of later positions; None for
        models with ordinary positions."""
        ...


def _token_text(tokenizer: Any, token_id: int) -> str:
    text = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(text, str):
        raise ValueError(f"the tokenizer has no token {token_id}")
    return text


class LlavaMediaProcessor:
    """LLaVA: every image is resized to the tower's size; it takes a fixed number of positions
    (patches, plus the class token under the `full` strategy)."""

    video_token: str | None = None
    video_token_id: int | None = None

    def __init__(self, path: Path, hf_config: Any, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
            str(path), local_files_only=True
        )
        from radixlm.runtime.models.llava import image_token_id

        self.image_token_id = image_token_id(hf_config)
        self.image_token = _token_text(tokenizer, self.image_token_id)
        vision = hf_config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        clip = str(getattr(vision, "model_type", "clip")).startswith("clip")
        drop = str(hf_config.vision_feature_select_strategy) == "default"
        self.tokens_per_image = patches + int(clip) - int(drop)
        self.image_size = int(vision.image_size)

    def images(self, images: Sequence[LoadedImage]) -> list[Processed]:
        out = self.image_processor(images=[i.image for i in images], return_tensors="pt")
        pixels = out["pixel_values"].to(torch.float32)
        return [Processed(pixels[k : k + 1], self.tokens_per_image) for k in range(len(images))]

    def videos(self, videos: Sequence[Sequence[LoadedImage]]) -> list[Processed]:
        raise ValueError("this model takes images, not videos")

    def processor_output(self, data: dict[str, Any], kind: str) -> list[Processed]:
        pixels = torch.as_tensor(data["pixel_values"], dtype=torch.float32)
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        if pixels.dim() != 4 or pixels.shape[-1] != self.image_size:
            raise ValueError(
                f"pixel_values must have shape [images, 3, {self.image_size}, "
                f"{self.image_size}]; got {list(pixels.shape)}"
            )
        return [Processed(pixels[k : k + 1], self.tokens_per_image) for k in range(len(pixels))]

    def embedding_length(self, rows: int, data: dict[str, Any]) -> int:
        return rows

    def mrope(
        self, prompt_ids: Sequence[int], items: Sequence[MediaItem]
    ) -> tuple[torch.Tensor, int] | None:
        return None


def _qwen2_vl(path: Path, hf_config: Any, tokenizer: Any) -> MediaProcessor:
    from radixlm.runtime.multimodal.qwen2_vl import Qwen2VLMediaProcessor  # imports this module

    return Qwen2VLMediaProcessor(path, hf_config, tokenizer)


#: Architecture name -> the family's processing (built from the model directory).
MEDIA_PROCESSORS: dict[str, Callable[[Path, Any, Any], Any]] = {
    "LlavaForConditionalGeneration": LlavaMediaProcessor,
    "Qwen2VLForConditionalGeneration": _qwen2_vl,
    "Qwen2_5_VLForConditionalGeneration": _qwen2_vl,
}


def media_processor(
    architecture: str, path: Path, hf_config: Any, tokenizer: Any
) -> MediaProcessor | None:
    """The processing of a vision model's media; None for a text-only model."""
    make = MEDIA_PROCESSORS.get(architecture)
    processor: MediaProcessor | None = None if make is None else make(path, hf_config, tokenizer)
    return processor
