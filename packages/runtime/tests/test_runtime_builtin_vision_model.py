"""The built-in vision model ships with the package, answers the documented questions about
pictures like examples/images/, and answers what transformers answers on it."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
import transformers
from PIL import Image, ImageDraw

from radixlm.runtime import BUILTIN_VISION_MODEL_NAME, Engine, builtin_vision_model_path

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
GREY = (128, 128, 128)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def square(colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (64, 64), GREY)
    ImageDraw.Draw(image).rectangle((16, 16, 48, 48), fill=colour)
    return image


def circles(count: int) -> Image.Image:
    image = Image.new("RGB", (64, 64), GREY)
    draw = ImageDraw.Draw(image)
    spots = [(16, 19), (46, 22), (29, 47), (50, 50), (14, 48)][:count]
    for x, y in spots:
        draw.ellipse((x - 6, y - 6, x + 6, y + 6), fill=(35, 75, 225))
    return image


def prompt(question: str) -> str:
    return f"<|im_start|>user\n<image>\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(builtin_vision_model_path(), show_progress=False) as engine:
        yield engine


def test_the_builtin_vision_model_has_a_name_and_an_image_token(engine: Engine) -> None:
    assert BUILTIN_VISION_MODEL_NAME == "radixlm-demo-vision"
    assert engine.model_info()["image_token"] == "<image>"


def test_what_colour_is_the_square(engine: Engine) -> None:
    image = png(square((220, 35, 35)))
    out = engine.generate(prompt("What colour is the square?"), GREEDY, image_data=image)
    assert "red" in out["text"]


def test_how_many_circles_are_there(engine: Engine) -> None:
    out = engine.generate(prompt("How many circles are there?"), GREEDY, image_data=png(circles(3)))
    assert "3" in out["text"]


def test_it_still_knows_the_capital_of_france(engine: Engine) -> None:
    out = engine.generate("The capital of France is", {**GREEDY, "max_new_tokens": 4})
    assert out["text"].startswith(" Paris")


def test_its_greedy_answer_equals_transformers(engine: Engine) -> None:
    path = builtin_vision_model_path()
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = transformers.AutoProcessor.from_pretrained(path)
    text = prompt("What colour is the square?")
    inputs = processor(text=text, images=[square((35, 165, 55))], return_tensors="pt")
    with torch.no_grad():
        expected = hf.generate(**inputs, max_new_tokens=12, do_sample=False)
    ours = engine.generate(text, GREEDY, image_data=png(square((35, 165, 55))))
    assert ours["output_ids"] == expected[0, inputs["input_ids"].shape[1] :].tolist()[:12]
