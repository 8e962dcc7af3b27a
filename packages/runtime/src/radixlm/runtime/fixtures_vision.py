"""Tiny random vision-language checkpoints for tests and benchmarks (nothing downloaded):
a LLaVA with a CLIP or SigLIP tower, its tokenizer (with the image token) and its image
processor, saved as a Hugging Face model directory."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

from radixlm.runtime.fixtures import EOS_TOKEN, build_tiny_tokenizer

IMAGE_TOKEN = "<image>"


def build_tiny_llava(
    path: str | Path,
    text_architecture: str = "LlamaForCausalLM",
    vision: str = "clip",
    image_size: int = 32,
    patch_size: int = 8,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_layers: int = 2,
    strategy: str = "default",
    feature_layer: int | list[int] = -2,
    seed: int = 0,
    init_std: float = 0.5,
) -> Path:
    """Write a random `LlavaForConditionalGeneration` into `path`; returns `path`."""
    import torch
    import transformers

    path = Path(path)
    tokenizer = build_tiny_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.save_pretrained(str(path))
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    text_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
    }[text_architecture]
    text = text_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=init_std,
    )
    vision_fields: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        initializer_range=init_std,
    )
    if vision == "clip":
        vision_config: Any = transformers.CLIPVisionConfig(projection_dim=32, **vision_fields)
        processor: Any = transformers.CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        )
    else:
        vision_config = transformers.SiglipVisionConfig(**vision_fields)
        processor = transformers.SiglipImageProcessor(
            size={"height": image_size, "width": image_size}
        )
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text,
        image_token_index=image_id,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer,
        image_seq_length=(image_size // patch_size) ** 2,
        architectures=["LlavaForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(str(path))
    transformers.LlavaProcessor(
        image_processor=processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1 if vision == "clip" else 0,
    ).save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), "utf-8")
    return path


def make_image(seed: int, size: int = 48) -> bytes:
    """A PNG of random coloured rectangles (different seeds, different pictures)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = rng.randrange(size), rng.randrange(size)
        x1, y1 = min(size, x0 + rng.randrange(4, size)), min(size, y0 + rng.randrange(4, size))
        draw.rectangle((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
