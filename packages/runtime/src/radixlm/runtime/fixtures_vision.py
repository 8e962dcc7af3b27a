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
        vision_feature_select_strategy=strategy,  # type: ignore[arg-type]
        vision_feature_layer=feature_layer,
        image_seq_length=(image_size // patch_size) ** 2,
        architectures=["LlavaForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model: Any = transformers.LlavaForConditionalGeneration(config)
    model = model.to(torch.float32).eval()
    model.save_pretrained(str(path))
    transformers.LlavaProcessor(  # type: ignore[no-untyped-call]
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


QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: One image / one video in a Qwen2-VL prompt.
QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN2_VL_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def build_tiny_qwen2_vl(
    path: str | Path,
    version: str = "2",
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 2,
    vision_width: int = 32,
    patch_size: int = 4,
    min_pixels: int = 4 * 8 * 8,
    max_pixels: int = 36 * 8 * 8,
    tokens_per_second: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
) -> Path:
    """Write a random `Qwen2VLForConditionalGeneration` (`version` "2") or
    `Qwen2_5_VLForConditionalGeneration` ("2.5") into `path`; returns `path`.

    With the defaults a 32-56 px image takes 16-36 positions (merge 2 x 2 of 4 px patches,
    images resized to 256-2304 pixels); Qwen2.5-VL's windows are 2 x 2 merged positions and
    its second block attends to whole frames. `init_std` keeps logits peaked while float32
    rounding (1e-6 in image embeddings) stays far below 1e-4 in them. The directory holds the
    image and video processors' settings and a `Qwen2VLProcessor` / `Qwen2_5_VLProcessor`
    config (transformers loads that processor where torchvision is installed).
    """
    import torch
    import transformers

    if version not in ("2", "2.5"):
        raise ValueError(f"version must be '2' or '2.5'; got {version!r}")
    path = Path(path)
    tokenizer = build_tiny_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_TOKENS)})
    tokenizer.save_pretrained(str(path))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2_VL_TOKENS}
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    head_dim = hidden_size // 4
    third = head_dim // 2 // 3
    text: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 2 - 2 * third, third, third],
        },
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=init_std,
    )
    vision: dict[str, Any] = dict(
        depth=vision_depth,
        num_heads=4,
        patch_size=patch_size,
        temporal_patch_size=2,
        spatial_merge_size=2,
        initializer_range=init_std,
    )
    config_class: Any
    if version == "2":
        vision.update(embed_dim=vision_width, hidden_size=hidden_size, mlp_ratio=2)
        config_class, model_class = transformers.Qwen2VLConfig, "Qwen2VLForConditionalGeneration"
        processor_class = "Qwen2VLProcessor"
    else:
        vision.update(
            hidden_size=vision_width,
            intermediate_size=2 * vision_width,
            out_hidden_size=hidden_size,
            window_size=2 * 2 * patch_size,
            fullatt_block_indexes=[vision_depth - 1],
            tokens_per_second=tokens_per_second,
        )
        config_class = transformers.Qwen2_5_VLConfig
        model_class = "Qwen2_5_VLForConditionalGeneration"
        processor_class = "Qwen2_5_VLProcessor"
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        architectures=[model_class],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(torch.float32).eval()
    model.save_pretrained(str(path))
    # Transformers' processor needs torchvision for its video half, so the settings are
    # written as its save_pretrained writes them (the image processor saves its own).
    shared: dict[str, Any] = dict(
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    transformers.Qwen2VLImageProcessorPil(**shared).save_pretrained(str(path))
    image_settings = json.loads((path / "preprocessor_config.json").read_text("utf-8"))
    image_settings["processor_class"] = processor_class
    (path / "preprocessor_config.json").write_text(json.dumps(image_settings, indent=2), "utf-8")
    video_settings = {
        key: image_settings[key]
        for key in (
            "do_convert_rgb",
            "do_normalize",
            "do_rescale",
            "do_resize",
            "image_mean",
            "image_std",
            "resample",
            "rescale_factor",
        )
    }
    video_settings.update(
        shared,
        video_processor_type="Qwen2VLVideoProcessor",
        processor_class=processor_class,
        do_sample_frames=False,
        min_frames=4,
        max_frames=768,
    )
    (path / "video_preprocessor_config.json").write_text(
        json.dumps(video_settings, indent=2), "utf-8"
    )
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class}, indent=2), "utf-8"
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), "utf-8")
    return path
