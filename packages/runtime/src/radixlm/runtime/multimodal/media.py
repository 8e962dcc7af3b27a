"""Turning one image or video item of a request into decoded RGB pixels, within the server's limits.

An item (SGLang's `image_data` / `video_data` entries, OpenAI's `image_url` parts) is one of:

- raw `bytes`;
- a data URL, `data:image/png;base64,...`;
- a base64 string (line breaks allowed, padding optional);
- an `http://` or `https://` URL, fetched by `fetch.fetch_url` when `MediaConfig.allow_urls`;
- a local file path or `file://` URL, read only when `MediaConfig.allowed_local_path` is set
  and the file's real path (symlinks resolved) lies under it; a relative path is taken
  relative to that directory.

A string is read as a file when such a file exists under the allowed directory, else as base64
when it decodes as such; otherwise the error says why it is neither. Every refusal raises
`radixlm.sampling.InvalidRequest` naming the item's field (`image_data[1]`), with the item
shortened to a few dozen characters.

Decoding: at most `max_bytes` bytes; the declared size is checked against `max_image_pixels`
before any pixel is decoded (Pillow's own decompression-bomb limit applies as well); the first
frame of an animated image; alpha and palettes composited on white.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import os
import re
import struct
import urllib.parse
import urllib.request
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from radixlm.runtime.config import MediaConfig
from radixlm.runtime.multimodal.fetch import fetch_url
from radixlm.sampling import InvalidRequest

#: A video may decode to as many pixels as this many images of the largest allowed size.
VIDEO_PIXELS_IN_IMAGES = 8

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_PATH_MAX = 4096
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
# Pillow reports a broken file with any of these, depending on the format and where it breaks.
_DECODE_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    IndexError,
    TypeError,
    struct.error,
    zlib.error,
)


@dataclass(frozen=True)
class LoadedImage:
    """One decoded picture: `image` is RGB and fully loaded; `digest` names its pixels.

    The digest covers mode, size and pixels, not the bytes that were sent, so the same picture
    sent as a path, base64, a data URL or a URL hashes the same. Equality and hashing go by the
    digest. Callers must not draw on `image`: it may be shared through caches.
    """

    image: Image.Image = dataclasses.field(compare=False)
    digest: bytes


def describe_item(item: object) -> str:
    """A short description of a media item for error messages (never megabytes of base64)."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return f"{len(item)} bytes"
    if isinstance(item, list):
        return f"a list of {len(item)} items"
    if not isinstance(item, str):
        return type(item).__name__
    if len(item) <= 80:
        return repr(item)
    return f"{item[:60]!r}… ({len(item)} characters)"


def load_image(item: str | bytes, config: MediaConfig, field: str = "image_data") -> LoadedImage:
    """Decode one image item (any form in the module docstring) into RGB pixels.

    Animated images give their first frame. Raises InvalidRequest naming `field` when the item
    is refused by `config`, cannot be read, or is not an image. Reads a file or the network
    for path and URL items; mutates nothing.
    """
    data = _item_bytes(item, config, field)
    image = _open(data, config, field, describe_item(item))
    if image is None:
        raise InvalidRequest(
            field,
            f"is not a readable image ({describe_item(item)}): the format is not one Pillow "
            "knows; send a PNG, JPEG, GIF or WebP image",
        )
    with image:
        return _decoded(image, field, describe_item(item))


def load_video(
    item: str | bytes | list[str | bytes],
    config: MediaConfig,
    num_frames: int | None,
    field: str = "video_data",
) -> list[LoadedImage]:
    """Decode one video item into RGB frames, in order.

    The item is a list of frame images (each as for `load_image`, named `field[i]`), an
    animated image (GIF, WebP, APNG) or a video file (mp4, webm, ..., decoded by PyAV, the
    `radixlm-runtime[video]` extra). `num_frames` samples that many frames evenly across the
    video (the middle of equal spans); None, or more than the video has, takes every frame.
    Each frame is within `max_image_pixels`, and all of them together within
    `VIDEO_PIXELS_IN_IMAGES` times that. Raises InvalidRequest naming `field`.
    """
    if num_frames is not None and num_frames < 1:
        raise InvalidRequest("num_frames", f"must be at least 1; got {num_frames}")
    budget = _Budget(config.max_image_pixels * VIDEO_PIXELS_IN_IMAGES, field)
    if isinstance(item, list):
        if not item:
            raise InvalidRequest(field, "is an empty list of frames; send at least one")
        frames = []
        for index in _spread(len(item), num_frames):
            frame = load_image(item[index], config, f"{field}[{index}]")
            budget.spend(frame.image.size, 1)  # frames may differ in size
            frames.append(frame)
        return frames
    data = _item_bytes(item, config, field)
    image = _open(data, config, field, describe_item(item))
    if image is None:
        return _video_file_frames(data, config, num_frames, budget, field, describe_item(item))
    with image:
        indices = _spread(getattr(image, "n_frames", 1), num_frames, image.size, budget)
        return [_decoded(image, field, describe_item(item), index) for index in indices]


def media_digest(frames: Sequence[LoadedImage]) -> bytes:
    """One digest for a video: the hash of its frames' digests, in order."""
    hasher = hashlib.sha256(b"video\0%d\0" % len(frames))
    for frame in frames:
        hasher.update(frame.digest)
    return hasher.digest()


def _loaded(image: Image.Image) -> LoadedImage:
    """`image` (any mode) as a LoadedImage: converted to RGB in a new image, and hashed."""
    rgb = _to_rgb(image)
    rgb.load()
    hasher = hashlib.sha256(b"%s\0" % rgb.mode.encode())
    hasher.update(struct.pack("<II", *rgb.size))
    hasher.update(rgb.tobytes())
    return LoadedImage(rgb, hasher.digest())


@dataclass
class _Budget:
    """The pixels a video may still decode to."""

    pixels: int
    field: str

    def spend(self, size: tuple[int, int], frames: int) -> None:
        width, height = size
        wanted = width * height * frames
        if wanted > self.pixels:
            fit = self.pixels // max(1, width * height)
            raise InvalidRequest(
                self.field,
                f"is too large: {frames} frame(s) of {width}x{height} decode to more than "
                f"{VIDEO_PIXELS_IN_IMAGES} images of --max-image-pixels; ask for at most "
                f"{fit} frames (num_frames) or send a smaller video",
            )
        self.pixels -= wanted


def _spread(
    total: int,
    wanted: int | None,
    size: tuple[int, int] | None = None,
    budget: _Budget | None = None,
) -> list[int]:
    """`wanted` frame indices spread evenly over `total` (the middle of equal spans).

    With a frame `size`, the frames are charged to `budget` before the list is made (a video's
    header may claim any number of frames).
    """
    count = total if wanted is None else min(total, wanted)
    if size is not None and budget is not None:
        budget.spend(size, count)
    if count == total:
        return list(range(total))
    return [(2 * i + 1) * total // (2 * count) for i in range(count)]


def _item_bytes(item: object, config: MediaConfig, field: str) -> bytes:
    """The encoded bytes an item stands for, from whichever form it has."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
    elif not isinstance(item, str):
        raise InvalidRequest(
            field,
            "must be a string (URL, data URL, base64 or file path) or bytes; "
            f"got {type(item).__name__}",
        )
    else:
        data = _text_bytes(item.strip(), config, field)
    if len(data) > config.max_bytes:
        raise InvalidRequest(field, _too_many_bytes(len(data), config))
    if not data:
        raise InvalidRequest(field, "is empty; send an image as base64, a data URL or a URL")
    return data


def _text_bytes(text: str, config: MediaConfig, field: str) -> bytes:
    if not text:
        raise InvalidRequest(field, "is empty; send an image as base64, a data URL or a URL")
    scheme_match = _SCHEME.match(text)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if scheme == "data":
        return _data_url_bytes(text, config, field)
    if scheme in ("http", "https"):
        return fetch_url(text, config, field)
    if scheme == "file":
        parts = urllib.parse.urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequest(
                field,
                f"names a file on another host ({describe_item(text)}); send the media inline "
                "as base64 or a data URL",
            )
        return _file_bytes(urllib.request.url2pathname(parts.path), config, field, text)
    if scheme and text[len(scheme) + 1 :].startswith("//"):
        raise InvalidRequest(
            field,
            f"is a {scheme} URL ({describe_item(text)}); send http(s) URLs, data URLs or base64",
        )
    if _allowed_file(text, config) is not None:
        return _file_bytes(text, config, field, text)
    try:
        data = _base64_bytes(text, config, field)
    except binascii.Error:
        return _file_bytes(text, config, field, text, also="is not valid base64, and ")
    if _looks_like_path(text) and not data.startswith(_MEDIA_MAGIC) and data[4:8] != b"ftyp":
        # "/etc/passwd" is valid base64 too; what it decodes to is no image, so it is a path.
        return _file_bytes(text, config, field, text)
    return data


# The first bytes of the image and video formats read here (PNG, JPEG, GIF, WebP/AVI, BMP,
# TIFF, Matroska/WebM); MP4 and QuickTime have "ftyp" at offset 4.
_MEDIA_MAGIC = (
    b"\x89PNG",
    b"\xff\xd8",
    b"GIF8",
    b"RIFF",
    b"BM",
    b"II*",
    b"MM\x00*",
    b"\x1aE\xdf\xa3",
)


def _looks_like_path(text: str) -> bool:
    """Short text shaped like a file path (base64 of any real picture is far longer)."""
    return len(text) <= 1024 and (
        text.startswith(("/", "./", "../", "~"))
        or os.path.splitext(text)[1].lower() in _PATH_SUFFIXES
    )


_PATH_SUFFIXES = {
    ".png",
    ".jpg",
    ".jpeg",
    ".gif",
    ".webp",
    ".bmp",
    ".tif",
    ".tiff",
    ".mp4",
    ".webm",
    ".mov",
    ".mkv",
    ".avi",
}


def _base64_bytes(text: str, config: MediaConfig, field: str) -> bytes:
    """Strict base64 (whitespace dropped, missing padding added); raises binascii.Error."""
    compact = "".join(text.split())
    if len(compact) * 3 // 4 > config.max_bytes:  # refuse before allocating the bytes
        raise InvalidRequest(field, _too_many_bytes(len(compact) * 3 // 4, config))
    return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)


def _data_url_bytes(text: str, config: MediaConfig, field: str) -> bytes:
    header, comma, payload = text.partition(",")
    if not comma:
        raise InvalidRequest(field, f"is a data URL without a comma ({describe_item(text)})")
    if not header.lower().endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return _base64_bytes(payload, config, field)
    except binascii.Error as error:
        raise InvalidRequest(
            field, f"is a data URL whose base64 is invalid ({describe_item(text)}): {error}"
        ) from None


def _allowed_file(path: str, config: MediaConfig) -> str | None:
    """The real path of `path` when it is a file under the allowed directory, else None."""
    if config.allowed_local_path is None or len(path) > _PATH_MAX or "\0" in path:
        return None
    root = os.path.realpath(config.allowed_local_path)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root or not os.path.isfile(real):
        return None
    return real


def _file_bytes(path: str, config: MediaConfig, field: str, item: str, also: str = "") -> bytes:
    """A local file's bytes; `also` prefixes the refusal with what the item is not."""
    if config.allowed_local_path is None:
        raise InvalidRequest(
            field,
            f"{also}this server does not read file paths ({describe_item(item)}): send the "
            "media inline as base64 or a data URL, or start the server with "
            "--allowed-local-media-path DIR",
        )
    real = _allowed_file(path, config)
    if real is None:
        raise InvalidRequest(
            field,
            f"{also}names no file under {config.allowed_local_path} ({describe_item(item)}): "
            "only files under --allowed-local-media-path are read, symlinks resolved; send "
            "the media inline as base64 or a data URL instead",
        )
    if os.path.getsize(real) > config.max_bytes:
        raise InvalidRequest(field, _too_many_bytes(os.path.getsize(real), config))
    with open(real, "rb") as file:
        return file.read(config.max_bytes + 1)


def _too_many_bytes(size: int, config: MediaConfig) -> str:
    return (
        f"is {size} bytes, more than the {config.max_bytes} allowed (--max-media-bytes); "
        "send a smaller file"
    )


def _open(data: bytes, config: MediaConfig, field: str, what: str) -> Image.Image | None:
    """Pillow's lazily opened image once its size passed; None for a format Pillow lacks."""
    try:
        with warnings.catch_warnings():  # process-wide: another thread may miss the filter
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        return None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise InvalidRequest(field, f"is too large to decode ({what}): {error}") from None
    except _DECODE_ERRORS as error:
        raise InvalidRequest(field, f"is not a readable image ({what}): {error}") from None
    try:
        _check_pixels(image.size, config, field)
    except InvalidRequest:
        image.close()
        raise
    return image


def _check_pixels(size: tuple[int, int], config: MediaConfig, field: str) -> None:
    width, height = size
    if width * height > config.max_image_pixels:
        raise InvalidRequest(
            field,
            f"is too large: {width}x{height} is {width * height} pixels, more than the "
            f"{config.max_image_pixels} allowed (--max-image-pixels); send a smaller image",
        )


def _decoded(image: Image.Image, field: str, what: str, frame: int = 0) -> LoadedImage:
    """One frame of an opened image, decoded; broken pixel data raises InvalidRequest."""
    try:
        image.seek(frame)
        return _loaded(image)
    except _DECODE_ERRORS as error:
        raise InvalidRequest(field, f"is not a readable image ({what}): {error}") from None


def _video_file_frames(
    data: bytes,
    config: MediaConfig,
    num_frames: int | None,
    budget: _Budget,
    field: str,
    what: str,
) -> list[LoadedImage]:
    """The frames of a video file, by PyAV; the count is the stream's, or one demux pass's."""
    try:
        import av
    except ImportError:
        raise InvalidRequest(
            field,
            f"is not an image ({what}), and this server cannot decode video files: install "
            "radixlm-runtime[video] (PyAV) on it, or send the video as a list of frame images",
        ) from None
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise InvalidRequest(field, f"is neither an image nor a video ({what})")
            stream = container.streams.video[0]
            size = (stream.codec_context.width, stream.codec_context.height)
            _check_pixels(size, config, field)
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        wanted = _spread(total, num_frames, size, budget)
        frames: list[LoadedImage] = []
        with av.open(io.BytesIO(data)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if len(frames) == len(wanted):
                    break
                if index == wanted[len(frames)]:
                    _check_pixels((frame.width, frame.height), config, field)
                    frames.append(_loaded(frame.to_image()))
    except (av.error.FFmpegError, *_DECODE_ERRORS) as error:
        if isinstance(error, InvalidRequest):
            raise
        raise InvalidRequest(field, f"is not a readable image or video ({what}): {error}") from None
    if not frames:
        raise InvalidRequest(field, f"is a video without frames ({what})")
    return frames


def _to_rgb(image: Image.Image) -> Image.Image:
    """A new RGB image: transparency composited on white, 16-bit gray scaled to 8 bits."""
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    if image.mode.startswith("I;16"):
        image = image.point(lambda value: value / 257)
    return image.convert("RGB")
