"""The SGLang paper's image workload for engine_bench.py (`--workloads llava_bench`): several
questions about each of N images on a dummy-weight LLaVA-shaped model, through radixlm,
radixlm without its caches and transformers' `LlavaForConditionalGeneration.generate`.

Every request is llava-1.5's prompt: a shared system prompt, then `USER: <image>` (one image,
576 positions at 336 px / patch 14), a short question and `ASSISTANT:`; greedy, 32 output
tokens (16 with --quick). All requests of the workload go in at once, grouped by image as in
llava-bench's question file. radixlm keys an image's positions by its content hash, so the
questions after the first about an image reuse the system prompt's and the image's KV, and its
vision-encoder cache (`mm_encoder_cache_size`) encodes each image once; radixlm-nocache turns
both off (`disable_radix_cache=True`, `mm_encoder_cache_size=0`). transformers has no prefix
cache: it runs `generate` on padded batches of up to --transformers-batch requests (left
padding), encoding every request's image.

radixlm runs the model directory's config with dummy weights (`load_format="dummy"`);
transformers builds `LlavaForConditionalGeneration(config)` with its own random weights (the
outputs' lengths are fixed, so their values do not matter).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

IMAGE_WORKLOADS = ("llava_bench",)
IMAGE_TOKEN = "<image>"

#: llava-1.5's conversation template (vicuna v1): its system prompt and roles.
SYSTEM_PROMPT = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
QUESTIONS = (
    "What is the main object in the image?",
    "Describe the colors of the shapes in this picture.",
    "How many rectangles can you see, and where are they?",
    "Which shape is the largest, and what color is it?",
    "What might this image be used for?",
    "Is there anything unusual about the layout of this image?",
    "Write a short caption for this picture.",
    "What is in the top left corner of the image?",
)

#: CLIP ViT-L/14-336 (llava-1.5's vision tower) and Llama-2-7B (Vicuna-7B, its decoder) with
#: llava-1.5-7b-hf's vocabulary (32,000 + the image and pad tokens, padded to 32,064).
CLIP_VIT_L14_336: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
LLAMA2_7B: dict[str, Any] = {
    "vocab_size": 32064,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
#: (vision tower, decoder) by --llava-shape. `llava-small` keeps the 336 px / patch 14 tower
#: (576 image positions per image) and the vocabulary, with narrow, shallow towers sized for
#: a 2-core CPU; the vision tower stays about a tenth of the decoder, as in llava-1.5-7b.
LLAVA_SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llava-1.5-7b": (CLIP_VIT_L14_336, LLAMA2_7B),
    "llava-small": (
        {
            **CLIP_VIT_L14_336,
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
        },
        {
            **LLAMA2_7B,
            "hidden_size": 512,
            "intermediate_size": 1376,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
        },
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """engine_bench's options of the image workload."""
    group = parser.add_argument_group("llava_bench (the image workload)")
    group.add_argument("--llava-shape", choices=sorted(LLAVA_SHAPES), help="default: "
                       "llava-small on CPU, llava-1.5-7b on a GPU")  # fmt: skip
    group.add_argument("--images", type=int, default=0, help="images (default 4 with "
                       "--quick, else 6, times --scale)")  # fmt: skip
    group.add_argument("--questions-per-image", type=int, default=0, help="default 4 with "
                       "--quick, else 5")  # fmt: skip
    group.add_argument("--transformers-batch", type=int, default=32, help="transformers: "
                       "requests per padded `generate` call")  # fmt: skip


def resolve(args: Any) -> None:
    """Fill in the image workload's defaults (after engine_bench's `resolve`)."""
    args.llava_shape = args.llava_shape or (
        "llava-1.5-7b" if args.device == "cuda" else "llava-small"
    )
    args.images = args.images or max(1, round((4 if args.quick else 6) * args.scale))
    args.questions_per_image = args.questions_per_image or (4 if args.quick else 5)


# ---------------------------------------------------------------------------- the workload


@dataclass
class ImageCall:
    """One question about one image. `prompt` is the cache key of the prompt (the image's
    positions spelled as ids of that image alone), for `optimal_hit_rate`."""

    text: str
    image: bytes
    prompt: list[int]
    params: dict[str, Any]
    outputs: list[list[int]] = field(default_factory=list)  # filled by a system


class ImageWorkloads:
    """llava_bench's calls for one model directory: `images` pictures, `questions` each."""

    def __init__(self, workdir: Path, args: Any) -> None:
        from transformers import AutoTokenizer

        from radixlm.runtime.fixtures_vision import make_image

        self.tokenizer = AutoTokenizer.from_pretrained(str(workdir))
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        vision = LLAVA_SHAPES[args.llava_shape][0]
        self.tokens_per_image = (vision["image_size"] // vision["patch_size"]) ** 2
        self.out = 16 if args.quick else 32
        self.images = [make_image(args.seed * 1000 + k, size=512) for k in range(args.images)]
        self.questions = args.questions_per_image

    def text(self, image: int, question: int) -> str:
        asked = QUESTIONS[(image + question) % len(QUESTIONS)]
        return f"{SYSTEM_PROMPT} USER: {IMAGE_TOKEN}\n{asked} ASSISTANT:"

    def key(self, text: str, image: int) -> list[int]:
        """The prompt's ids with the image token expanded to ids no other image has."""
        base = (1 << 40) + image * self.tokens_per_image
        ids: list[int] = []
        for token in self.tokenizer(text)["input_ids"]:
            if token == self.image_token_id:
                ids += range(base, base + self.tokens_per_image)
            else:
                ids.append(token)
        return ids

    def llava_bench(self, run: Callable[[list[ImageCall]], None]) -> list[ImageCall]:
        params = {"temperature": 0, "max_new_tokens": self.out, "ignore_eos": True}
        calls = []
        for i, image in enumerate(self.images):
            for q in range(self.questions):
                text = self.text(i, q)
                calls.append(ImageCall(text, image, self.key(text, i), dict(params)))
        run(calls)
        return calls


def write_model_dir(args: Any) -> Path:
    """A LLaVA model directory without weights: config.json of args.llava_shape, the tests'
    tiny tokenizer with `<image>`, a LlavaProcessor (CLIPImageProcessor at the tower's size)."""
    import transformers

    from radixlm.runtime.fixtures import EOS_TOKEN, build_tiny_tokenizer

    vision, text = LLAVA_SHAPES[args.llava_shape]
    workdir = Path(tempfile.mkdtemp(prefix="engine_bench_llava_"))
    tokenizer = build_tiny_tokenizer(workdir)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.save_pretrained(str(workdir))
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    size = vision["image_size"]
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision),
        text_config=transformers.LlamaConfig(
            **text, eos_token_id=eos, bos_token_id=eos, pad_token_id=tokenizer.pad_token_id
        ),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(size // vision["patch_size"]) ** 2,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
    )
    config.save_pretrained(str(workdir))
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    transformers.LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=processor,
        tokenizer=tokenizer,
        patch_size=vision["patch_size"],
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    ).save_pretrained(str(workdir))
    (workdir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return workdir


# ------------------------------------------------------------------------------- systems


class RadixImageSystem:
    """radixlm on a thread, on a runner shared by the radixlm systems (reset between them)."""

    def __init__(self, name: str, runner: Any, cache: bool, args: Any) -> None:
        from radixlm.runtime import Engine

        runner.reset()
        self.name = name
        self.runner = runner
        self.forwards = runner.stats.forward_calls
        self.engine: Any = Engine(
            runner=runner,
            show_progress=False,
            disable_radix_cache=not cache,
            mm_encoder_cache_size=128 if cache else 0,
            max_running_requests=runner.req_to_token_pool.max_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_policy=args.schedule_policy,
        )

    def generate(self, calls: list[ImageCall]) -> None:
        outs = self.engine.generate(
            [c.text for c in calls],
            [c.params for c in calls],
            image_data=[[c.image] for c in calls],
        )
        for call, out in zip(calls, outs, strict=True):
            call.outputs = [out["output_ids"]]
            # The optimal hit rate is computed on the keys: they must be the engine's prompts.
            if out["meta_info"]["prompt_tokens"] != len(call.prompt):
                raise RuntimeError(
                    f"radixlm's prompt has {out['meta_info']['prompt_tokens']} tokens, the "
                    f"workload's key {len(call.prompt)}: the key does not match the prompt"
                )

    @property
    def media_encoded(self) -> int:
        return int(self.engine.server_info()["media_encoded"])

    def hit_rate(self) -> float:
        return float(self.engine.server_info()["cache_hit_rate"])

    def extra(self) -> str:
        info = self.engine.server_info()
        forwards = info["forward_passes"] - self.forwards
        return (
            f"forwards={forwards} encoder_runs={info['media_encoded']} "
            f"encoder_cache_hits={info['media_encoder_cache_hits']}"
        )

    def close(self) -> None:
        self.engine.shutdown()
        self.engine = self.runner = None  # the runner's memory goes back with the last one


class TransformersImageSystem:
    """transformers' `generate` on padded batches (left padding) of the workload's requests,
    in its order; each request's image goes through the processor and the vision tower."""

    name = "transformers"

    def __init__(self, model: Any, processor: Any, batch: int) -> None:
        self.model = model
        self.processor = processor
        self.batch = batch
        self.encoded = 0

    def generate(self, calls: list[ImageCall]) -> None:
        from PIL import Image

        for start in range(0, len(calls), self.batch):
            group = calls[start : start + self.batch]
            images = [Image.open(io.BytesIO(c.image)).convert("RGB") for c in group]
            inputs = self.processor(
                text=[c.text for c in group], images=images, padding=True, return_tensors="pt"
            ).to(self.model.device)
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
            tokens = group[0].params["max_new_tokens"]
            with torch.no_grad():
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=self.processor.tokenizer.pad_token_id,
                )
            prompt = inputs["input_ids"].shape[1]
            for call, row in zip(group, out[:, prompt:].tolist(), strict=True):
                call.outputs = [row]
            self.encoded += len(group)

    @property
    def media_encoded(self) -> int:
        return self.encoded

    def hit_rate(self) -> float:
        return float("nan")

    def extra(self) -> str:
        return f"encoder_runs={self.encoded} batch={self.batch}"

    def close(self) -> None:
        self.model = None


def build_runner(workdir: Path, max_total_tokens: int, args: Any) -> Any:
    """radixlm's runner on the directory's config with dummy weights."""
    from radixlm.runtime import (
        AttentionConfig,
        MemoryConfig,
        ModelConfig,
        ModelRunner,
        RunnerConfig,
    )

    config = RunnerConfig(
        model=ModelConfig(
            str(workdir),
            dtype=args.dtype,
            device=args.device,
            load_format="dummy",
            show_progress=False,
        ),
        memory=MemoryConfig(max_total_tokens=max_total_tokens, max_running_requests=128),
        attention=AttentionConfig(
            backend="torch_native" if args.device == "cpu" else "auto",
            cuda_graph=not args.disable_cuda_graph,
        ),
    )
    return ModelRunner(config)


def build_transformers(workdir: Path, args: Any) -> tuple[Any, Any]:
    """`LlavaForConditionalGeneration(config)` with random weights (seed 0) on the device,
    in eval mode, and the directory's processor (left padding)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(workdir))
    with torch.device(args.device):
        model = AutoModelForImageTextToText.from_config(  # type: ignore[no-untyped-call]
            config, dtype=getattr(torch, args.dtype)
        )
    processor = AutoProcessor.from_pretrained(str(workdir))  # type: ignore[no-untyped-call]
    processor.tokenizer.padding_side = "left"
    return model.eval(), processor


def warm_up(system: Any, source: ImageWorkloads) -> None:
    """One untimed request on another picture (first-call costs, Triton compilation)."""
    from radixlm.runtime.fixtures_vision import make_image

    text, other = source.text(0, 0), len(source.images)
    params = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    image = make_image(10**6, size=512)
    system.generate([ImageCall(text, image, source.key(text, other), params)])


def systems(workdir: Path, source: ImageWorkloads, args: Any) -> Iterator[Any]:
    """The systems, built one at a time: radixlm, radixlm-nocache (--skip-no-cache), then,
    with radixlm's runner released, transformers (--skip-transformers). The caller closes each
    and drops it before asking for the next."""
    # Room for every request's prompt and output at once (radixlm-nocache shares nothing).
    calls = source.llava_bench(lambda calls: None)
    tokens = sum(len(c.prompt) + c.params["max_new_tokens"] for c in calls) + 1024
    runner = build_runner(workdir, tokens, args)
    warm = RadixImageSystem("warmup", runner, True, args)
    try:
        warm_up(warm, source)
    finally:
        warm.close()
    yield RadixImageSystem("radixlm", runner, True, args)
    if not args.skip_no_cache:
        yield RadixImageSystem("radixlm-nocache", runner, False, args)
    del runner, warm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_transformers:
        model, processor = build_transformers(workdir, args)
        system = TransformersImageSystem(model, processor, args.transformers_batch)
        warm_up(system, source)
        system.encoded = 0
        del model
        yield system


# ------------------------------------------------------------------------------ printing


def describe(source: ImageWorkloads, args: Any) -> str:
    vision, text = LLAVA_SHAPES[args.llava_shape]
    return (
        f"{args.images} images x {args.questions_per_image} questions, {source.out} output "
        f"tokens each, {source.tokens_per_image} positions per image; {args.llava_shape}: "
        f"CLIP {vision['num_hidden_layers']} layers hidden {vision['hidden_size']} "
        f"({vision['image_size']} px / patch {vision['patch_size']}), Llama "
        f"{text['num_hidden_layers']} layers hidden {text['hidden_size']} vocab "
        f"{text['vocab_size']}; dummy weights, {args.dtype} on {args.device}"
    )


def report(rows: list[dict[str, Any]]) -> None:
    """The image workload's rows side by side: requests/s, output tokens/s, radixlm's
    throughput over the system's, hit rate, vision-encoder runs; then the optimal hit rate."""
    rows = [r for r in rows if r["workload"] in IMAGE_WORKLOADS]
    if not rows:
        return
    by = {r["system"]: r for r in rows}
    base = by.get("radixlm")
    print()
    print(f"llava_bench: {rows[0]['describe']}")
    head = f"{'system':16s} {'req/s':>8s} {'out tok/s':>10s} {'x radixlm':>10s}"
    head += f" {'hit rate':>9s} {'encoder runs':>13s}"
    print(head)
    print("-" * len(head))
    for row in rows:
        ratio = f"{base['requests_per_s'] / row['requests_per_s']:9.2f}x" if base else "-"
        hit = "-" if math.isnan(row["hit_rate"]) else f"{row['hit_rate']:.1%}"
        print(
            f"{row['system']:16s} {row['requests_per_s']:8.2f} "
            f"{row['output_tokens_per_s']:10.1f} {ratio:>10s} {hit:>9s} "
            f"{row['media_encoded']:13d}"
        )
    print(f"optimal hit rate: {rows[0]['optimal_hit_rate']:.1%}")
