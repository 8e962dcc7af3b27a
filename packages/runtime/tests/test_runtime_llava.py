"""LLaVA against transformers (fp32), images in the radix cache by content hash, the encoder
cache, and bad image input."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from radixlm.runtime import BatchEntry, Engine, ForwardBatch
from radixlm.runtime.executor import ModelExecutor
from radixlm.runtime.fixtures_vision import build_tiny_llava, make_image
from radixlm.sampling import GenerateRequest, InvalidRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
ENGINE: dict[str, Any] = dict(
    show_progress=False,
    max_total_tokens=4096,
    attention_backend="torch_native",
    chunked_prefill_size=-1,
)
FAMILIES = {
    "llama-clip": dict(text_architecture="LlamaForCausalLM", vision="clip"),
    "qwen2-siglip-full": dict(
        text_architecture="Qwen2ForCausalLM", vision="siglip", strategy="full", feature_layer=-1
    ),
    "mistral-clip-layers": dict(text_architecture="MistralForCausalLM", feature_layer=[-2, -1]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
# (these engines run on a thread: the parity checks read the runner's logits)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build_tiny_llava(tmp_path_factory.mktemp(request.param), **FAMILIES[request.param])
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = transformers.AutoProcessor.from_pretrained(path)
    with Engine(str(path), engine_process=False, **ENGINE) as engine:
        yield path, hf, processor, engine


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def hf_inputs(processor: Any, text: str, images: list[bytes]) -> Any:
    return processor(text=text, images=[pil(i) for i in images] or None, return_tensors="pt")


def radix_prompt_logits(engine: Engine, text: str, images: list[bytes]) -> torch.Tensor:
    """Logits at every prompt position: one forward of the prepared prompt (its image rows
    from the model's encoder), hidden states through the LM head."""
    request = engine._preparer.prepare(
        GenerateRequest.parse({"text": text}).model_copy(update={"image_data": images})
    )
    runner = engine.runner
    executor = ModelExecutor(runner)
    ids = list(request.prompt_ids)
    media = executor._media_embeds(request.multimodal, 0, len(ids)) if images else ()
    row = runner.req_to_token_pool.alloc()
    slots = runner.kv_pool.alloc(len(ids))
    assert row is not None and slots is not None
    try:
        entry = BatchEntry(row, ids, 0, slots, media_embeds=media, return_hidden_states=True)
        batch = ForwardBatch.build([entry], runner.req_to_token_pool.req_to_token)
        out = runner.forward(batch)
        hidden = out.hidden_states[0].to(runner.device, runner.dtype)
        return runner.model.compute_logits(hidden).cpu()
    finally:
        runner.kv_pool.free(slots)
        runner.req_to_token_pool.free(row)


@pytest.mark.parametrize("count", [1, 3])
def test_prefill_logits_match_transformers(family: Any, count: int) -> None:
    _, hf, processor, engine = family
    images = [make_image(seed) for seed in range(count)]
    text = "Look " + " and ".join("<image>" for _ in images) + " what is it?"
    inputs = hf_inputs(processor, text, images)
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
    got = radix_prompt_logits(engine, text, images)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_greedy_continuation_matches_transformers(family: Any) -> None:
    _, hf, processor, engine = family
    images = [make_image(7), make_image(8)]
    text = "<image> first, then <image> second:"
    inputs = hf_inputs(processor, text, images)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    got = engine.generate(text, GREEDY, image_data=images)
    assert got["output_ids"] == expected
    assert got["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]


def test_batch_mixing_image_and_text_requests_equals_each_alone(family: Any) -> None:
    _, _, _, engine = family
    prompts = ["<image> describe:", "plain text prompt about a tree", "<image> again <image>"]
    images: list[Any] = [[make_image(1)], None, [make_image(2), make_image(3)]]
    engine.flush_cache().result()
    alone = [
        engine.generate(p, GREEDY, image_data=i)["output_ids"]
        for p, i in zip(prompts, images, strict=True)
    ]
    engine.flush_cache().result()
    together = engine.generate(prompts, GREEDY, image_data=images)
    assert [r["output_ids"] for r in together] == alone
    engine.check_invariants()


def test_cached_image_prefix_plus_extend_equals_whole_prompt(family: Any) -> None:
    _, _, _, engine = family
    image = make_image(11)
    engine.flush_cache().result()
    whole = engine.generate("<image> what colour is the square?", GREEDY, image_data=image)
    engine.flush_cache().result()
    engine.generate("<image> what", {**GREEDY, "max_new_tokens": 1}, image_data=image)
    extended = engine.generate("<image> what colour is the square?", GREEDY, image_data=image)
    tokens = engine.runner.model.tokens_per_image
    assert extended["meta_info"]["cached_tokens"] >= tokens
    assert extended["output_ids"] == whole["output_ids"]


# ------------------------------------------------------------------------------- the cache


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    with Engine(str(path), **ENGINE) as eng:
        yield eng


def stats(engine: Engine) -> dict[str, Any]:
    return engine.server_info(fresh=True)


def test_same_image_different_question_hits_the_image_tokens(engine: Engine) -> None:
    engine.flush_cache().result()
    image = make_image(21)
    first = engine.generate("User: <image> What colour is it?", GREEDY, image_data=image)
    second = engine.generate("User: <image> How many circles?", GREEDY, image_data=image)
    tokens = 16  # 32x32 pixels in 8x8 patches, class token dropped
    image_end = len(engine.tokenizer.encode("User: ")) + tokens
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= image_end


def test_different_images_with_the_same_text_share_nothing_past_the_image(engine: Engine) -> None:
    engine.flush_cache().result()
    text = "User: <image> What colour is it?"
    engine.generate(text, GREEDY, image_data=make_image(31))
    other = engine.generate(text, GREEDY, image_data=make_image(32))
    assert other["meta_info"]["cached_tokens"] == len(engine.tokenizer.encode("User: "))


def test_the_same_picture_sent_as_bytes_and_as_base64_shares_the_cache(engine: Engine) -> None:
    import base64

    engine.flush_cache().result()
    image = make_image(41)
    engine.generate("<image> one", GREEDY, image_data=image)
    again = engine.generate(
        "<image> two", GREEDY, image_data=base64.b64encode(image).decode("ascii")
    )
    assert again["meta_info"]["cached_tokens"] >= 16


def test_the_encoder_runs_once_for_a_repeated_image(engine: Engine) -> None:
    engine.flush_cache().result()
    image = make_image(51)
    before = stats(engine)["media_encoded"]
    engine.generate("<image> first question", GREEDY, image_data=image)
    engine.flush_cache().result()  # the KV is gone; the encoder cache is cleared too
    engine.generate("<image> second question", GREEDY, image_data=image)
    # Same picture twice in one prompt, and once more after different text: encoded once.
    engine.generate("<image> and <image>", GREEDY, image_data=[image, image])
    engine.generate("Other words first. <image>", GREEDY, image_data=image)
    assert stats(engine)["media_encoded"] - before == 2
    assert stats(engine)["media_encoder_cache_hits"] >= 2


def test_images_leak_no_kv_slot(engine: Engine) -> None:
    engine.generate(
        ["<image> a", "<image> b"], GREEDY, image_data=[[make_image(61)], [make_image(62)]]
    )
    engine.check_invariants()
    info = stats(engine)
    assert info["num_running_reqs"] == info["num_queued_reqs"] == 0


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        (dict(image_data=b"not an image at all"), "image_data", "image"),
        (dict(image_data=make_image(1)[:40]), "image_data", "image"),
        (dict(image_data=[make_image(1), b"\x89PNG\r\n"]), "image_data[1]", "image"),
        (dict(image_data=[make_image(1), make_image(2)]), "image_data", "placeholder"),
        (dict(audio_data="clip.wav"), "audio_data", "audio"),
        (dict(image_data="/etc/passwd"), "image_data", "allowed-local-media-path"),
        (dict(image_data="http://127.0.0.1/x.png"), "image_data", "allow-media-urls"),
    ],
)
def test_bad_image_input_is_refused_naming_the_item(
    engine: Engine, kwargs: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        engine.generate("<image> what is it?", GREEDY, **kwargs)
    assert caught.value.field == field
    assert words in caught.value.message
    # The engine still serves.
    assert engine.generate("<image> ok", GREEDY, image_data=make_image(3))["output_ids"]


def test_too_many_images_for_the_context_are_refused(tmp_path: Path) -> None:
    path = build_tiny_llava(tmp_path / "small")
    with (
        Engine(str(path), context_length=40, **ENGINE) as small,
        pytest.raises(InvalidRequest) as caught,
    ):
        small.generate("<image> <image> <image>", GREEDY, image_data=[make_image(1)] * 3)
    assert caught.value.field == "image_data"
    assert "context" in caught.value.message


def test_a_text_only_model_refuses_images(tmp_path: Path) -> None:
    from radixlm.runtime.fixtures import build_tiny_model

    with Engine(str(build_tiny_model(tmp_path / "text")), **ENGINE) as text_only:
        with pytest.raises(InvalidRequest) as caught:
            text_only.generate("what is it?", GREEDY, image_data=make_image(1))
        assert text_only.model_info()["image_token"] is None
    assert caught.value.field == "image_data"
    assert "text-only" in caught.value.message


def test_model_info_names_the_image_placeholder(engine: Engine) -> None:
    info = engine.model_info()
    assert info["image_token"] == "<image>"
    assert info["video_token"] is None


@pytest.mark.thread_only("computes the reference embeddings with the runner's model")
def test_precomputed_embeddings_take_the_place_of_the_encoder(engine: Engine) -> None:
    image = make_image(71)
    engine.flush_cache().result()
    direct = engine.generate("<image> what?", GREEDY, image_data=image)
    request = engine._preparer.prepare(
        GenerateRequest.parse({"text": "<image> what?"}).model_copy(update={"image_data": image})
    )
    item = request.multimodal.items[0]
    with torch.no_grad():
        feature = engine.runner.model.encode_media([item])[0]
    engine.flush_cache().result()
    given = engine.generate(
        "<image> what?",
        GREEDY,
        image_data={"format": "precomputed_embedding", "feature": feature.tolist()},
    )
    assert given["output_ids"] == direct["output_ids"]


def test_an_image_split_across_prefill_chunks_gives_the_same_output(
    engine: Engine, tmp_path: Path
) -> None:
    image = make_image(81)
    prompt = "User: <image> What colour is the square? Answer briefly."
    engine.flush_cache().result()
    whole = engine.generate(prompt, GREEDY, image_data=image)
    path = build_tiny_llava(tmp_path / "chunked")
    # 7-token chunks: the image's 16 positions are computed over three steps.
    with Engine(str(path), **{**ENGINE, "chunked_prefill_size": 7}) as chunked:
        split = chunked.generate(prompt, GREEDY, image_data=image)
        chunked.check_invariants()
    assert split["output_ids"] == whole["output_ids"]


def test_prompt_logprobs_of_the_text_after_the_last_image(engine: Engine) -> None:
    image = make_image(91)
    prompt = "<image> The answer is red"
    tail = len(engine.tokenizer.encode(" The answer is red"))
    start = 16  # the first position after the image
    out = engine.generate(
        prompt,
        {"max_new_tokens": 1, "temperature": 0},
        image_data=image,
        return_logprob=True,
        logprob_start_len=start,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert len(entries) == tail
    assert all(token >= 0 for _, token, _ in entries)
    with pytest.raises(InvalidRequest) as caught:
        engine.generate(prompt, GREEDY, image_data=image, return_logprob=True, logprob_start_len=3)
    assert caught.value.field == "logprob_start_len"
    assert "after the last image" in caught.value.message
