"""Media items to pixels: every form of an image, the refusals that keep the server safe, videos."""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from radixlm.runtime.config import MediaConfig
from radixlm.runtime.multimodal.media import (
    LoadedImage,
    describe_item,
    load_image,
    load_video,
    media_digest,
)
from radixlm.sampling import InvalidRequest

RED, GREEN, BLUE, WHITE = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)
COLORS = [RED, GREEN, BLUE, WHITE, (0, 0, 0), (255, 255, 0)]


def encoded(image: Image.Image, format: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **options)
    return buffer.getvalue()


def picture() -> Image.Image:
    """A small picture whose every pixel differs, so that any mix-up changes the digest."""
    pixels = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3) * 2
    return Image.fromarray(pixels, "RGB")


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims `width` x `height` pixels (a decompression bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 16)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def animated_gif(colors: list[tuple[int, int, int]]) -> bytes:
    frames = [Image.new("RGB", (8, 8), color) for color in colors]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)


def refusal(call: Callable[..., object], *args: object, **kwargs: object) -> InvalidRequest:
    """The InvalidRequest that `call(*args, **kwargs)` raises."""
    with pytest.raises(InvalidRequest) as caught:
        call(*args, **kwargs)
    return caught.value


PNG = encoded(picture())
OPEN = MediaConfig()
URLS = MediaConfig(allow_urls=True, url_allowlist=("127.0.0.1",), fetch_timeout=2.0)


class Handler(BaseHTTPRequestHandler):
    """The routes the URL tests fetch from; HTTP/1.0, so a body may end at the close."""

    def do_GET(self) -> None:
        route, _, argument = self.path.lstrip("/").partition("/")
        if route == "cat.png":
            self.reply(200, PNG, length=True)
        elif route == "unsized":
            self.reply(200, b"x" * 5000, length=False)
        elif route == "hop":  # /hop/N redirects N times, then serves the picture
            hops = int(argument)
            self.redirect(f"/hop/{hops - 1}" if hops > 1 else "/cat.png")
        elif route == "to-private":
            self.redirect("http://10.1.2.3/cat.png")
        elif route == "slow":
            time.sleep(1.5)
            self.reply(200, PNG, length=True)
        elif route == "drip":  # a byte at a time, each well within a socket timeout
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.02)
        else:
            self.reply(404, b"missing", length=True)

    def reply(self, status: int, body: bytes, length: bool) -> None:
        self.send_response(status)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().handle()  # the client may give up, as the limits tell it to


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


# -- forms of an image --------------------------------------------------------------------


def test_every_form_of_the_same_picture_decodes_to_the_same_digest(
    tmp_path: Path, server: str
) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    config = MediaConfig(
        allowed_local_path=str(tmp_path), allow_urls=True, url_allowlist=("127.0.0.1",)
    )
    text = base64.b64encode(PNG).decode()
    forms: list[str | bytes] = [
        PNG,
        encoded(picture(), "BMP"),  # other bytes, same pixels
        f"data:image/png;base64,{text}",
        text,
        "\n".join(text[i : i + 76] for i in range(0, len(text), 76)),  # MIME line breaks
        text.rstrip("="),
        str(tmp_path / "cat.png"),
        "cat.png",  # relative to the allowed directory
        (tmp_path / "cat.png").as_uri(),
        f"{server}/cat.png",
    ]
    loaded = [load_image(form, config) for form in forms]
    assert {image.digest for image in loaded} == {loaded[0].digest}
    assert loaded[0].image.mode == "RGB" and loaded[0].image.size == (7, 5)
    assert np.array_equal(np.asarray(loaded[0].image), np.asarray(picture()))


def test_a_different_picture_has_a_different_digest() -> None:
    other = encoded(Image.new("RGB", (7, 5), RED))
    assert load_image(PNG, OPEN).digest != load_image(other, OPEN).digest


def test_loaded_images_compare_and_hash_by_digest() -> None:
    first, second = load_image(PNG, OPEN), load_image(encoded(picture(), "BMP"), OPEN)
    assert first == second and len({first, second}) == 1


def test_transparency_is_composited_on_white() -> None:
    image = Image.new("RGBA", (2, 1), (255, 0, 0, 255))
    image.putpixel((1, 0), (0, 0, 255, 0))
    loaded = load_image(encoded(image), OPEN).image
    assert loaded.mode == "RGB" and [loaded.getpixel((0, 0)), loaded.getpixel((1, 0))] == [
        RED,
        WHITE,
    ]


def test_a_palette_image_with_a_transparent_color_turns_white_there() -> None:
    image = Image.new("P", (2, 1))
    image.putpalette([*RED, *BLUE])
    image.putpixel((1, 0), 1)
    loaded = load_image(encoded(image, transparency=1), OPEN).image
    assert [loaded.getpixel((0, 0)), loaded.getpixel((1, 0))] == [RED, WHITE]


def test_sixteen_bit_gray_is_scaled_to_eight_bits() -> None:
    image = Image.fromarray(np.array([[0, 65535, 257 * 100]], dtype=np.uint16))
    loaded = load_image(encoded(image), OPEN).image
    assert [loaded.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), WHITE, (100, 100, 100)]


def test_an_animated_image_gives_its_first_frame() -> None:
    loaded = load_image(animated_gif([GREEN, RED, BLUE]), OPEN).image
    assert loaded.getpixel((0, 0)) == GREEN


# -- unreadable images ----------------------------------------------------------------------


def test_invalid_base64_is_refused_naming_the_item_briefly() -> None:
    error = refusal(load_image, "QUJD" * 5000 + "!!", OPEN, "image_data[2]")
    assert error.field == "image_data[2]" and "not valid base64" in error.message
    assert len(str(error)) < 400


def test_a_truncated_png_is_not_a_readable_image() -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    whole = encoded(Image.fromarray(noise, "RGB"))
    error = refusal(load_image, whole[: len(whole) // 2], OPEN, "image_data[0]")
    assert error.field == "image_data[0]" and "is not a readable image" in error.message


def test_a_text_file_is_not_a_readable_image() -> None:
    error = refusal(load_image, b"just some text\n" * 20, OPEN, "image_data[1]")
    assert error.field == "image_data[1]" and "is not a readable image" in error.message


@pytest.mark.parametrize(
    "size",
    [(8000, 6000), (12_000, 10_000), (100_000, 100_000)],
    ids=["over-max-image-pixels", "pillow-warns", "pillow-refuses"],
)
def test_a_decompression_bomb_is_refused_from_its_header(size: tuple[int, int]) -> None:
    error = refusal(load_image, png_declaring(*size), OPEN, "image_data[0]")
    assert error.field == "image_data[0]" and "too large" in error.message


def test_an_image_over_max_image_pixels_is_refused() -> None:
    error = refusal(load_image, PNG, MediaConfig(max_image_pixels=34))
    assert "7x5 is 35 pixels" in error.message and "--max-image-pixels" in error.message


def test_inline_bytes_over_max_bytes_are_refused() -> None:
    config = MediaConfig(max_bytes=len(PNG) - 1)
    assert "--max-media-bytes" in refusal(load_image, PNG, config).message
    text = base64.b64encode(PNG).decode()
    assert "--max-media-bytes" in refusal(load_image, text, config).message


def test_an_empty_item_is_refused() -> None:
    assert "is empty" in refusal(load_image, "  ", OPEN).message


def test_describe_item_shortens_long_strings() -> None:
    assert describe_item("x" * 10_000).endswith("(10000 characters)")
    assert len(describe_item("x" * 10_000)) < 100
    assert describe_item(b"abc") == "3 bytes"


# -- local files ----------------------------------------------------------------------------


def test_a_path_is_refused_without_an_allowed_directory(tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    error = refusal(load_image, str(tmp_path / "cat.png"), OPEN, "image_data[0]")
    assert error.field == "image_data[0]"
    assert "--allowed-local-media-path" in error.message and "base64" in error.message


def test_a_path_outside_the_allowed_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "media").mkdir()
    (tmp_path / "cat.png").write_bytes(PNG)
    config = MediaConfig(allowed_local_path=str(tmp_path / "media"))
    for path in (str(tmp_path / "cat.png"), "../cat.png", (tmp_path / "cat.png").as_uri()):
        assert "names no file under" in refusal(load_image, path, config).message


def test_a_symlink_escaping_the_allowed_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "media").mkdir()
    (tmp_path / "secret.png").write_bytes(PNG)
    (tmp_path / "media" / "cat.png").symlink_to(tmp_path / "secret.png")
    config = MediaConfig(allowed_local_path=str(tmp_path / "media"))
    error = refusal(load_image, str(tmp_path / "media" / "cat.png"), config)
    assert "names no file under" in error.message


def test_a_symlink_within_the_allowed_directory_is_read(tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    (tmp_path / "alias.png").symlink_to(tmp_path / "cat.png")
    config = MediaConfig(allowed_local_path=str(tmp_path))
    assert load_image("alias.png", config).digest == load_image(PNG, OPEN).digest


# -- URLs -----------------------------------------------------------------------------------


def test_a_url_is_refused_unless_urls_are_allowed(server: str) -> None:
    error = refusal(load_image, f"{server}/cat.png", OPEN, "image_data[3]")
    assert error.field == "image_data[3]" and "--allow-media-urls" in error.message


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "localhost", "10.1.2.3", "192.168.0.7", "169.254.169.254", "[::1]", "0.0.0.0"],
)
def test_a_url_to_an_internal_address_is_refused(host: str) -> None:
    error = refusal(load_image, f"http://{host}:9/cat.png", MediaConfig(allow_urls=True))
    assert "resolves to" in error.message and "--media-url-allowlist" in error.message


def test_only_http_and_https_urls_are_fetched() -> None:
    error = refusal(load_image, "ftp://example.com/cat.png", URLS)
    assert "ftp URL" in error.message


def test_an_allowlisted_address_is_fetched(server: str) -> None:
    assert load_image(f"{server}/cat.png", URLS).digest == load_image(PNG, OPEN).digest


def test_an_allowlisted_network_or_host_name_is_fetched(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    by_network = MediaConfig(allow_urls=True, url_allowlist=("127.0.0.0/8",))
    by_name = MediaConfig(allow_urls=True, url_allowlist=("localhost",))
    assert load_image(f"{server}/cat.png", by_network).image.size == (7, 5)
    assert load_image(f"http://localhost:{port}/cat.png", by_name).image.size == (7, 5)


def test_a_body_over_max_bytes_is_refused_by_content_length(server: str) -> None:
    config = MediaConfig(allow_urls=True, url_allowlist=("127.0.0.1",), max_bytes=len(PNG) - 1)
    assert "--max-media-bytes" in refusal(load_image, f"{server}/cat.png", config).message


def test_a_body_over_max_bytes_is_refused_while_streaming(server: str) -> None:
    config = MediaConfig(allow_urls=True, url_allowlist=("127.0.0.1",), max_bytes=1000)
    assert "--max-media-bytes" in refusal(load_image, f"{server}/unsized", config).message


def test_redirects_are_followed_up_to_max_redirects(server: str) -> None:
    config = MediaConfig(allow_urls=True, url_allowlist=("127.0.0.1",), max_redirects=2)
    assert load_image(f"{server}/hop/2", config).image.size == (7, 5)
    error = refusal(load_image, f"{server}/hop/3", config)
    assert "redirects more than 2 times" in error.message


def test_a_redirect_to_a_private_address_is_refused(server: str) -> None:
    error = refusal(load_image, f"{server}/to-private", URLS)
    assert "resolves to 10.1.2.3" in error.message


def test_a_slow_server_times_out(server: str) -> None:
    config = MediaConfig(allow_urls=True, url_allowlist=("127.0.0.1",), fetch_timeout=0.3)
    started = time.monotonic()
    error = refusal(load_image, f"{server}/slow", config)
    assert "timed out after 0.3 s" in error.message and time.monotonic() - started < 1.2


def test_a_server_dripping_bytes_times_out_at_the_deadline(server: str) -> None:
    config = MediaConfig(allow_urls=True, url_allowlist=("127.0.0.1",), fetch_timeout=0.4)
    started = time.monotonic()
    assert "timed out" in refusal(load_image, f"{server}/drip", config).message
    assert time.monotonic() - started < 1.2


def test_an_http_error_is_refused_with_its_status(server: str) -> None:
    error = refusal(load_image, f"{server}/nothing.png", URLS, "image_data[0]")
    assert error.field == "image_data[0]" and "HTTP 404" in error.message


def test_an_unreachable_server_is_refused_with_the_reason() -> None:
    error = refusal(load_image, "http://127.0.0.1:9/cat.png", URLS)
    assert "failed" in error.message


# -- videos ---------------------------------------------------------------------------------


def colors_of(frames: list[LoadedImage]) -> list[tuple[int, int, int]]:
    return [frame.image.getpixel((0, 0)) for frame in frames]


def test_a_video_from_a_frame_list_samples_evenly() -> None:
    items: list[str | bytes] = [encoded(Image.new("RGB", (4, 4), color)) for color in COLORS]
    assert colors_of(load_video(items, OPEN, None)) == COLORS
    assert colors_of(load_video(items, OPEN, 3)) == [GREEN, WHITE, (255, 255, 0)]


def test_a_bad_frame_is_named_by_its_index() -> None:
    items: list[str | bytes] = [PNG, b"not an image"]
    error = refusal(load_video, items, OPEN, None, "video_data[1]")
    assert error.field == "video_data[1][1]"


def test_a_video_from_an_animated_gif_samples_evenly() -> None:
    gif = animated_gif(COLORS)
    assert colors_of(load_video(gif, OPEN, None)) == COLORS
    assert colors_of(load_video(gif, OPEN, 2)) == [GREEN, (0, 0, 0)]
    assert colors_of(load_video(gif, OPEN, 50)) == COLORS


def test_a_video_over_its_pixel_budget_is_refused() -> None:
    gif = animated_gif([RED, GREEN] * 5)  # 10 frames of 8x8; the budget is 8 such frames
    config = MediaConfig(max_image_pixels=64)
    error = refusal(load_video, gif, config, None, "video_data[0]")
    assert error.field == "video_data[0]" and "ask for at most 8 frames" in error.message
    assert len(load_video(gif, config, 8)) == 8


def test_the_video_digest_depends_on_the_frames_and_their_order() -> None:
    frames = load_video([PNG, encoded(Image.new("RGB", (4, 4), RED))], OPEN, None)
    assert media_digest(frames) != media_digest(frames[::-1])
    assert media_digest(frames) == media_digest(list(frames))
    assert media_digest(frames[:1]) != frames[0].digest


def test_a_video_file_without_pyav_asks_for_the_video_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    error = refusal(load_video, b"\x00\x00\x00\x18ftypmp42" + b"\0" * 64, OPEN, None)
    assert "radixlm-runtime[video]" in error.message and "list of frame images" in error.message


@pytest.mark.parametrize(("container", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx")])
def test_a_video_file_is_decoded_by_pyav_and_sampled(container: str, codec: str) -> None:
    av = pytest.importorskip("av")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(10):
            frame = av.VideoFrame.from_image(Image.new("RGB", (32, 32), (index * 25, 0, 0)))
            output.mux(stream.encode(frame))
        output.mux(stream.encode())
    frames = load_video(buffer.getvalue(), OPEN, 3)
    reds = [red for red, _, _ in colors_of(frames)]
    assert len(frames) == 3 and all(
        abs(red - want) < 12 for red, want in zip(reds, [25, 125, 200], strict=True)
    )


def test_num_frames_below_one_is_refused() -> None:
    assert refusal(load_video, [PNG], OPEN, 0).field == "num_frames"
