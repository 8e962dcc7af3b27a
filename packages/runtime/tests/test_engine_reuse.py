"""Prefix reuse through the engine: a shared 500-token prefix is computed once."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Thread mode only: the runner's forward counts and the cache.
pytestmark = pytest.mark.thread_only("the runner's forward counts and the cache")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _prompts(vocab: int) -> tuple[list[int], list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(5, vocab) for _ in range(500)]
    return [*prefix, 7, 8, 9, 10], [*prefix, 11, 12, 13]


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_second_request_reuses_the_shared_prefix(model_dir: Path, policy: str) -> None:
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    with Engine(
        str(model_dir), show_progress=False, max_total_tokens=4096, schedule_policy=policy
    ) as engine:
        first, second = _prompts(engine.runner.vocab_size)
        engine.generate(input_ids=first, sampling_params=params)
        before = engine.runner.stats.tokens_forwarded
        out = engine.generate(input_ids=second, sampling_params=params)
        forwarded = engine.runner.stats.tokens_forwarded - before
        cached = out["meta_info"]["cached_tokens"]
        assert cached >= 499
        # The runner computes the uncached prompt tokens once, then one token per decode step.
        assert forwarded == len(second) - cached + 3
        engine.check_invariants()


def test_disabled_cache_recomputes_everything(model_dir: Path) -> None:
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    with Engine(
        str(model_dir), show_progress=False, max_total_tokens=4096, disable_radix_cache=True
    ) as engine:
        first, second = _prompts(engine.runner.vocab_size)
        cached_out = engine.generate(input_ids=first, sampling_params=params)
        out = engine.generate(input_ids=second, sampling_params=params)
        assert out["meta_info"]["cached_tokens"] == 0
        assert cached_out["meta_info"]["cached_tokens"] == 0
        engine.check_invariants()
        assert engine.runner.kv_pool.available == engine.runner.kv_pool.num_slots


def test_outputs_with_and_without_the_cache_agree(model_dir: Path) -> None:
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    outs = []
    for disable in (False, True):
        with Engine(
            str(model_dir),
            show_progress=False,
            max_total_tokens=4096,
            disable_radix_cache=disable,
        ) as engine:
            first, second = _prompts(engine.runner.vocab_size)
            outs.append(
                [
                    engine.generate(input_ids=p, sampling_params=params)["output_ids"]
                    for p in (first, second)
                ]
            )
    assert outs[0] == outs[1]


def test_paged_pool_gives_the_same_outputs(model_dir: Path) -> None:
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outs = []
    for page_size in (1, 4):
        with Engine(
            str(model_dir), show_progress=False, max_total_tokens=4096, page_size=page_size
        ) as engine:
            first, second = _prompts(engine.runner.vocab_size)
            results = [
                engine.generate(input_ids=p, sampling_params=params) for p in (first, second)
            ]
            outs.append([r["output_ids"] for r in results])
            if page_size == 4:  # whole pages only: 500 shared tokens -> 500 cached
                assert results[1]["meta_info"]["cached_tokens"] == 500
            engine.check_invariants()
    assert outs[0] == outs[1]
