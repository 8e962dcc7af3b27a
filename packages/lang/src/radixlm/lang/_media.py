"""Images as the request fields want them: base64 text, URLs and data URIs passed through."""

from __future__ import annotations

import base64
import os

_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")
_MAGIC = (
    (b"\x89PNG", "image/png"),
    (b"\xff\xd8", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"RIFF", "image/webp"),
)


def encode_image(source: str | bytes | os.PathLike[str]) -> str:
    """Raw bytes or a file path -> base64; a URL, data URI or base64 string -> unchanged."""
    if isinstance(source, bytes):
        return base64.b64encode(source).decode("ascii")
    text = os.fspath(source)
    if text.startswith(("http://", "https://", "data:")):
        return text
    if os.path.isfile(text):
        with open(text, "rb") as handle:
            return base64.b64encode(handle.read()).decode("ascii")
    if text.lower().endswith(_EXTENSIONS):
        raise FileNotFoundError(f"image file {text!r} does not exist")
    return text


def data_uri(image: str) -> str:
    """An encoded image as a URL for chat messages (data URI with a sniffed MIME type)."""
    if image.startswith(("http://", "https://", "data:")):
        return image
    try:
        head = base64.b64decode(image[:24] + "=" * (-len(image[:24]) % 4))
    except ValueError:
        head = b""
    mime = next((m for magic, m in _MAGIC if head.startswith(magic)), "image/jpeg")
    return f"data:{mime};base64,{image}"
