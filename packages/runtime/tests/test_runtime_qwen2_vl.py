"""Qwen2-VL and Qwen2.5-VL equal transformers on tiny random checkpoints: prompt logits with
images (of different sizes) and videos, greedy continuations, batches and cached prefixes."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image, ImageDraw

from radixlm.runtime import BatchEntry, Engine, ForwardBatch, ModelRunner
from radixlm.runtime.config import MediaConfig
from radixlm.runtime.fixtures_vision import (
    QWEN2_VL_IMAGE,
    QWEN2_VL_VIDEO,
    build_tiny_qwen2_vl,
)
from radixlm.runtime.multimodal.inputs import MediaItem
from radixlm.runtime.multimodal.preparer import MultimodalPreparer, multimodal_preparer
from radixlm.runtime.multimodal.processor import Processed
from radixlm.sampling import InvalidRequest

VERSIONS = ["2", "2.5"]
HF_CLASSES: dict[str, Any] = {
    "2": transformers.Qwen2VLForConditionalGeneration,
    "2.5": transformers.Qwen2_5_VLForConditionalGeneration,
}
STEPS = 12


def picture(seed: int, width: int, height: int) -> bytes:
    """A PNG of random coloured rectangles."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(5):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = (
            min(width, x0 + rng.randrange(4, width)),
            min(height, y0 + rng.randrange(4, height)),
        )
        draw.rectangle((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class Case:
    """A prompt with one placeholder per image / video, and the media."""

    text: str
    images: tuple[bytes, ...] = ()
    videos: tuple[tuple[bytes, ...], ...] = ()


CASES = {
    # 48 x 48 after resizing: 6 x 6 positions.
    "one_image": Case(f"Look at {QWEN2_VL_IMAGE} what is this", (picture(1, 56, 56),)),
    # 6 x 6 and 4 x 5 positions (Qwen2.5-VL: a partial window on the right).
    "two_images": Case(
        f"the {QWEN2_VL_IMAGE} and the {QWEN2_VL_IMAGE} differ in",
        (picture(2, 56, 56), picture(3, 40, 32)),
    ),
    # 4 frames of 4 x 4 positions: two temporal patches.
    "video": Case(
        f"a video {QWEN2_VL_VIDEO} shows the",
        videos=(tuple(picture(10 + k, 32, 32) for k in range(4)),),
    ),
}


@dataclass
class Setup:
    """One tiny checkpoint: transformers' model and our runner, preparer and engine."""

    version: str
    path: Path
    hf: Any
    tokenizer: Any
    preparer: MultimodalPreparer
    runner: ModelRunner
    engine: Engine
    image_processor: Any

    def prompt_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def hf_inputs(self, case: Case) -> dict[str, Any]:
        """transformers' model inputs for the case: placeholders expanded as its processor
        does, images through its image processor; videos through ours (transformers' video
        processor needs torchvision; the layout is checked separately below)."""
        inputs: dict[str, Any] = {}
        counts: list[int] = []
        if case.images:
            pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in case.images]
            out = self.image_processor(images=pictures, return_tensors="pt")
            inputs["pixel_values"] = out["pixel_values"]
            inputs["image_grid_thw"] = out["image_grid_thw"]
            counts = [int(grid.prod()) // 4 for grid in out["image_grid_thw"]]
        videos = self.preparer.processor.videos([[_loaded(b) for b in v] for v in case.videos])
        text = case.text
        for token, lengths in (
            ("<|image_pad|>", counts),
            ("<|video_pad|>", [v.length for v in videos]),
        ):
            parts = text.split(token)
            assert len(parts) == len(lengths) + 1
            text = parts[0] + "".join(
                token * n + rest for n, rest in zip(lengths, parts[1:], strict=True)
            )
        ids = torch.tensor([self.prompt_ids(text)])
        config = self.hf.config
        kinds = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
        inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds)
        if videos:
            inputs["pixel_values_videos"] = torch.cat([p.pixel_values for p in videos])
            inputs["video_grid_thw"] = torch.tensor([p.extra["grid_thw"] for p in videos])
            if self.version == "2.5":
                inputs["second_per_grid_ts"] = torch.tensor(
                    [p.extra["second_per_grid_t"] for p in videos]
                )
        return inputs

    def hf_generate(self, case: Case) -> list[int]:
        inputs = self.hf_inputs(case)
        with torch.no_grad():
            out = self.hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False)
        return list(out[0, inputs["input_ids"].shape[1] :].tolist())


def _loaded(data: bytes) -> Any:
    from radixlm.runtime.multimodal.media import load_image

    return load_image(data, MediaConfig())


@pytest.fixture(scope="module")
def setups(
    tmp_path_factory: pytest.TempPathFactory, runner_config_for: Any
) -> Iterator[dict[str, Setup]]:
    root = tmp_path_factory.mktemp("qwen2_vl")
    built: dict[str, Setup] = {}
    try:
        for version in VERSIONS:
            path = build_tiny_qwen2_vl(root / version.replace(".", "_"), version=version)
            hf = HF_CLASSES[version].from_pretrained(str(path)).eval()
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
            preparer = multimodal_preparer(
                str(path), hf.config.architectures, tokenizer, MediaConfig(), 64
            )
            assert preparer is not None
            engine = Engine(
                str(path),
                engine_process=False,
                attention_backend="torch_native",
                max_total_tokens=2048,
                show_progress=False,
            )
            runner = ModelRunner(runner_config_for(path))
            images = transformers.AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
                str(path)
            )
            built[version] = Setup(version, path, hf, tokenizer, preparer, runner, engine, images)
        yield built
    finally:
        for setup in built.values():
            setup.engine.shutdown()


def _entry(setup: Setup, case: Case | None, text: str | None = None) -> BatchEntry:
    """A whole-prompt entry (media embeddings and M-RoPE positions set), its slots taken."""
    runner = setup.runner
    if case is None:
        assert text is not None
        ids = setup.prompt_ids(text)
        media: tuple[tuple[int, torch.Tensor], ...] = ()
        mrope = None
    else:
        key, inputs = setup.preparer.prepare(
            setup.prompt_ids(case.text),
            list(case.images) or None,
            [list(v) for v in case.videos] or None,
        )
        ids = key
        spans = inputs.spans(0, len(key))
        with torch.inference_mode():
            model: Any = runner.model
            embeds = model.encode_media([span.item for span in spans])
        media = tuple(
            (s.row, rows[s.first : s.first + s.count])
            for s, rows in zip(spans, embeds, strict=True)
        )
        mrope = inputs.mrope_positions
    row = runner.req_to_token_pool.alloc()
    slots = runner.kv_pool.alloc(len(ids))
    assert row is not None and slots is not None
    return BatchEntry(row, ids, 0, slots, media_embeds=media, mrope_positions=mrope)


def our_logits(setup: Setup, entries: Sequence[BatchEntry]) -> torch.Tensor:
    """Logits at every new position of every entry, one forward."""
    runner = setup.runner
    batch = ForwardBatch.build(entries, runner.req_to_token_pool.req_to_token)
    batch.write_req_to_token()
    runner.attention.prepare(batch)
    try:
        with torch.inference_mode():
            hidden = runner.model(
                batch.input_ids,
                batch.model_positions,
                runner.attention,
                batch.input_embeds,
                batch.input_embeds_rows,
            )
            return runner.model.compute_logits(hidden)
    finally:
        for entry in entries:
            runner.kv_pool.free(list(entry.out_slots))
            runner.req_to_token_pool.free(entry.req_pool_index)


def hf_logits(setup: Setup, case: Case) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = setup.hf(**setup.hf_inputs(case)).logits[0].float()
    return logits


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("version", VERSIONS)
def test_prefill_logits_match_transformers(
    setups: dict[str, Setup], version: str, case: str
) -> None:
    setup = setups[version]
    entry = _entry(setup, CASES[case])
    ours = our_logits(setup, [entry])
    theirs = hf_logits(setup, CASES[case])
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("version", VERSIONS)
def test_mrope_positions_equal_transformers_rope_index(
    setups: dict[str, Setup], version: str, case: str
) -> None:
    setup = setups[version]
    key, inputs = setup.preparer.prepare(
        setup.prompt_ids(CASES[case].text),
        list(CASES[case].images) or None,
        [list(v) for v in CASES[case].videos] or None,
    )
    hf_in = setup.hf_inputs(CASES[case])
    extra: dict[str, Any] = {
        k: hf_in[k] for k in ("image_grid_thw", "video_grid_thw") if k in hf_in
    }
    if "second_per_grid_ts" in hf_in:
        extra["second_per_grid_ts"] = hf_in["second_per_grid_ts"]
    positions, delta = setup.hf.model.get_rope_index(
        hf_in["input_ids"], mm_token_type_ids=hf_in["mm_token_type_ids"], **extra
    )
    assert len(key) == hf_in["input_ids"].shape[1]
    assert torch.equal(inputs.mrope_positions, positions[:, 0])
    assert inputs.mrope_delta == int(delta)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("version", VERSIONS)
def test_greedy_continuation_matches_generate(
    setups: dict[str, Setup], version: str, case: str
) -> None:
    setup = setups[version]
    spec = CASES[case]
    out = setup.engine.generate(
        spec.text,
        {"max_new_tokens": STEPS, "temperature": 0},
        image_data=list(spec.images) or None,
        video_data=[list(v) for v in spec.videos] or None,
    )
    assert out["output_ids"] == setup.hf_generate(spec)


@pytest.mark.parametrize("version", VERSIONS)
def test_batch_of_image_and_text_prompts_equals_each_alone(
    setups: dict[str, Setup], version: str
) -> None:
    setup = setups[version]
    text = "the cache of the radix tree is a prefix"
    alone = [
        our_logits(setup, [_entry(setup, CASES["one_image"])]),
        our_logits(setup, [_entry(setup, None, text)]),
    ]
    image_entry = _entry(setup, CASES["one_image"])
    text_entry = _entry(setup, None, text)
    together = our_logits(setup, [image_entry, text_entry])
    assert (together - torch.cat(alone)).abs().max().item() <= 1e-5
    # Through the engine: both prompts in one call, the text one without media.
    case = CASES["one_image"]
    outs = setup.engine.generate(
        [case.text, text],
        {"max_new_tokens": STEPS, "temperature": 0},
        image_data=[list(case.images), None],
    )
    single = setup.engine.generate(text, {"max_new_tokens": STEPS, "temperature": 0})
    assert outs[0]["output_ids"] == setup.hf_generate(case)
    assert outs[1]["output_ids"] == single["output_ids"]


@pytest.mark.parametrize("version", VERSIONS)
def test_cached_image_prefix_then_extend_equals_whole_prompt(
    setups: dict[str, Setup], version: str
) -> None:
    setup = setups[version]
    first = CASES["two_images"]
    longer = Case(first.text + " the tree and the model", first.images)
    params = {"max_new_tokens": STEPS, "temperature": 0}
    setup.engine.generate(
        first.text, {**params, "max_new_tokens": 1}, image_data=list(first.images)
    )
    out = setup.engine.generate(longer.text, params, image_data=list(longer.images))
    ids = setup.hf_inputs(longer)["input_ids"][0].tolist()
    last_image_token = max(i for i, t in enumerate(ids) if t == setup.hf.config.image_token_id)
    assert out["meta_info"]["cached_tokens"] > last_image_token
    assert out["output_ids"] == setup.hf_generate(longer)


@pytest.mark.parametrize("version", VERSIONS)
def test_text_only_prompt_matches_transformers(setups: dict[str, Setup], version: str) -> None:
    setup = setups[version]
    text = "the model of the engine is a tree"
    entry = _entry(setup, None, text)
    ours = our_logits(setup, [entry])
    with torch.no_grad():
        theirs = setup.hf(torch.tensor([setup.prompt_ids(text)])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= 1e-4


# Processing ------------------------------------------------------------------------------


def test_video_of_repeated_frame_has_that_images_pixels(setups: dict[str, Setup]) -> None:
    processor = setups["2"].preparer.processor
    frame = _loaded(picture(4, 40, 32))
    (image,) = processor.images([frame])
    (video,) = processor.videos([[frame, frame]])
    assert video.extra["grid_thw"] == image.extra["grid_thw"]
    assert video.length == image.length
    assert torch.equal(video.pixel_values, image.pixel_values)


def test_video_frames_fill_each_temporal_patch_in_order(setups: dict[str, Setup]) -> None:
    processor = setups["2"].preparer.processor
    frames = [_loaded(picture(20 + k, 32, 32)) for k in range(3)]
    (video,) = processor.videos([frames])
    t, h, w = video.extra["grid_thw"]
    assert t == 2  # three frames, the last repeated to fill the second patch
    patches = video.pixel_values.reshape(t, h * w, 3, 2, -1)
    for k, frame in enumerate([*frames, frames[-1]]):
        (alone,) = processor.images([frame])  # an image repeats itself over the patch
        expected = alone.pixel_values.reshape(h * w, 3, 2, -1)[:, :, 0]
        assert torch.equal(patches[k // 2, :, :, k % 2], expected)


def test_processor_output_items_split_by_grid(setups: dict[str, Setup]) -> None:
    processor = setups["2.5"].preparer.processor
    images = processor.images([_loaded(picture(5, 56, 56)), _loaded(picture(6, 40, 32))])
    data = {
        "format": "processor_output",
        "pixel_values": torch.cat([p.pixel_values for p in images]).tolist(),
        "image_grid_thw": [list(p.extra["grid_thw"]) for p in images],
    }
    split = processor.processor_output(data, "image")
    assert [p.length for p in split] == [p.length for p in images] == [36, 20]
    for mine, theirs in zip(split, images, strict=True):
        assert torch.equal(mine.pixel_values, theirs.pixel_values)
        assert mine.extra["grid_thw"] == theirs.extra["grid_thw"]
    with pytest.raises(ValueError, match="patch rows"):
        processor.processor_output({**data, "image_grid_thw": [[1, 12, 12]]}, "image")


def test_text_after_a_long_video_continues_past_its_last_time_position(
    setups: dict[str, Setup],
) -> None:
    # Qwen2.5-VL, 8 temporal patches of 1 s at 2 positions per second over 2 x 2 merged
    # patches, after one text token: times reach 15 while rows and columns reach 2. The text
    # after the video continues at 16 (Qwen's reference rule; transformers 5 would continue
    # at 1 + 2, the grid's side, overlapping the video's times).
    processor = setups["2.5"].preparer.processor
    grid = (8, 4, 4)
    video = MediaItem("video", 1, 32, b"v", extra={"grid_thw": grid, "second_per_grid_t": 1.0})
    found = processor.mrope([7] + [9] * 32 + [7, 7], [video])
    assert found is not None
    positions, delta = found
    assert positions[:, 0].tolist() == [0, 0, 0]
    assert sorted(set(positions[0, 1:33].tolist())) == [1 + 2 * k for k in range(8)]
    assert positions[:, 33].tolist() == [16, 16, 16]
    assert delta == 17 + 1 - 35


def test_precomputed_embeddings_without_a_grid_are_refused(setups: dict[str, Setup]) -> None:
    processor = setups["2"].preparer.processor
    item = MediaItem("image", 0, 4, b"e")
    with pytest.raises(InvalidRequest, match="processor_output"):
        processor.mrope([1, 1, 1, 1], [item])


def test_precomputed_embeddings_with_their_grid_answer_as_the_image(
    setups: dict[str, Setup],
) -> None:
    setup = setups["2"]
    spec = CASES["one_image"]
    _, inputs = setup.preparer.prepare(setup.prompt_ids(spec.text), list(spec.images), None)
    item = inputs.items[0]
    with torch.inference_mode():
        feature = setup.runner.model.encode_media([item])[0]
    given = {
        "format": "precomputed_embedding",
        "feature": feature.tolist(),
        "image_grid_thw": [list(item.extra["grid_thw"])],
    }
    sampling = {"max_new_tokens": STEPS, "temperature": 0}
    direct = setup.engine.generate(spec.text, sampling, image_data=list(spec.images))
    setup.engine.flush_cache().result()
    out = setup.engine.generate(spec.text, sampling, image_data=given)
    assert out["output_ids"] == direct["output_ids"]


def test_placeholder_text_is_vision_start_pad_end(setups: dict[str, Setup]) -> None:
    processor = setups["2"].preparer.processor
    assert processor.image_token == QWEN2_VL_IMAGE
    assert processor.video_token == QWEN2_VL_VIDEO
    assert isinstance(processor.images([_loaded(picture(7, 32, 32))])[0], Processed)


def test_checkpoint_in_transformers_5_layout_loads_the_same_weights(
    setups: dict[str, Setup], tmp_path: Path, runner_config_for: Any
) -> None:
    # transformers 5 models hold `model.language_model.*` and `model.visual.*` (their
    # save_pretrained writes the older `model.*` / `visual.*`, as the fixture has).
    import shutil

    from safetensors.torch import load_file, save_file

    setup = setups["2.5"]
    shutil.copytree(setup.path, tmp_path / "m")
    tensors = load_file(str(setup.path / "model.safetensors"))
    renamed = {
        ("model." + name if name.startswith("visual.") else name).replace(
            "model.layers", "model.language_model.layers"
        ): tensor
        for name, tensor in tensors.items()
    }
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        renamed[name.replace("model.", "model.language_model.")] = renamed.pop(name)
    assert any(n.startswith("model.visual.") for n in renamed)
    save_file(renamed, str(tmp_path / "m" / "model.safetensors"))
    # Fresh runners: a runner that has run packs its CPU linears' weights.
    expected = dict(ModelRunner(runner_config_for(setup.path)).model.named_parameters())
    loaded = dict(ModelRunner(runner_config_for(tmp_path / "m")).model.named_parameters())
    assert loaded.keys() == expected.keys()
    assert [n for n in expected if not torch.equal(loaded[n], expected[n])] == []
