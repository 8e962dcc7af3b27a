"""Images and videos for vision-language models: loading, processing, placing in prompts."""

from radixlm.runtime.multimodal.inputs import MediaItem, MediaSpan, MultimodalInputs
from radixlm.runtime.multimodal.media import (
    LoadedImage,
    describe_item,
    load_image,
    load_video,
    media_digest,
)

__all__ = [
    "LoadedImage",
    "MediaItem",
    "MediaSpan",
    "MultimodalInputs",
    "describe_item",
    "load_image",
    "load_video",
    "media_digest",
]
