"""Generate the synthetic images, questions and answers of radixlm's built-in vision model.

Small RGB images drawn with Pillow on a neutral grey background, each with one question from a
fixed set of templates and a short answer sentence. Deterministic for a given seed, so anyone can
rebuild the model.

    python3 tools/demo_vision/images.py --out /tmp/vision_samples --count 40   # look at the data
    python3 tools/demo_vision/images.py --examples examples/images             # the docs' PNGs

The question templates (the model knows only these, word for word):

    kind      question                          answer
    colour    What colour is the {shape}?       The {shape} is {colour}.
    shape     What shape is it?                 It is a {colour} {shape}.  (an orange ...)
    count     How many circles are there?       There are {n} circles.  (n = 1: There is 1 circle.)
    stripes   What colours are the stripes?     The stripes are {c1} and {c2}.
                                                The stripes are {c1}, {c2} and {c3}.
    digit     What digit is shown?              The digit is {d}.

Shapes are square, circle and triangle; colours are the eight names of COLOURS; counts are
1-5 circles; stripes are two or three vertical (listed left to right) or horizontal (listed top
to bottom) bands that fill the image; digits 0-9 are drawn with Pillow's default font (the
bundled FreeType font, so Pillow must have FreeType support).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = 64
JITTER = 3  # pixels a digit may move from the centre
MAX_STRIPES = 3

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 35, 35),
    "green": (35, 165, 55),
    "blue": (35, 75, 225),
    "yellow": (240, 220, 35),
    "orange": (245, 135, 25),
    "purple": (140, 55, 180),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
SHAPES = ("square", "circle", "triangle")
KINDS = ("colour", "shape", "count", "stripes", "digit")

QUESTIONS = {
    "colour": "What colour is the {shape}?",
    "shape": "What shape is it?",
    "count": "How many circles are there?",
    "stripes": "What colours are the stripes?",
    "digit": "What digit is shown?",
}


@dataclass(frozen=True)
class Sample:
    """One training or test example: an image, a question about it and the expected answer."""

    kind: str
    image: Image.Image
    question: str
    answer: str
    stripes: tuple[str, ...] = ()  # stripes: the colours, left to right or top to bottom


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int = 12) -> tuple[int, ...]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)


def _background(rng: random.Random, size: int) -> Image.Image:
    grey = rng.randint(112, 144)
    return Image.new("RGB", (size, size), (grey, grey, grey))


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: tuple[int, ...]
) -> None:
    x0, y0, x1, y1 = box
    if shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif shape == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def shape_image(shape: str, colour: str, rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    """One shape of a named colour, of random size and position, on a grey background."""
    image = _background(rng, size)
    side = rng.randint(size * 3 // 8, size * 11 // 16)
    x0 = rng.randint(2, size - side - 2)
    y0 = rng.randint(2, size - side - 2)
    _draw_shape(
        ImageDraw.Draw(image), shape, (x0, y0, x0 + side, y0 + side), _jitter(COLOURS[colour], rng)
    )
    return image


def circles_image(count: int, rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    """`count` non-overlapping circles of random colours and sizes on a grey background."""
    while True:  # rejection sampling; five circles fit easily, so this ends fast
        circles: list[tuple[float, float, float]] = []
        for _ in range(200):
            if len(circles) == count:
                break
            r = rng.uniform(size * 0.09, size * 0.11)  # similar sizes: more circles, more colour
            x, y = rng.uniform(r + 1, size - r - 1), rng.uniform(r + 1, size - r - 1)
            if all((x - a) ** 2 + (y - b) ** 2 > (r + c + 3) ** 2 for a, b, c in circles):
                circles.append((x, y, r))
        if len(circles) == count:
            break
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    names = list(COLOURS)
    for x, y, r in circles:
        draw.ellipse((x - r, y - r, x + r, y + r), fill=_jitter(COLOURS[rng.choice(names)], rng))
    return image


def stripes_image(
    colours: list[str], vertical: bool, rng: random.Random | None = None, size: int = IMAGE_SIZE
) -> Image.Image:
    """Bands of the given colours filling the image, left to right or top to bottom."""
    image = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(image)
    n = len(colours)
    for i, name in enumerate(colours):
        lo, hi = round(i * size / n), round((i + 1) * size / n)
        fill = _jitter(COLOURS[name], rng) if rng else COLOURS[name]
        box = (lo, 0, hi - 1, size - 1) if vertical else (0, lo, size - 1, hi - 1)
        draw.rectangle(box, fill=fill)
    return image


@lru_cache(maxsize=64)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def digit_image(digit: int, rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    """A large digit in Pillow's default font, of random colour, near the centre, on grey.

    Size and position vary only a little: a vision tower this small, trained this briefly,
    learns digits in one place well and digits anywhere poorly."""
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    font = _font(rng.randint(size * 15 // 16, size * 17 // 16))
    left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font, stroke_width=1)
    x = (size - (right - left)) // 2 - left + rng.randint(-JITTER, JITTER)
    y = (size - (bottom - top)) // 2 - top + rng.randint(-JITTER, JITTER)
    fill = _jitter(COLOURS[rng.choice(list(COLOURS))], rng)
    draw.text((x, y), str(digit), font=font, fill=fill, stroke_width=1, stroke_fill=fill)
    return image


def colour_answer(shape: str, colour: str) -> str:
    return f"The {shape} is {colour}."


def shape_answer(shape: str, colour: str) -> str:
    article = "an" if colour[0] in "aeiou" else "a"
    return f"It is {article} {colour} {shape}."


def count_answer(n: int) -> str:
    return "There is 1 circle." if n == 1 else f"There are {n} circles."


def stripes_answer(colours: list[str]) -> str:
    listed = colours[0] if len(colours) == 1 else ", ".join(colours[:-1]) + " and " + colours[-1]
    return f"The stripes are {listed}."


def digit_answer(d: int) -> str:
    return f"The digit is {d}."


def answers(kind: str) -> list[str]:
    """Every answer a question of `kind` can have (stripes: 392 of them)."""
    if kind == "colour":
        return [colour_answer(s, c) for s in SHAPES for c in COLOURS]
    if kind == "shape":
        return [shape_answer(s, c) for s in SHAPES for c in COLOURS]
    if kind == "count":
        return [count_answer(n) for n in range(1, 6)]
    if kind == "stripes":
        names = list(COLOURS)
        pairs = [[a, b] for a in names for b in names if a != b]
        return [stripes_answer(p) for p in pairs] + [
            stripes_answer([*p, c]) for p in pairs for c in names if c not in p
        ]
    if kind == "digit":
        return [digit_answer(d) for d in range(10)]
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def sample(rng: random.Random, kind: str | None = None, size: int = IMAGE_SIZE) -> Sample:
    """One random sample of `kind` (one of KINDS), or of a random kind."""
    kind = kind or rng.choice(KINDS)
    names = list(COLOURS)
    if kind in ("colour", "shape"):
        shape, colour = rng.choice(SHAPES), rng.choice(names)
        image = shape_image(shape, colour, rng, size)
        if kind == "colour":
            question = QUESTIONS[kind].format(shape=shape)
            return Sample(kind, image, question, colour_answer(shape, colour))
        return Sample(kind, image, QUESTIONS[kind], shape_answer(shape, colour))
    if kind == "count":
        n = rng.randint(1, 5)
        return Sample(kind, circles_image(n, rng, size), QUESTIONS[kind], count_answer(n))
    if kind == "stripes":
        colours = rng.sample(names, rng.randint(2, MAX_STRIPES))
        image = stripes_image(colours, rng.random() < 0.5, rng, size)
        return Sample(kind, image, QUESTIONS[kind], stripes_answer(colours), tuple(colours))
    if kind == "digit":
        d = rng.randrange(10)
        return Sample(kind, digit_image(d, rng, size), QUESTIONS[kind], digit_answer(d))
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def samples(seed: int, count: int, size: int = IMAGE_SIZE) -> list[Sample]:
    """`count` samples of random kinds, deterministic for `seed`."""
    rng = random.Random(seed)
    return [sample(rng, size=size) for _ in range(count)]


def examples(size: int = IMAGE_SIZE) -> list[tuple[str, Sample]]:
    """The fixed example images of the documentation, with file names."""
    red_square = Image.new("RGB", (size, size), (128, 128, 128))
    quarter = size // 4
    _draw_shape(
        ImageDraw.Draw(red_square),
        "square",
        (quarter, quarter, size - quarter, size - quarter),
        COLOURS["red"],
    )
    three = Image.new("RGB", (size, size), (128, 128, 128))
    draw = ImageDraw.Draw(three)
    r = size * 0.1
    for (fx, fy), colour in zip(
        [(0.25, 0.3), (0.72, 0.35), (0.45, 0.74)], ["blue", "yellow", "green"], strict=True
    ):
        x, y = fx * size, fy * size
        draw.ellipse((x - r, y - r, x + r, y + r), fill=COLOURS[colour])
    flag_colours = ["blue", "white", "red"]
    return [
        (
            "red_square.png",
            Sample(
                "colour",
                red_square,
                QUESTIONS["colour"].format(shape="square"),
                "The square is red.",
            ),
        ),
        ("three_circles.png", Sample("count", three, QUESTIONS["count"], "There are 3 circles.")),
        (
            "flag.png",
            Sample(
                "stripes",
                stripes_image(flag_colours, True, None, size),
                QUESTIONS["stripes"],
                "The stripes are blue, white and red.",
            ),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write COUNT sample PNGs and samples.jsonl here")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=Path, help="write the documentation's example PNGs here")
    args = parser.parse_args()
    if args.out is None and args.examples is None:
        parser.error("give --out and/or --examples")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "samples.jsonl", "w", encoding="utf-8") as f:
            for i, s in enumerate(samples(args.seed, args.count)):
                name = f"{i:04d}_{s.kind}.png"
                s.image.save(args.out / name)
                f.write(
                    json.dumps({"image": name, "question": s.question, "answer": s.answer}) + "\n"
                )
        print(f"wrote {args.count} samples to {args.out}")
    if args.examples is not None:
        args.examples.mkdir(parents=True, exist_ok=True)
        for name, s in examples():
            s.image.save(args.examples / name)
            print(f"{args.examples / name}: {s.question} -> {s.answer}")


if __name__ == "__main__":
    main()
