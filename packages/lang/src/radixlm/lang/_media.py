"""Images and videos as the request fields want them: files and bytes as base64 text; URLs,
data URIs and base64 strings passed through."""

from __future__ import annotations

import base64
import os

_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")
_VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpeg", ".mpg")
# (offset, magic bytes, MIME type); the first match wins, else the kind's default.
_MAGIC = {
    "image": (
        (0, b"\x89PNG", "image/png"),
        (0, b"\xff\xd8", "image/jpeg"),
        (0, b"GIF8", "image/gif"),
        (0, b"RIFF", "image/webp"),
    ),
    "video": (
        (4, b"ftypqt", "video/quicktime"),
        (4, b"ftyp", "video/mp4"),
        (0, b"\x1a\x45\xdf\xa3", "video/webm"),
        (8, b"AVI ", "video/x-msvideo"),
    ),
}
_DEFAULT_MIME = {"image": "image/jpeg", "video": "video/mp4"}


def _encode(source: str | bytes | os.PathLike[str], kind: str, extensions: tuple[str, ...]) -> str:
    if isinstance(source, bytes):
        return base64.b64encode(source).decode("ascii")
    text = os.fspath(source)
    if text.startswith(("http://", "https://", "data:")):
        return text
    if os.path.isfile(text):
        with open(text, "rb") as handle:
            return base64.b64encode(handle.read()).decode("ascii")
    if text.lower().endswith(extensions):
        raise FileNotFoundError(f"{kind} file {text!r} does not exist")
    return text


def encode_image(source: str | bytes | os.PathLike[str]) -> str:
    """Raw bytes or a file path -> base64; a URL, data URI or base64 string -> unchanged."""
    return _encode(source, "image", _IMAGE_EXTENSIONS)


def encode_video(source: str | bytes | os.PathLike[str]) -> str:
    """A video file (path or raw bytes) -> base64 of the whole file; a URL, data URI or base64
    string -> unchanged. Frames are not decoded here: the server samples them."""
    return _encode(source, "video", _VIDEO_EXTENSIONS)


def data_uri(encoded: str, kind: str = "image") -> str:
    """An encoded image or video as a URL for chat messages (a data URI whose MIME type is
    sniffed from the first bytes); URLs and data URIs unchanged."""
    if encoded.startswith(("http://", "https://", "data:")):
        return encoded
    try:
        head = base64.b64decode(encoded[:24] + "=" * (-len(encoded[:24]) % 4))
    except ValueError:
        head = b""
    mime = next(
        (m for offset, magic, m in _MAGIC[kind] if head[offset:].startswith(magic)),
        _DEFAULT_MIME[kind],
    )
    return f"data:{mime};base64,{encoded}"
