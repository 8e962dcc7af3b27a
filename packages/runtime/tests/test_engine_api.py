"""The Engine's SGLang-shaped API on a tiny random Llama: outputs, batches, n, streaming, errors."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import ForceTokenProcessor, build_tiny_model
from radixlm.runtime.messages import Call
from radixlm.sampling import EngineOverloaded, GenerateChunk, GenerateRequest, InvalidRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
# What the server's EngineClient protocol needs (checked by name: the runtime must not import
# radixlm.server).
ENGINE_CLIENT_MEMBERS = ("generate", "abort", "flush_cache", "model_info", "server_info")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Engine]:
    """The engine core on a thread and in its own process: the public API behaves the same."""
    process = request.param == "process"
    with Engine(
        str(model_dir), show_progress=False, max_total_tokens=4096, engine_process=process
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.eval()  # type: ignore[no-untyped-call]
    return model


def test_output_has_sglang_shape(engine: Engine) -> None:
    out = engine.generate("hello world", GREEDY)
    assert set(out) == {"index", "text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("hello world"))
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])


def test_greedy_output_equals_transformers_generate(engine: Engine, hf_model: Any) -> None:
    ids = engine.tokenizer.encode("the radix tree caches the prefix")
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    expected = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
    )[0, len(ids) :]
    assert out["output_ids"] == expected.tolist()


def test_batch_and_n_return_prompt_major_lists(engine: Engine) -> None:
    outs = engine.generate(["hello", "the cache"], {**GREEDY, "n": 2})
    assert [o["index"] for o in outs] == [0, 1, 2, 3]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]  # greedy: the n copies agree
    alone = engine.generate("the cache", GREEDY)
    assert outs[2]["output_ids"] == alone["output_ids"]


def test_n_sequences_reuse_the_prompt_prefilled_once(engine: Engine) -> None:
    prompt = "one prompt prefilled once and forked four ways " * 3
    outs = engine.generate(prompt, {**GREEDY, "n": 4, "max_new_tokens": 2})
    length = outs[0]["meta_info"]["prompt_tokens"]
    assert [o["meta_info"]["cached_tokens"] for o in outs[1:]] == [length - 1] * 3


def test_seeded_sampling_is_reproducible_and_n_seeds_differ(engine: Engine) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 10, "seed": 7, "ignore_eos": True}
    a = engine.generate("sample me", params)
    b = engine.generate("sample me", params)
    outs = engine.generate("sample me", {**params, "n": 3})
    assert a["output_ids"] == b["output_ids"] == outs[0]["output_ids"]
    assert outs[1]["output_ids"] != outs[0]["output_ids"]


def test_stop_string_trims_the_text(engine: Engine) -> None:
    full = engine.generate("stop test", GREEDY)
    stop = full["text"][3:6]
    out = engine.generate("stop test", {**GREEDY, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full["text"][: full["text"].index(stop)]


def test_stream_chunks_are_cumulative_and_end_with_the_full_text(engine: Engine) -> None:
    chunks = list(engine.generate("stream me", GREEDY, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
    assert chunks[-1]["text"] == engine.generate("stream me", GREEDY)["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_incremental_streaming_option_sends_deltas(model_dir: Path) -> None:
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=1024,
        incremental_streaming_output=True,
    ) as eng:
        chunks = list(eng.generate("stream me", GREEDY, stream=True))
        whole = eng.generate("stream me", GREEDY)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]


def test_abort_ends_a_stream_with_finish_reason_abort(engine: Engine) -> None:
    stream = engine.generate("abort me", {**GREEDY, "max_new_tokens": 400}, stream=True, rid="ab")
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    assert bool(engine.abort("ab"))
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert not engine.abort("ab")
    engine.check_invariants()


def test_async_generate_awaits_results_and_streams(engine: Engine) -> None:
    async def main() -> tuple[Any, list[Any]]:
        result = await engine.async_generate("async", GREEDY)
        stream = await engine.async_generate("async", GREEDY, stream=True)
        return result, [chunk async for chunk in stream]

    result, chunks = asyncio.run(main())
    assert chunks[-1]["text"] == result["text"]


def test_engine_client_generate_takes_a_generate_request(engine: Engine) -> None:
    request = GenerateRequest(text="client", sampling_params=GREEDY, stream=True)

    async def main() -> list[Any]:
        return [chunk async for chunk in engine.generate(request)]

    chunks = asyncio.run(main())
    assert all(isinstance(chunk, GenerateChunk) for chunk in chunks)
    assert chunks[-1].finish_reason is not None
    assert chunks[-1].text == engine.generate("client", GREEDY)["text"]


def test_closing_an_async_stream_early_aborts_and_frees(engine: Engine) -> None:
    request = GenerateRequest(
        text="closed early", sampling_params={**GREEDY, "max_new_tokens": 500}, stream=True
    )

    async def main() -> None:
        stream = engine.generate(request)
        await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())
    engine.check_invariants()  # a command round trip: the abort was processed before it
    assert engine.server_info(fresh=True)["num_running_reqs"] == 0
    engine.check_invariants()


def test_engine_satisfies_the_engine_client_protocol_structurally(engine: Engine) -> None:
    for name in ENGINE_CLIENT_MEMBERS:
        assert callable(getattr(engine, name))
    assert engine.tokenizer is not None

    async def main() -> tuple[bool, bool]:
        return await engine.abort("unknown"), await engine.flush_cache()

    assert asyncio.run(main()) == (False, True)
    info = engine.model_info()
    assert info["max_context_length"] > 0 and info["eos_token_ids"] == [0]
    assert info["chat_template"] and info["is_generation"] is True
    stats = engine.server_info()
    for key in ("num_running_reqs", "num_queued_reqs", "cache_hit_rate", "token_usage"):
        assert key in stats
    # The compute dtype auto chose, and why (the tiny model is a float32 checkpoint).
    assert stats["dtype"] == "float32" and "float32" in stats["dtype_reason"]
    json.dumps(stats)


def test_prompt_scoring_returns_input_logprobs_like_transformers(
    engine: Engine, hf_model: Any
) -> None:
    ids = engine.tokenizer.encode("score this prompt please")
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
    scored = meta["input_token_logprobs"]
    assert [t[1] for t in scored] == ids and scored[0][0] is None
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [float(logits[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert [t[0] for t in scored[1:]] == pytest.approx(expected, abs=1e-4)
    assert len(meta["input_top_logprobs"][1]) == 2


def test_scoring_a_one_token_prompt_gives_its_none_entry(engine: Engine) -> None:
    out = engine.generate(
        input_ids=[42],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert out["meta_info"]["input_token_logprobs"] == [[None, 42, None]]


def test_output_logprobs_with_top_and_text(engine: Engine) -> None:
    out = engine.generate(
        "logprobs",
        GREEDY,
        return_logprob=True,
        top_logprobs_num=3,
        token_ids_logprob=[5, 6],
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    chosen = meta["output_token_logprobs"]
    assert [t[1] for t in chosen] == out["output_ids"]
    assert all(t[0] <= 0 and isinstance(t[2], str) for t in chosen)
    top = meta["output_top_logprobs"][0]
    assert len(top) == 3 and top[0][1] == out["output_ids"][0]  # greedy picks the best
    assert [t[1] for t in meta["output_token_ids_logprobs"][0]] == [5, 6]


def test_bad_input_raises_invalid_request_naming_the_field(engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as too_long:
        engine.generate(input_ids=[5] * (engine.context_length + 1))
    assert too_long.value.field == "input_ids"
    with pytest.raises(InvalidRequest) as outside:
        engine.generate(input_ids=[10**6])
    assert outside.value.field == "input_ids"
    with pytest.raises(InvalidRequest) as custom:
        engine.generate("x", custom_logit_processor='{"callable": "a:b"}')
    assert custom.value.field == "custom_logit_processor"
    with pytest.raises(InvalidRequest) as grammar:
        engine.generate("x", {"json_schema": json.dumps({"type": "object", "properties": 5})})
    assert grammar.value.field == "json_schema"


def test_grammar_error_fails_only_its_request_before_any_chunk(engine: Engine) -> None:
    bad = GenerateRequest(text="x", sampling_params={"regex": "(unclosed"}, stream=True)
    good = GenerateRequest(text="y", sampling_params=GREEDY)

    async def failing() -> None:
        async for _chunk in engine.generate(bad):
            raise AssertionError("no chunk expected")

    async def fine() -> list[Any]:
        return [chunk async for chunk in engine.generate(good)]

    async def main() -> list[Any]:
        return list(await asyncio.gather(failing(), fine(), return_exceptions=True))

    error, chunks = asyncio.run(main())
    assert isinstance(error, InvalidRequest) and error.field == "regex"
    assert chunks[-1].finish_type == "length"


def test_custom_logit_processor_runs_when_enabled(model_dir: Path) -> None:
    processor = ForceTokenProcessor.to_str()
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=1024,
        enable_custom_logit_processor=True,
    ) as eng:
        out = eng.generate(
            "x",
            {"max_new_tokens": 4, "ignore_eos": True, "custom_params": {"token_id": 42}},
            custom_logit_processor=processor,
        )
    assert out["output_ids"] == [42] * 4


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(model_dir: Path) -> None:
    processor = ForceTokenProcessor.to_str()
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=1024,
        enable_custom_logit_processor=True,
    ) as eng:
        with pytest.raises(RuntimeError, match="step failed"):
            eng.generate(
                "x",
                {"max_new_tokens": 4, "custom_params": {"token_id": "not a number"}},
                custom_logit_processor=processor,
            )
        assert eng.generate("x", GREEDY)["meta_info"]["finish_reason"]["type"] == "length"
        eng.check_invariants()


def test_unenforced_parameters_are_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as error:
        engine.generate("x", {"thinking_token_budget": 8})
    assert error.value.field == "thinking_token_budget"

    async def with_image() -> None:
        async for _chunk in engine.generate(GenerateRequest(text="x", image_data="img.png")):
            pass

    with pytest.raises(InvalidRequest) as error:
        asyncio.run(with_image())
    assert error.value.field == "image_data"


@pytest.mark.thread_only("holds the loop with a Call")
def test_queue_beyond_max_queued_requests_is_refused(model_dir: Path) -> None:
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=1024,
        max_queued_requests=2,
        max_running_requests=1,
    ) as eng:
        release = threading.Event()
        # Hold the engine loop so that submitted requests stay queued.
        eng._connection.post(Call(lambda core: release.wait(30), reply=-1))
        # One will run, two wait; the scheduler refuses the fourth when it queues it.
        streams = [eng.generate(f"p{i}", GREEDY, stream=True) for i in range(3)]
        extra = eng.generate("one too many", GREEDY, stream=True)
        release.set()
        with pytest.raises(EngineOverloaded):
            list(extra)
        for stream in streams:
            assert list(stream)[-1]["meta_info"]["finish_reason"] is not None


@pytest.mark.thread_only("holds the loop with a Call")
def test_burst_that_free_running_slots_take_is_not_refused(model_dir: Path) -> None:
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=2048,
        max_queued_requests=2,
        max_running_requests=16,
    ) as eng:
        release = threading.Event()
        eng._connection.post(Call(lambda core: release.wait(30), reply=-1))
        # Twelve arrive before the loop admits any: they fit in the running slots.
        streams = [eng.generate(f"burst {i}", GREEDY, stream=True) for i in range(12)]
        release.set()
        for stream in streams:
            assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "length"
        eng.check_invariants()


def test_sampling_defaults_come_from_generation_config(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", generation_config={"temperature": 0.0, "top_k": 1})
    with Engine(str(path), show_progress=False, max_total_tokens=1024) as eng:
        assert eng.sampling_defaults.effective["top_k"] == 1
        a = eng.generate("defaults", {"max_new_tokens": 6, "ignore_eos": True})
        b = eng.generate("defaults", {"max_new_tokens": 6, "ignore_eos": True})
        assert a["output_ids"] == b["output_ids"]  # greedy by the model's defaults
    with Engine(
        str(path), show_progress=False, max_total_tokens=1024, sampling_defaults="openai"
    ) as eng:
        assert dict(eng.sampling_defaults.effective) == {}


def test_flush_cache_refuses_while_requests_run(engine: Engine) -> None:
    stream = engine.generate("busy", {**GREEDY, "max_new_tokens": 300}, stream=True, rid="busy")
    next(stream)
    assert not engine.flush_cache()
    engine.abort("busy")
    list(stream)
    assert engine.flush_cache()
    assert engine.server_info(fresh=True)["cache_size"] == 0


def test_unknown_engine_argument_suggests_the_closest(model_dir: Path) -> None:
    with pytest.raises(TypeError, match="schedule_policy"):
        Engine(str(model_dir), schedule_polcy="lpm")


def test_queued_chunks_of_a_sequence_merge_into_what_both_said() -> None:
    from radixlm.runtime.engine import _coalesce
    from radixlm.sampling import FinishReason, LogprobEntry

    def chunk(text: str, ids: tuple[int, ...], lps: tuple[int, ...], **extra: Any) -> Any:
        entries = tuple(LogprobEntry(-1.0, t) for t in lps)
        return GenerateChunk("r", 0, text, ids, 3, len(ids), output_token_logprobs=entries, **extra)

    first = chunk("He", (1,), (1,))
    second = chunk("Hello", (1, 2), (2,), finish_reason=FinishReason("length"))
    merged = _coalesce(first, second, incremental=False)
    assert (merged.text, merged.output_ids) == ("Hello", (1, 2))  # cumulative: the later one's
    assert [e.token_id for e in merged.output_token_logprobs or ()] == [1, 2]  # new entries add
    assert merged.finish_reason == FinishReason("length")
    deltas = _coalesce(chunk("He", (1,), ()), chunk("llo", (2,), ()), incremental=True)
    assert (deltas.text, deltas.output_ids) == ("Hello", (1, 2))
