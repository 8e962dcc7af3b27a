"""Measure the built-in vision model's accuracy through radixlm (not transformers).

    HF_HUB_OFFLINE=1 .venv/bin/python tools/demo_vision/evaluate.py [--model DIR] [--per-kind 40]

Fresh pictures from `images.py` (`--seed`, not the training seed), each question asked in the
demo's chat format (the image first) with greedy decoding through `radixlm.runtime.Engine`;
an answer counts when it is exactly the expected sentence. Prints the accuracy per kind and the
answers to the documented pictures in `examples/images/`.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from images import KINDS, examples, sample

from radixlm.runtime import Engine, builtin_vision_model_path

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "max_new_tokens": 40}


def prompt(engine: Engine, question: str) -> str:
    image = engine.model_info()["image_token"]
    messages = [{"role": "user", "content": f"{image}\n{question}"}]
    text: str = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return text


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(builtin_vision_model_path()))
    parser.add_argument("--per-kind", type=int, default=40)
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with Engine(args.model, show_progress=False) as engine:
        for kind in KINDS:
            tests = [sample(rng, kind) for _ in range(args.per_kind)]
            outs = engine.generate(
                [prompt(engine, s.question) for s in tests],
                GREEDY,
                image_data=[png(s.image) for s in tests],
            )
            right = 0
            for s, out in zip(tests, outs, strict=True):
                got = out["text"].strip()
                right += got == s.answer
                if got != s.answer:
                    print(f"  miss {kind}: expected {s.answer!r} got {got!r}")
            print(f"{kind:8s} {right}/{args.per_kind}", flush=True)
        for name, s in examples():
            image = Image.open(ROOT / "examples" / "images" / name).convert("RGB")
            out = engine.generate(prompt(engine, s.question), GREEDY, image_data=png(image))
            got = out["text"].strip()
            print(f"{'ok ' if got == s.answer else 'BAD'} {name}: {s.question!r} -> {got!r}")


if __name__ == "__main__":
    main()
