"""Train radixlm's built-in vision model `radixlm-demo-vision`: a tiny LLaVA, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/demo_vision/train.py --out DIR

A transformers `LlavaForConditionalGeneration`: a small CLIP vision tower (64×64 images, 16×16
patches, so 16 image tokens once the CLS token is dropped), LLaVA's two-layer GELU projector, and
the built-in demo Llama (packages/runtime/src/radixlm/runtime/builtin_model) as the language
model, starting from its trained weights with one more token, `<image>`. The training data are
the generated images and questions of tools/demo_vision/images.py in the demo's ChatML-style
chat format, mixed with the demo's text corpus (tools/demo_model/corpus.py) so that the text
abilities survive.

Two stages: (1) the vision tower and projector alone, with a throwaway classification head on
their features (what CLIP pretraining is to a real LLaVA; cheap, the language model is not in
the loop); (2) everything, on the chat-format questions and the text corpus, the vision side at
a higher learning rate than the language model.

At the end the script saves a Hugging Face directory (model.safetensors in float32, config,
generation config, tokenizer, processor, chat template), loads it back offline through
`AutoProcessor` / `LlavaForConditionalGeneration.from_pretrained`, and checks with greedy
decoding: the accuracy per question kind on freshly generated images (another seed), the
documentation's example images and the demo's text examples.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerBase,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tools" / "demo_model"))
from corpus import SYSTEM_PROMPT, documents  # noqa: E402
from images import COLOURS, IMAGE_SIZE, KINDS, MAX_STRIPES, Sample, answers, examples, sample  # noqa: E402

TEXT_MODEL = REPO / "packages" / "runtime" / "src" / "radixlm" / "runtime" / "builtin_model"
EXAMPLE_IMAGES = REPO / "examples" / "images"
IMAGE_TOKEN = "<image>"
# 16×16 patches: 16 image tokens. With 8×8 patches (64 tokens) this tiny tower learns digits,
# shapes and counts several times slower per image, and every step costs about twice as much.
PATCH_SIZE = 16
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLS dropped ("default" strategy)
# How often each kind of question is drawn: in stage 1 (the vision tower alone) and stage 2.
PRETRAIN_WEIGHTS = {"colour": 0.05, "shape": 0.2, "count": 0.3, "stripes": 0.2, "digit": 0.25}
KIND_WEIGHTS = {"colour": 0.08, "shape": 0.12, "count": 0.25, "stripes": 0.35, "digit": 0.2}
TEXT_CHECKS = [
    ("The capital of France is", " Paris"),
    ("Paris is the capital of", " France"),
    ("Here is the information of the capital of France in the JSON format.\n", '{"name":"Paris"'),
]


def user_content(question: str) -> str:
    """The user turn of an image question: the image first, then the question."""
    return f"{IMAGE_TOKEN}\n{question}"


def build_tokenizer() -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(TEXT_MODEL, local_files_only=True)
    added = tokenizer.add_tokens(
        [AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True
    )
    assert added == 1, "the demo tokenizer already has <image>"
    return tokenizer


def build_model(
    tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace
) -> LlavaForConditionalGeneration:
    text = LlamaForCausalLM.from_pretrained(TEXT_MODEL, local_files_only=True)
    old_vocab = text.config.vocab_size
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_token_id == old_vocab == len(tokenizer) - 1
    text_config = text.config
    text_config.vocab_size = len(tokenizer)
    vision_config = CLIPVisionConfig(
        hidden_size=args.vision_hidden,
        intermediate_size=4 * args.vision_hidden,
        num_hidden_layers=args.vision_layers,
        num_attention_heads=args.vision_heads,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_channels=3,
        projection_dim=text_config.hidden_size,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token_id,
        image_seq_length=NUM_IMAGE_TOKENS,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        multimodal_projector_bias=True,
        tie_word_embeddings=True,
    )
    model = LlavaForConditionalGeneration(config)
    # The language model: the demo's trained weights, plus one embedding row for <image> (its
    # value never reaches the model, image features replace it; as an output it starts at the mean).
    state = text.model.state_dict()
    old = state["embed_tokens.weight"]
    state["embed_tokens.weight"] = torch.cat([old, old.mean(0, keepdim=True)], dim=0)
    model.model.language_model.load_state_dict(state)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight, "untied lm_head"
    return model


def build_processor(tokenizer: PreTrainedTokenizerBase) -> LlavaProcessor:
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_resize=True,
        do_center_crop=True,
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token, dropped again by "default"
        chat_template=tokenizer.chat_template,
        image_token=IMAGE_TOKEN,
    )


_MEAN = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)
_STD = torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)


def pixel_values(images: list[Image.Image]) -> torch.Tensor:
    """What the processor computes for IMAGE_SIZE×IMAGE_SIZE RGB images, without its overhead."""
    array = np.stack([np.asarray(im, dtype=np.float32) for im in images]) / 255.0
    return (torch.from_numpy(array).permute(0, 3, 1, 2) - _MEAN) / _STD


class Encoder:
    """Token ids and labels (answer and <|im_end|> only) of image question samples, cached."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[tuple[str, str, bool], tuple[list[int], list[int]]] = {}

    def prompt(self, question: str, system: bool) -> str:
        messages = [{"role": "user", "content": user_content(question)}]
        if system:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return text.replace(IMAGE_TOKEN, IMAGE_TOKEN * NUM_IMAGE_TOKENS)  # as the processor does

    def encode(self, question: str, answer: str, system: bool) -> tuple[list[int], list[int]]:
        key = (question, answer, system)
        if key not in self.cache:
            prompt = self.prompt(question, system)
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ids = self.tokenizer(prompt + answer + "<|im_end|>", add_special_tokens=False)[
                "input_ids"
            ]
            assert ids[: len(prompt_ids)] == prompt_ids, "prompt tokens change with the answer"
            labels = [-100] * len(prompt_ids) + ids[len(prompt_ids) :]
            self.cache[key] = (ids, labels)
        return self.cache[key]


def image_batch(
    encoder: Encoder, rng: random.Random, size: int, pad_id: int
) -> tuple[dict[str, torch.Tensor], list[Sample]]:
    kinds = rng.choices(list(KIND_WEIGHTS), list(KIND_WEIGHTS.values()), k=size)
    batch = [sample(rng, kind) for kind in kinds]
    encoded = [encoder.encode(s.question, s.answer, rng.random() < 0.3) for s in batch]
    length = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((size, length), pad_id, dtype=torch.long)
    labels = torch.full((size, length), -100, dtype=torch.long)
    attention_mask = torch.zeros((size, length), dtype=torch.long)
    for i, (ids, lab) in enumerate(encoded):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    return (
        {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "pixel_values": pixel_values([s.image for s in batch]),
        },
        batch,
    )


class AuxiliaryHead(torch.nn.Module):
    """Training only (not saved): a direct signal for the vision tower, which learns digits,
    shapes and counts slowly through the language model alone.

    From the mean of a sample's projected image features it predicts the answer among the
    answers of its kind; for stripes, where the mean loses the order, it predicts the colour of
    each stripe (or none) from all the image features, position by position."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        pooled = [(k, a) for k in KINDS if k != "stripes" for a in answers(k)]
        self.index = {key: i for i, key in enumerate(pooled)}
        self.kind_mask = {
            kind: torch.tensor([k != kind for k, _ in pooled], dtype=torch.bool) for kind in KINDS
        }
        self.norm = torch.nn.LayerNorm(hidden)
        self.linear = torch.nn.Linear(hidden, len(pooled))
        self.colours = {c: i for i, c in enumerate(["none", *COLOURS])}
        self.stripes = torch.nn.Linear(NUM_IMAGE_TOKENS * hidden, MAX_STRIPES * len(self.colours))

    def loss(self, features: torch.Tensor, samples: list[Sample], hits: bool = False) -> Any:
        """The mean cross entropy; with `hits`, also whether each prediction was right."""
        features = self.norm(features)
        striped = torch.tensor([s.kind == "stripes" for s in samples])
        right = torch.zeros(len(samples), dtype=torch.bool)
        losses = []
        if (~striped).any():
            rest = [s for s in samples if s.kind != "stripes"]
            logits = self.linear(features[~striped].mean(1))
            logits = logits.masked_fill(torch.stack([self.kind_mask[s.kind] for s in rest]), -1e9)
            target = torch.tensor([self.index[s.kind, s.answer] for s in rest])
            losses.append(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            right[~striped] = logits.argmax(-1) == target
        if striped.any():
            flags = [s for s in samples if s.kind == "stripes"]
            logits = self.stripes(features[striped].flatten(1)).view(len(flags), MAX_STRIPES, -1)
            target = torch.tensor(
                [
                    [self.colours[c] for c in (*s.stripes, *["none"] * MAX_STRIPES)][:MAX_STRIPES]
                    for s in flags
                ]
            )
            per_stripe = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), target, reduction="none"
            )
            losses.append(per_stripe.mean(1).sum())
            right[striped] = (logits.argmax(-1) == target).all(1)
        loss = sum(losses) / len(samples)
        return (loss, right.tolist()) if hits else loss


def image_losses(
    model: LlavaForConditionalGeneration,
    batch: dict[str, torch.Tensor],
    aux: AuxiliaryHead,
    samples: list[Sample],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of each sample (mean over its answer tokens) and the auxiliary loss. The LM head
    runs only where a label is (answers are a few tokens after 64 image tokens)."""
    labels = batch["labels"]
    image_outputs = model.model.get_image_features(
        pixel_values=batch["pixel_values"], return_dict=True
    )
    aux_loss = aux.loss(torch.stack(list(image_outputs.pooler_output)), samples)
    hidden = model.model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        mm_encoder_outputs={"image": image_outputs},
    ).last_hidden_state
    targets = labels[:, 1:]
    mask = targets != -100
    token_losses = torch.nn.functional.cross_entropy(
        model.lm_head(hidden[:, :-1][mask]), targets[mask], reduction="none"
    )
    rows = mask.nonzero()[:, 0]
    totals = torch.zeros(labels.shape[0]).index_add(0, rows, token_losses)
    return totals / mask.sum(1), aux_loss


def text_batch(ids: list[int], seq_len: int, size: int, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, len(ids) - seq_len - 1) for _ in range(size)]
    return torch.tensor([ids[s : s + seq_len] for s in starts], dtype=torch.long)


def answer(
    model: LlavaForConditionalGeneration,
    processor: LlavaProcessor,
    image: Image.Image | None,
    question: str,
    max_new_tokens: int = 32,
) -> str:
    """Greedy answer through the saved chat template and the processor, as a user would ask."""
    content = user_content(question) if image is not None else question
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    if image is None:
        inputs = processor.tokenizer(prompt, return_tensors="pt")
    else:
        inputs = processor(text=prompt, images=image, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(
        out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )


def complete(
    model: LlavaForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, prompt: str
) -> str:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def evaluate(
    model: LlavaForConditionalGeneration, processor: LlavaProcessor, seed: int, per_kind: int
) -> dict[str, float]:
    """Accuracy (exact answer) per question kind on `per_kind` fresh images of each kind."""
    rng = random.Random(seed)
    accuracy: dict[str, float] = {}
    for kind in KINDS:
        tests = [sample(rng, kind) for _ in range(per_kind)]
        right = 0
        for i, s in enumerate(tests):
            got = answer(model, processor, s.image, s.question).strip()
            right += got == s.answer
            if got != s.answer and i < 40:
                print(f"  miss {kind}: {s.question!r} expected {s.answer!r} got {got!r}")
        accuracy[kind] = right / per_kind
        print(f"accuracy {kind:8s} {right:3d}/{per_kind} = {accuracy[kind]:.0%}", flush=True)
    return accuracy


def check_examples(model: LlavaForConditionalGeneration, processor: LlavaProcessor) -> bool:
    ok = True
    for name, s in examples():
        path = EXAMPLE_IMAGES / name
        image = Image.open(path).convert("RGB") if path.exists() else s.image
        got = answer(model, processor, image, s.question).strip()
        ok &= got == s.answer
        print(f"{'ok ' if got == s.answer else 'BAD'} {name}: {s.question!r} -> {got!r}")
    return ok


def check_text(model: LlavaForConditionalGeneration, processor: LlavaProcessor) -> bool:
    ok = True
    for prompt, expected in TEXT_CHECKS:
        got = complete(model, processor.tokenizer, prompt)
        ok &= got.startswith(expected)
        print(f"{'ok ' if got.startswith(expected) else 'BAD'} {prompt!r} -> {got!r}")
    for question in ["What is the capital of France?", "List 3 countries and their capitals."]:
        print(f"chat {question!r} -> {answer(model, processor, None, question, 40)!r}")
    return ok


def check_processor(processor: LlavaProcessor, encoder: Encoder) -> None:
    """The training shortcut (pixel_values(), Encoder) must match what the processor does."""
    s = sample(random.Random(7), "colour")
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": user_content(s.question)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = processor(text=prompt, images=s.image, return_tensors="pt")
    ids, labels = encoder.encode(s.question, s.answer, system=False)
    prompt_len = labels.index(next(x for x in labels if x != -100))
    assert inputs["input_ids"][0].tolist() == ids[:prompt_len], (
        "token ids differ from the processor's"
    )
    diff = (inputs["pixel_values"] - pixel_values([s.image])).abs().max().item()
    assert diff < 1e-5, f"pixel values differ from the processor's by {diff}"
    n = (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)).sum().item()
    assert n == NUM_IMAGE_TOKENS, n


def save(model: LlavaForConditionalGeneration, processor: LlavaProcessor, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # a rebuild replaces the directory's files
        if old.is_file():
            old.unlink()
    tokenizer = processor.tokenizer
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)  # writes the tokenizer files and the chat template too
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"saved to {out} ({size / 1e6:.1f} MB): {', '.join(sorted(f.name for f in out.iterdir()))}"
    )


def warmup_cosine(steps: int) -> Callable[[int], float]:
    warmup = max(1, steps // 20)
    return lambda s: (
        min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )


def pretrain_vision(
    model: LlavaForConditionalGeneration,
    aux: AuxiliaryHead,
    args: argparse.Namespace,
    rng: random.Random,
) -> None:
    """Stage 1: the vision tower and projector alone, on the auxiliary classification (the role
    CLIP pretraining plays for a real LLaVA). Cheap: no language model in the loop."""
    params = [
        *model.model.vision_tower.parameters(),
        *model.model.multi_modal_projector.parameters(),
        *aux.parameters(),
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.pretrain_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    start = time.time()
    hits: dict[str, list[int]] = {kind: [0, 0] for kind in KINDS}
    for step in range(args.pretrain_steps):
        kinds = rng.choices(
            list(PRETRAIN_WEIGHTS), list(PRETRAIN_WEIGHTS.values()), k=args.pretrain_batch
        )
        batch = [sample(rng, kind) for kind in kinds]
        outputs = model.model.get_image_features(
            pixel_values=pixel_values([s.image for s in batch]), return_dict=True
        )
        features = torch.stack(list(outputs.pooler_output))
        loss, right = aux.loss(features, batch, hits=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        for kind, ok in zip(kinds, right, strict=True):
            hits[kind][0] += ok
            hits[kind][1] += 1
        if step % 100 == 99 or step == args.pretrain_steps - 1:
            accuracy = " ".join(f"{k} {h / max(n, 1):.2f}" for k, (h, n) in hits.items())
            hits = {kind: [0, 0] for kind in KINDS}
            print(
                f"stage 1 step {step:5d}  aux {loss.item():.3f}  (accuracy {accuracy})  "
                f"{time.time() - start:.0f}s",
                flush=True,
            )


def train_llava(
    model: LlavaForConditionalGeneration,
    aux: AuxiliaryHead,
    encoder: Encoder,
    text_ids: list[int],
    args: argparse.Namespace,
    rng: random.Random,
) -> None:
    """Stage 2: everything, on image questions in chat format plus text from the demo corpus."""
    vision = [
        *model.model.vision_tower.parameters(),
        *model.model.multi_modal_projector.parameters(),
        *aux.parameters(),
    ]
    language = list(model.model.language_model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": vision, "lr": args.lr}, {"params": language, "lr": args.lm_lr}],
        weight_decay=0.01,
        betas=(0.9, 0.95),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    pad_id = encoder.tokenizer.pad_token_id
    start = time.time()
    kind_loss = {kind: [0.0, 0] for kind in KINDS}
    for step in range(args.steps):
        batch, samples = image_batch(encoder, rng, args.batch, pad_id)
        losses, aux_loss = image_losses(model, batch, aux, samples)
        for s, value in zip(samples, losses.tolist(), strict=True):
            kind_loss[s.kind][0] += value
            kind_loss[s.kind][1] += 1
        image_loss = losses.mean()
        loss = image_loss + args.aux_weight * aux_loss
        if args.text_batch:
            text = text_batch(text_ids, args.seq_len, args.text_batch, rng)
            text_loss = model(input_ids=text, labels=text).loss
            loss = loss + args.text_weight * text_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*vision, *language], 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 49 or step == args.steps - 1:
            text_part = f"  text {text_loss.item():.3f}" if args.text_batch else ""
            per_kind = " ".join(f"{k} {v / max(n, 1):.3f}" for k, (v, n) in kind_loss.items())
            kind_loss = {kind: [0.0, 0] for kind in KINDS}
            print(
                f"stage 2 step {step:5d}  image {image_loss.item():.3f}  aux {aux_loss.item():.3f}"
                f"{text_part}  (answer loss {per_kind})  {time.time() - start:.0f}s",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pretrain-steps", type=int, default=2500, help="stage 1 steps")
    parser.add_argument("--pretrain-batch", type=int, default=64, help="stage 1 images per step")
    parser.add_argument("--steps", type=int, default=800, help="stage 2 steps")
    parser.add_argument("--batch", type=int, default=32, help="stage 2 image questions per step")
    parser.add_argument("--text-batch", type=int, default=2, help="stage 2 text sequences per step")
    parser.add_argument("--text-weight", type=float, default=0.5)
    parser.add_argument(
        "--aux-weight", type=float, default=0.5, help="stage 2 weight of AuxiliaryHead"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3, help="vision tower and projector")
    parser.add_argument("--lm-lr", type=float, default=5e-4, help="language model")
    parser.add_argument("--vision-hidden", type=int, default=128)
    parser.add_argument("--vision-layers", type=int, default=3)
    parser.add_argument("--vision-heads", type=int, default=4)
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--eval-per-kind", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    encoder = Encoder(tokenizer)
    check_processor(processor, encoder)
    model = build_model(tokenizer, args)
    aux = AuxiliaryHead(model.config.text_config.hidden_size)
    vision_params = sum(
        p.numel()
        for m in (model.model.vision_tower, model.model.multi_modal_projector)
        for p in m.parameters()
    )
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"(vision tower + projector {vision_params / 1e6:.2f}M), "
        f"{NUM_IMAGE_TOKENS} image tokens, <image> = {model.config.image_token_id}",
        flush=True,
    )
    eos = tokenizer.eos_token_id
    text_ids: list[int] = []
    docs = documents(random.Random(args.seed + 1), args.documents)
    for encoded in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        text_ids.extend([*encoded, eos])

    start = time.time()
    model.train()
    pretrain_vision(model, aux, args, rng)
    train_llava(model, aux, encoder, text_ids, args, rng)
    print(f"trained in {(time.time() - start) / 60:.1f} min", flush=True)

    model.eval()
    save(model, processor, args.out)
    # Everything below runs on what was saved, loaded the way a user loads it.
    model = LlavaForConditionalGeneration.from_pretrained(args.out, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(args.out, local_files_only=True)
    with torch.no_grad():
        evaluate(model, processor, seed=args.seed + 1000, per_kind=args.eval_per_kind)
        check_examples(model, processor)
        check_text(model, processor)
    print(f"total {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
