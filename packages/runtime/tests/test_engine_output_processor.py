"""Detokenization and text stops on the front end: the core sends token ids (`SeqDelta`), the
front end's `RequestOutput` makes the text, finds stop strings and tells the core to stop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model, build_tiny_tokenizer
from radixlm.runtime.messages import EngineRequest, LogprobOptions, SeqDelta
from radixlm.runtime.output_processor import RequestOutput
from radixlm.sampling import FinishReason, LogprobEntry, SamplingParams

OPTIONS: dict[str, Any] = {"show_progress": False, "max_total_tokens": 4096}
GREEDY: dict[str, Any] = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


# ------------------------------------------------------------------- RequestOutput alone


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _ids(tok: Any, text: str) -> tuple[int, ...]:
    return tuple(tok(text, add_special_tokens=False).input_ids)


def _request(**fields: Any) -> EngineRequest:
    params = SamplingParams(**fields.pop("params", {}))
    return EngineRequest(rid="r", prompt_ids=(1, 2, 3), params=params, max_new_tokens=64, **fields)


def test_a_stop_string_inside_one_delta_drops_the_tokens_after_it(tok: Any) -> None:
    output = RequestOutput(_request(params={"stop": "world"}), tok, (0,))
    first = _ids(tok, "hello world")
    after = _ids(tok, " and more")
    chunk, stop_core = output.apply(SeqDelta("r", 0, first + after))
    assert stop_core is True  # the core still runs it: the caller must stop it
    assert chunk is not None and chunk.finish_reason == FinishReason("stop", matched="world")
    assert chunk.text == "hello "
    assert chunk.output_ids == first and chunk.completion_tokens == len(first)
    # What the core sends later for this sequence (its own end included) changes nothing.
    late, again = output.apply(SeqDelta("r", 0, (5,), finish=FinishReason("length")))
    assert late is None and again is False


def test_rollback_takes_back_ids_text_and_logprobs_and_texts_are_written(tok: Any) -> None:
    request = _request(
        stream=True,
        incremental=True,
        logprobs=LogprobOptions(enabled=True, with_text=True),
    )
    output = RequestOutput(request, tok, (0,))
    a, b, c = _ids(tok, "x y z")[:3]

    def lps(*ids: int) -> tuple[LogprobEntry, ...]:
        return tuple(LogprobEntry(-1.0, i) for i in ids)

    first, _ = output.apply(SeqDelta("r", 0, (a, b), output_logprobs=lps(a, b)))
    assert first is not None and first.output_ids == (a, b)
    assert [e.text for e in first.output_token_logprobs or ()] == [
        tok.decode([a]),
        tok.decode([b]),
    ]
    # The core took b back and appended c (jump-forward re-tokenization), then finished.
    last, stop_core = output.apply(
        SeqDelta(
            "r",
            0,
            (c,),
            rollback=1,
            output_logprobs=lps(c),
            finish=FinishReason("length"),
        )
    )
    assert stop_core is False and last is not None and last.finished
    seq = output.seqs[0]
    assert seq.output.output_ids == [a, c]
    assert [e.token_id for e in seq.output_logprobs] == [a, c]
    assert seq.output.text == tok.decode([a, c], clean_up_tokenization_spaces=False)


def test_a_stop_token_of_the_core_leaves_its_text_out(tok: Any) -> None:
    output = RequestOutput(_request(params={"stop_token_ids": [7]}), tok, (0,))
    hello = _ids(tok, "hello")
    chunk, stop_core = output.apply(
        SeqDelta("r", 0, (*hello, 7), finish=FinishReason("stop", matched=7))
    )
    assert stop_core is False
    assert chunk is not None and chunk.text == "hello" and chunk.output_ids == (*hello, 7)


# ------------------------------------------------------------------ through the engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), engine_process=request.param == "process", **OPTIONS) as eng:
        yield eng


def _a_stop_string(engine: Engine, prompt: str) -> tuple[str, str]:
    """A stop string from the middle of the prompt's greedy continuation, and the text
    before its first occurrence."""
    text = engine.generate(prompt, GREEDY)["text"]
    starts = range(len(text) // 3, len(text) - 3)
    stop = next(s for k in starts if (s := text[k : k + 3]).strip() and "\ufffd" not in s)
    return stop, text[: text.index(stop)]


def test_a_stop_string_found_by_the_front_end_ends_and_caches_the_sequence(
    engine: Engine,
) -> None:
    prompt = "The quick brown fox"
    stop, expected = _a_stop_string(engine, prompt)
    assert engine.flush_cache()  # what is cached next comes from the stopped request alone
    out = engine.generate(prompt, {**GREEDY, "stop": stop})
    meta = out["meta_info"]
    assert out["text"] == expected
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert meta["completion_tokens"] == len(out["output_ids"])
    decoded = engine.tokenizer.decode(out["output_ids"], clean_up_tokenization_spaces=False)
    assert decoded.startswith(expected) and stop in decoded
    # The core stopped it (nothing runs, no slot lost) and cached it, as a stop in the core
    # would have: the prompt and the output up to the stop come from the cache next time.
    assert engine.server_info(fresh=True)["num_running_reqs"] == 0
    engine.check_invariants()
    prompt_ids = engine.tokenizer(prompt).input_ids
    again = engine.generate(
        input_ids=prompt_ids + out["output_ids"], sampling_params={**GREEDY, "max_new_tokens": 1}
    )
    assert again["meta_info"]["cached_tokens"] >= len(prompt_ids) + len(out["output_ids"]) - 1


def test_streamed_pieces_with_a_stop_string_join_to_the_whole_text(engine: Engine) -> None:
    prompt = "Once upon a time"
    stop, expected = _a_stop_string(engine, prompt)
    chunks = list(engine.generate(prompt, {**GREEDY, "stop": stop}, stream=True))
    assert chunks[-1]["text"] == expected  # cumulative text
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all(expected.startswith(c["text"]) for c in chunks)


def test_each_of_n_sequences_stops_on_its_own(engine: Engine) -> None:
    prompt = "Hello there"
    stop, expected = _a_stop_string(engine, prompt)
    outs = engine.generate(prompt, {**GREEDY, "stop": stop, "n": 3})
    assert [o["text"] for o in outs] == [expected] * 3
    assert engine.server_info(fresh=True)["num_running_reqs"] == 0
    engine.check_invariants()


def _assert_ordered(stamps: dict[str, Any]) -> None:
    order = ["arrival", "scheduled", "first_token", "last_token", "detokenized"]
    assert set(stamps) == set(order)
    values = [stamps[k] for k in order]
    assert all(isinstance(v, float) for v in values), stamps
    assert values == sorted(values), stamps
    assert abs(values[-1] - time.time()) < 60  # seconds since the epoch


def test_the_final_chunk_says_when_the_request_arrived_ran_and_was_detokenized(
    engine: Engine,
) -> None:
    chunks = list(engine.generate("A timed prompt", GREEDY, stream=True))
    assert all("timestamps" not in c["meta_info"] for c in chunks[:-1])
    stamps = chunks[-1]["meta_info"]["timestamps"]
    _assert_ordered(stamps)
    assert stamps["last_token"] > stamps["first_token"]  # 16 tokens: decode steps ran


def test_a_sequence_ended_by_a_front_end_stop_string_has_its_timestamps(engine: Engine) -> None:
    prompt = "Stamped stop"
    stop, _ = _a_stop_string(engine, prompt)
    out = engine.generate(prompt, {**GREEDY, "stop": stop})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    _assert_ordered(out["meta_info"]["timestamps"])
