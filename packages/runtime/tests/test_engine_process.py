"""The engine core in its own process: the same answers as the thread, and clean failure when
the process dies."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model
from radixlm.sampling import (
    EngineUnavailable,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
)

GREEDY: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
OPTIONS: dict[str, Any] = {"show_progress": False, "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def thread_engine(model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), **OPTIONS) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), engine_process=True, **OPTIONS) as eng:
        yield eng


def test_the_core_runs_in_another_process(engine: Engine) -> None:
    assert engine.engine_pid is not None and engine.engine_pid != os.getpid()
    info = engine.server_info()
    assert info["engine_mode"] == "process" and info["healthy"] is True
    assert info["num_running_reqs"] == 0 and "token_usage" in info
    assert info["max_total_num_tokens"] > 0


def test_outputs_equal_the_thread_modes(engine: Engine, thread_engine: Engine) -> None:
    prompts = ["The quick brown", "Hello there", "Once upon"]
    params = {**GREEDY, "n": 2}
    ours = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
    theirs = thread_engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
    assert [o["index"] for o in ours] == list(range(6))
    for a, b in zip(ours, theirs, strict=True):
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        ours_lp = [e[1] for e in a["meta_info"]["output_token_logprobs"]]
        assert ours_lp == [e[1] for e in b["meta_info"]["output_token_logprobs"]]


def test_streams_are_cumulative_and_typed_on_the_client_form(engine: Engine) -> None:
    request = GenerateRequest(text="stream me", sampling_params=GREEDY, stream=True)

    async def main() -> list[GenerateChunk]:
        return [chunk async for chunk in engine.generate(request)]

    chunks = asyncio.run(main())
    assert all(isinstance(c, GenerateChunk) for c in chunks)
    # Cumulative: each chunk extends the one before. Tokens of steps that finished before the
    # client read them come in one chunk (a fast engine process, a slow client), so the
    # count per chunk is not always one.
    lengths = [len(c.output_ids) for c in chunks]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 12, lengths
    for before, after in itertools.pairwise(chunks):
        assert after.output_ids[: len(before.output_ids)] == before.output_ids
    assert chunks[-1].finish_type == "length"
    assert chunks[-1].text == engine.generate("stream me", GREEDY)["text"]


def test_bad_input_is_refused_in_the_front_process(engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as error:
        engine.generate("x", {"max_new_tokens": 10**6})
    assert error.value.field == "max_new_tokens"


def test_a_grammar_error_fails_only_its_request(engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as error:
        engine.generate("x", {"regex": "(unclosed", "max_new_tokens": 4})
    assert error.value.field == "regex"
    assert engine.generate("y", GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_a_rid_in_use_is_refused(engine: Engine) -> None:
    stream = engine.generate("long", {**GREEDY, "max_new_tokens": 200}, stream=True, rid="dup")
    next(stream)
    with pytest.raises(InvalidRequest) as error:
        engine.generate("again", GREEDY, rid="dup")
    assert error.value.field == "rid"
    assert engine.abort("dup")
    final = list(stream)[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_flush_and_the_memory_check_cross_the_process(engine: Engine) -> None:
    engine.generate("fill the cache", GREEDY)
    engine.check_invariants()
    assert engine.flush_cache().result(10) is True
    assert engine.server_info()["cache_size"] == 0
    assert engine.server_info(fresh=True)["cache_size"] == 0
    with pytest.raises(RuntimeError, match="engine_process=False"):
        engine.run_in_loop(lambda core: None)


def test_a_model_that_cannot_load_fails_the_constructor(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    start = time.monotonic()
    with pytest.raises((ValueError, OSError, TypeError, RuntimeError)):
        Engine(str(tmp_path), engine_process=True, show_progress=False)
    assert time.monotonic() - start < 120


def test_killing_the_engine_ends_every_stream_and_a_restart_serves_again(
    model_dir: Path,
) -> None:
    with Engine(str(model_dir), engine_process=True, engine_restarts=1, **OPTIONS) as eng:
        eng.generate("warm up", GREEDY)
        ended: dict[int, float] = {}

        async def one(k: int) -> BaseException | None:
            request = GenerateRequest(
                text=f"stream {k}",
                sampling_params={**GREEDY, "max_new_tokens": 2000},
                stream=True,
            )
            try:
                async for _chunk in eng.generate(request):
                    pass
            except Exception as error:
                return error
            finally:
                ended[k] = time.monotonic()
            return None

        async def main() -> tuple[list[BaseException | None], float]:
            tasks = [asyncio.create_task(one(k)) for k in range(32)]
            await asyncio.sleep(1.0)
            pid = eng.engine_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 30)), killed

        errors, killed = asyncio.run(main())
        assert all(isinstance(e, EngineUnavailable) for e in errors), errors
        assert max(ended.values()) - killed < 5.0
        assert "died" in str(errors[0])
        deadline = time.monotonic() + 120
        while not eng.healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.healthy and not eng.failed
        out = eng.generate("after the restart", GREEDY)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        eng.check_invariants()


def test_without_restarts_a_dead_engine_stays_down(model_dir: Path) -> None:
    with Engine(str(model_dir), engine_process=True, **OPTIONS) as eng:
        pid = eng.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not eng.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.failed and not eng.healthy
        with pytest.raises(EngineUnavailable):
            eng.generate("nobody serves", GREEDY)
