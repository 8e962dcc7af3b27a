"""Images and videos: `image()` / `video()` put the model's placeholder in the text and the data
in the request, through every backend."""

from __future__ import annotations

import base64
import warnings
from typing import Any

import pytest
from conftest import CHATML

import radixlm.lang as sgl
from radixlm.lang.backends.engine import EngineBackend
from radixlm.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.lang.ir import Video

pytestmark = pytest.mark.timeout(30)

MP4 = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom"
PNG = b"\x89PNG\r\n\x1a\nfake"
QWEN_VL = {
    "image_token": "<|vision_start|><|image_pad|><|vision_end|>",
    "video_token": "<|vision_start|><|video_pad|><|vision_end|>",
}
RULES = {"Is it a cat? Answer:": " yes"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@pytest.fixture
def backend(make_server: Any) -> Any:
    server = make_server(RULES, CHATML)
    endpoint = sgl.RuntimeEndpoint(server.url, timeout=20)
    endpoint.fake = server
    yield endpoint
    endpoint.close()


@sgl.function
def describe_video(s: Any, video: Any) -> None:
    s += sgl.user(sgl.video(video) + "What happens?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


def test_video_is_exported_and_builds_an_ir_node() -> None:
    node = sgl.video("clip.mp4")
    assert isinstance(node, Video) and node.source == "clip.mp4" and node.num_frames is None
    assert node.describe() == "video('clip.mp4')"


def test_a_video_file_goes_to_the_request_whole_as_base64(backend: Any, tmp_path: Any) -> None:
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(MP4)
    state = describe_video.run(video=str(clip), backend=backend)
    state.sync()
    sent = backend.fake.core.requests[-1]
    assert sent["video_data"] == b64(MP4) and "image_data" not in sent
    assert "<|im_start|>user\n<video>What happens?<|im_end|>" in state.text()
    video_part, text_part = state.messages()[0]["content"]
    assert video_part == {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + b64(MP4)},
    }
    assert text_part == {"type": "text", "text": "What happens?"}


def test_video_urls_and_bytes_are_taken(backend: Any) -> None:
    describe_video.run(video="https://example.com/clip.mp4", backend=backend).sync()
    assert backend.fake.core.requests[-1]["video_data"] == "https://example.com/clip.mp4"
    describe_video.run(video=MP4, backend=backend).sync()
    assert backend.fake.core.requests[-1]["video_data"] == b64(MP4)


def test_num_frames_warns_that_the_server_samples_its_own(backend: Any) -> None:
    with pytest.warns(UserWarning, match="server samples its own default number of frames"):
        node = sgl.video("https://example.com/clip.mp4", num_frames=8)
    assert node.num_frames == 8 and "num_frames=8" in node.describe()
    with pytest.raises(ValueError, match="at least 1"):
        sgl.video("clip.mp4", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgl.video("clip.mp4")  # no count, no warning


def test_a_missing_video_file_fails_naming_the_primitive(backend: Any) -> None:
    error = describe_video.run(video="/no/such/clip.mp4", backend=backend).error()
    assert isinstance(error, sgl.ProgramError)
    assert error.primitive.startswith("video(") and "does not exist" in str(error)


def test_images_and_videos_keep_their_order_in_text_request_and_message(backend: Any) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += sgl.user("Compare " + sgl.image(PNG) + " with " + sgl.video(MP4) + sgl.image(PNG))
        s += sgl.assistant(sgl.gen("answer", max_tokens=2))

    state = prog.run(backend=backend)
    state.sync()
    sent = backend.fake.core.requests[-1]
    assert sent["image_data"] == [b64(PNG), b64(PNG)] and sent["video_data"] == b64(MP4)
    assert "Compare <image> with <video><image>" in state.text()
    kinds = [p["type"] for p in state.messages()[0]["content"]]
    assert kinds == ["text", "image_url", "text", "video_url", "image_url"]


def test_select_sends_the_video_with_every_choice(backend: Any) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += sgl.video(MP4) + "Is it a cat? Answer:" + sgl.select("a", [" yes", " no"])

    assert prog.run(backend=backend)["a"] == " yes"
    batch = next(r for r in backend.fake.core.requests if isinstance(r["text"], list))
    assert batch["video_data"] == [b64(MP4)] * len(batch["text"])


def test_placeholders_come_from_the_servers_model_info(make_server: Any) -> None:
    server = make_server(RULES, CHATML)
    server.core.extra_info = dict(QWEN_VL)
    with sgl.RuntimeEndpoint(server.url, timeout=20) as endpoint:
        template = endpoint.get_chat_template()
        assert (template.image_token, template.video_token) == tuple(QWEN_VL.values())
        state = describe_video.run(video=MP4, backend=endpoint)
        assert QWEN_VL["video_token"] + "What happens?" in state.text()


def test_a_template_that_names_its_placeholders_keeps_them(make_server: Any) -> None:
    server = make_server(RULES, CHATML)
    server.core.extra_info = dict(QWEN_VL)
    own = ChatTemplate("mine", get_chat_template("chatml").roles, image_token="<img>")
    with sgl.RuntimeEndpoint(server.url, chat_template_name=own, timeout=20) as endpoint:
        template = endpoint.get_chat_template()
        assert (template.image_token, template.video_token) == ("<img>", QWEN_VL["video_token"])


def test_a_model_that_names_no_placeholder_gets_sglangs_defaults(backend: Any) -> None:
    template = backend.get_chat_template()
    assert (template.image_token, template.video_token) == (None, None)
    assert (template.media_token("image"), template.media_token("video")) == ("<image>", "<video>")


# The in-process engine backend.


def test_the_engine_backend_passes_video_data(make_engine: Any) -> None:
    engine = make_engine(RULES, CHATML)
    engine.core.extra_info = dict(QWEN_VL)
    backend = EngineBackend(engine)
    state = describe_video.run(video=MP4, backend=backend)
    state.sync()
    assert engine.core.requests[-1]["video_data"] == b64(MP4)
    assert QWEN_VL["video_token"] + "What happens?" in state.text()
    backend.shutdown()


def test_an_engine_without_video_data_is_reported(make_engine: Any) -> None:
    class NoVideos:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def generate(self, prompt=None, sampling_params=None, image_data=None, stream=False):  # type: ignore[no-untyped-def]
            return self.inner.generate(
                prompt=prompt, sampling_params=sampling_params, image_data=image_data, stream=stream
            )

        def model_info(self) -> dict[str, Any]:
            return dict(self.inner.model_info())

    backend = EngineBackend(NoVideos(make_engine(RULES)))
    error = describe_video.run(video=MP4, backend=backend).error()
    assert error is not None and "video_data" in str(error)


# The OpenAI backend.


def test_openai_refuses_video_without_server_extensions(make_server: Any) -> None:
    pytest.importorskip("openai")
    server = make_server(RULES)
    api = sgl.OpenAI(
        "toy-chat", base_url=server.url + "/v1", max_retries=0, server_extensions=False
    )
    error = describe_video.run(video=MP4, backend=api).error()
    assert isinstance(error, sgl.ProgramError) and isinstance(error.cause, sgl.UnsupportedFeature)
    assert "takes no videos" in str(error)


def test_openai_with_server_extensions_sends_video_url_parts(make_server: Any) -> None:
    pytest.importorskip("openai")
    server = make_server(RULES)
    api = sgl.OpenAI("toy-chat", base_url=server.url + "/v1", max_retries=0)
    describe_video.run(video=MP4, backend=api).sync()
    content = server.core.openai_requests[-1]["messages"][0]["content"]
    assert content[0]["video_url"]["url"] == "data:video/mp4;base64," + b64(MP4)
    assert content[1] == {"type": "text", "text": "What happens?"}


def test_openai_completion_models_refuse_video(make_server: Any) -> None:
    pytest.importorskip("openai")
    server = make_server(RULES)
    api = sgl.OpenAI("toy-base", base_url=server.url + "/v1", is_chat_model=False, max_retries=0)

    @sgl.function
    def prog(s: Any) -> None:
        s += sgl.video(MP4) + "What happens?" + sgl.gen("x", max_tokens=2)

    error = prog.run(backend=api).error()
    assert error is not None and isinstance(error.cause, sgl.UnsupportedFeature)
