"""Images and videos: chat content parts become the model's placeholders and the request's
image_data / video_data; /generate passes them to the engine; refusals name the field."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import server_fake_engine as fake  # loaded by conftest.py

from radixlm.server import ServerConfig

CHAT = "/v1/chat/completions"
PNG = "data:image/png;base64,iVBORw0KGgo="
MP4 = "data:video/mp4;base64,AAAAIGZ0eXBpc29t"


@pytest.fixture
def vision(make_server: Callable[..., tuple[Any, Any]]) -> Iterator[tuple[httpx.Client, Any]]:
    """A client of a server on the vision fake, and that fake."""
    live, engine = make_server(ServerConfig(), vision=True)
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client, engine


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def prompt_of(engine: Any) -> str:
    return str(engine.tokenizer.decode(engine.received[-1].input_ids))


def test_image_parts_become_placeholders_where_they_sit(
    vision: tuple[httpx.Client, Any], tokenizer: Any
) -> None:
    http, engine = vision
    messages = user(text("Compare "), image(PNG), text(" with "), image("https://x/b.png"))
    answer = http.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    rendered = [{"role": "user", "content": "Compare <image> with <image>"}]
    expected = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert prompt_of(engine) == expected
    assert engine.received[-1].image_data == [PNG, "https://x/b.png"]
    assert engine.received[-1].video_data is None


def test_image_url_may_be_a_bare_string_and_detail_is_ignored(
    vision: tuple[httpx.Client, Any],
) -> None:
    http, engine = vision
    messages = user(
        {"type": "image_url", "image_url": PNG}, image("https://x/b.png", detail="low"), text("?")
    )
    assert http.post(CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200
    assert engine.received[-1].image_data == [PNG, "https://x/b.png"]
    assert "<image><image>\n?" in prompt_of(engine)


def test_text_right_after_an_image_starts_a_new_line(vision: tuple[httpx.Client, Any]) -> None:
    http, engine = vision
    messages = user(image(PNG), text("What colour is the square?"))
    assert http.post(CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200
    assert "<image>\nWhat colour is the square?" in prompt_of(engine)


def test_video_parts_go_to_video_data(vision: tuple[httpx.Client, Any]) -> None:
    http, engine = vision
    messages = user({"type": "video_url", "video_url": {"url": MP4}}, text("What happens?"))
    assert http.post(CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200
    assert engine.received[-1].video_data == [MP4]
    assert engine.received[-1].image_data is None
    assert "<video>\nWhat happens?" in prompt_of(engine)


def test_media_of_several_messages_keep_the_conversation_order(
    vision: tuple[httpx.Client, Any],
) -> None:
    http, engine = vision
    messages = [
        {"role": "user", "content": [image("https://x/1.png"), text("first")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [text("then"), image("https://x/2.png")]},
    ]
    assert http.post(CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200
    assert engine.received[-1].image_data == ["https://x/1.png", "https://x/2.png"]


def test_text_only_content_is_unchanged_on_a_vision_model(
    vision: tuple[httpx.Client, Any], tokenizer: Any
) -> None:
    http, engine = vision
    messages = [{"role": "user", "content": "Hello"}]
    assert http.post(CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt_of(engine) == expected
    assert engine.received[-1].image_data is None and engine.received[-1].video_data is None


def test_the_openai_client_sends_images(make_server: Callable[..., tuple[Any, Any]]) -> None:
    live, engine = make_server(ServerConfig(served_model_name="vlm"), vision=True)
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    content: Any = [text("<<say:a red square:say>>"), image(PNG, detail="high")]
    result = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content}]
    )
    assert result.choices[0].message.content == "a red square"
    assert engine.received[-1].image_data == [PNG]


def test_streamed_chat_with_an_image(vision: tuple[httpx.Client, Any]) -> None:
    http, engine = vision
    body = {"messages": user(image(PNG), text("<<say:hi:say>>")), "stream": True}
    with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert engine.received[-1].image_data == [PNG]


@pytest.mark.parametrize(
    ("part", "kind"),
    [(image(PNG), "images"), ({"type": "video_url", "video_url": MP4}, "videos")],
)
def test_a_text_only_model_refuses_media_naming_the_part(
    http: httpx.Client, part: dict[str, Any], kind: str
) -> None:
    answer = http.post(CHAT, json={"messages": user(text("Look:"), part)})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages.0.content.1"
    assert f"does not take {kind}" in error["message"]


def test_audio_input_is_refused_as_not_supported_yet(vision: tuple[httpx.Client, Any]) -> None:
    http, _ = vision
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    answer = http.post(CHAT, json={"messages": user(text("Listen:"), audio)})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages.0.content.1"
    assert "audio input is not supported yet" in error["message"]


@pytest.mark.parametrize("role", ["system", "assistant"])
def test_media_outside_user_messages_is_refused(
    vision: tuple[httpx.Client, Any], role: str
) -> None:
    http, _ = vision
    messages = [{"role": role, "content": [text("see"), image(PNG)]}, *user(text("hi"))]
    answer = http.post(CHAT, json={"messages": messages})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages.0.content.1"
    assert "only taken in user messages" in answer.json()["error"]["message"]


def test_an_image_part_without_a_url_is_refused(vision: tuple[httpx.Client, Any]) -> None:
    http, _ = vision
    answer = http.post(CHAT, json={"messages": user({"type": "image_url"})})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages.0.content.0"


def test_the_engines_error_about_an_image_names_its_content_part(
    vision: tuple[httpx.Client, Any],
) -> None:
    http, _ = vision
    messages = [
        {"role": "user", "content": [image(PNG), text("and")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [text("this:"), image("https://x/broken.png")]},
    ]
    answer = http.post(CHAT, json={"messages": messages})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages.2.content.1"


def test_the_engines_error_about_the_only_image_names_its_part(
    vision: tuple[httpx.Client, Any],
) -> None:
    http, _ = vision
    answer = http.post(CHAT, json={"messages": user(text("see"), image("https://x/broken.png"))})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages.0.content.1"


def test_a_placeholder_typed_into_the_text_is_the_engines_to_refuse(
    vision: tuple[httpx.Client, Any],
) -> None:
    http, _ = vision
    messages = user(text("<image> twice"), image(PNG), image(PNG))
    answer = http.post(CHAT, json={"messages": messages})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages"
    assert "placeholders" in answer.json()["error"]["message"]


def test_model_info_names_the_placeholders(
    vision: tuple[httpx.Client, Any], http: httpx.Client
) -> None:
    vision_http, _ = vision
    info = vision_http.get("/get_model_info").json()
    assert (info["image_token"], info["video_token"]) == (fake.IMAGE_TOKEN, fake.VIDEO_TOKEN)
    text_only = http.get("/get_model_info").json()
    assert text_only["image_token"] is None and text_only["video_token"] is None


# /generate


def test_generate_passes_image_and_video_data_to_the_engine(
    vision: tuple[httpx.Client, Any],
) -> None:
    http, engine = vision
    body = {"text": "<image> then <video>", "image_data": PNG, "video_data": [MP4]}
    answer = http.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1}})
    assert answer.status_code == 200, answer.text
    assert (engine.received[-1].image_data, engine.received[-1].video_data) == (PNG, [MP4])


def test_generate_splits_media_per_batch_item(vision: tuple[httpx.Client, Any]) -> None:
    http, engine = vision
    body = {
        "text": ["<image>", "<image><image>"],
        "image_data": [PNG, [PNG, "https://x/b.png"]],
        "sampling_params": {"max_new_tokens": 1},
    }
    assert http.post("/generate", json=body).status_code == 200
    by_prompt = {r.text: r.image_data for r in engine.received[-2:]}
    assert by_prompt == {"<image>": PNG, "<image><image>": [PNG, "https://x/b.png"]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "<image><image>", "image_data": [PNG, "https://x/broken.png"]}, "image_data[1]"),
        ({"text": "<image>", "image_data": "https://x/broken.png"}, "image_data"),
        ({"text": "no placeholder", "image_data": PNG}, "image_data"),
        ({"text": "<video>", "video_data": ["https://x/broken.mp4"]}, "video_data"),
    ],
)
def test_generate_media_errors_are_400_naming_the_field(
    vision: tuple[httpx.Client, Any], body: dict[str, Any], param: str
) -> None:
    http, _ = vision
    for stream in (False, True):
        answer = http.post("/generate", json={**body, "stream": stream})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param


def test_generate_media_on_a_text_only_model_is_400(http: httpx.Client) -> None:
    answer = http.post("/generate", json={"text": "<image>", "image_data": PNG})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "image_data"
