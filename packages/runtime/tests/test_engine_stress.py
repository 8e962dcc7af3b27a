"""Stress: 300 concurrent requests under a KV pool small enough to force eviction and retraction."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine, EngineConfig
from radixlm.runtime.fixtures import build_tiny_model, sample_texts
from radixlm.sampling import GenerateRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REQUESTS = 300
POOL = 700


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _workload(seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prefixes = sample_texts(6, seed=seed, words=40)
    suffixes = sample_texts(REQUESTS, seed=seed + 1, words=10)
    items = []
    for i in range(REQUESTS):
        params: dict[str, Any] = {"max_new_tokens": rng.randint(4, 32)}
        greedy = rng.random() < 0.5
        if greedy:
            params["temperature"] = 0
        else:
            params.update(temperature=rng.choice([0.7, 1.0]), top_p=0.9, seed=rng.randrange(999))
        if rng.random() < 0.3:
            params["stop"] = [rng.choice(["e", "th", "a ", "on", "er"])]
        if rng.random() < 0.1:
            params["regex"] = rng.choice(["(yes|no)", "[a-z]{2,6}", "(France|England)!"])
        if rng.random() < 0.05:
            params["n"] = 2
        items.append(
            {
                "rid": f"r{i}",
                "text": rng.choice(prefixes) + " " + suffixes[i],
                "params": params,
                "abort": rng.random() < 0.1,
                "greedy": greedy,
            }
        )
    return items


async def _one(engine: Engine, item: dict[str, Any]) -> list[dict[str, Any]]:
    request = GenerateRequest(
        text=item["text"], sampling_params=item["params"], rid=item["rid"], stream=True
    )
    finals: dict[int, dict[str, Any]] = {}
    seen = 0
    async for chunk in engine.generate(request):
        seen += 1
        if item["abort"] and seen == 2:
            await engine.abort(item["rid"])
        if chunk.finished:
            finals[chunk.index] = chunk.to_json()
    return [finals[k] for k in sorted(finals)]


@pytest.mark.thread_only("reads the pool and the cache's eviction count")
def test_every_request_ends_greedy_outputs_match_solo_runs_and_nothing_leaks(
    model_dir: Path,
) -> None:
    base = EngineConfig.from_kwargs(
        str(model_dir),
        show_progress=False,
        max_total_tokens=POOL,
        max_running_requests=64,
        chunked_prefill_size=128,
    )
    # Admit optimistically so that decode runs out of slots and must retract.
    scheduler = dataclasses.replace(
        base.scheduler, init_new_token_ratio=0.02, min_new_token_ratio=0.0
    )
    config = dataclasses.replace(base, scheduler=scheduler)
    items = _workload()
    with Engine(config=config) as engine:

        async def main() -> list[list[dict[str, Any]]]:
            return await asyncio.gather(*(_one(engine, item) for item in items))

        results = asyncio.run(asyncio.wait_for(main(), timeout=600))
        engine.check_invariants()
        stats = engine.server_info()
        assert stats["num_running_reqs"] == stats["num_queued_reqs"] == 0
        pool = engine.runner.kv_pool
        assert pool.available + engine.cache.total_size == pool.num_slots
        assert stats["num_retractions"] > 0
        assert engine.cache.stats.evicted_tokens > 0
        assert stats["cache_hit_rate"] > 0.3

        for item, finals in zip(items, results, strict=True):
            n = item["params"].get("n", 1)
            assert len(finals) == n, item["rid"]  # every sequence ended
            reasons = {f["meta_info"]["finish_reason"]["type"] for f in finals}
            assert reasons <= {"stop", "length", "abort"}
            if "abort" in reasons:
                assert item["abort"], item["rid"]
        # Each greedy request, run alone, gives the same output.
        for item, finals in zip(items, results, strict=True):
            if not item["greedy"] or item["abort"]:
                continue
            alone = engine.generate(item["text"], item["params"])
            alone = alone if isinstance(alone, list) else [alone]
            got = [(f["output_ids"], f["text"]) for f in finals]
            assert got == [(a["output_ids"], a["text"]) for a in alone], item["rid"]
        engine.check_invariants()
        json.dumps(engine.server_info())
