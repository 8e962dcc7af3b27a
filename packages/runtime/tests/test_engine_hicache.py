"""The hierarchical cache through the engine: with a KV pool that holds a few tenants' prefixes,
outputs equal those of an engine whose pool holds them all, while what was evicted comes back
from host memory (and from storage, across a restart) instead of being computed again; under
every write policy, with no KV slot or host page lost."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
PAGE = 16


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    """Engines with `cpu_threads` set this process's torch threads, the module's shared
    fixtures' too: put them back after the module, so that later tests run as they would
    alone (a module fixture outlives a function-scoped restore)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _keep_torch_threads_per_test() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hicache") / "llama", init_std=0.3)


def _tenants(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(count)]


def _workload(tenants: list[list[int]], requests: int, seed: int = 1) -> list[list[int]]:
    """Requests that each take a tenant's prefix and ask something of their own (a random
    order: prefixes are evicted and come back)."""
    rng = random.Random(seed)
    return [
        rng.choice(tenants) + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))]
        for _ in range(requests)
    ]


def _engine(model: Path, **kwargs: Any) -> Engine:
    return Engine(str(model), show_progress=False, cpu_threads=1, max_running_requests=2, **kwargs)


def _with_storage(directory: Path) -> dict[str, Any]:
    """A small pool with the host tier and file storage in `directory`."""
    return {
        "max_total_tokens": 256,
        "enable_hierarchical_cache": True,
        "hicache_page_size": PAGE,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(directory),
    }


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    # One request at a time: which requests share a step (and so the numerics of a batch)
    # is the same in every engine compared.
    outs = [
        engine.generate(input_ids=[p], sampling_params=GREEDY)[0]["output_ids"] for p in prompts
    ]
    engine.check_invariants()
    return outs


@pytest.fixture(scope="module")
def reference(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The workload and its outputs on a pool that holds every tenant's prefix."""
    prompts = _workload(_tenants(6, 96), 24)
    with _engine(model, max_total_tokens=8192) as engine:
        return prompts, _run(engine, prompts)


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_outputs_are_the_big_pools_and_evicted_prefixes_come_back_from_host(
    model: Path, reference: tuple[list[list[int]], list[list[int]]], policy: str
) -> None:
    prompts, want = reference
    # 256 slots: two tenants' prefixes (96 tokens each) and what runs beside them.
    with _engine(
        model,
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
        hicache_page_size=PAGE,
        hicache_write_policy=policy,
    ) as engine:
        got = _run(engine, prompts)
        info = engine.get_server_info()
    assert got == want
    assert info["hicache_host_hit_tokens"] > 0 and info["host_cached_tokens"] > 0
    assert info["hicache_host_pages"] > 0
    if policy == "write_back":
        assert info["hicache_written_through_pages"] == 0 and info["hicache_demoted_pages"] > 0
    if policy == "write_through":
        assert info["hicache_written_through_pages"] > 0


def test_without_tiers_the_small_pool_recomputes(
    model: Path, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """The control: the same workload on the small pool alone gives the same outputs
    (computing an evicted prefix again or bringing it back makes no difference) and hits
    less (what the tiers bring back is really what eviction lost)."""
    prompts, want = reference
    with _engine(model, max_total_tokens=256) as small:
        assert _run(small, prompts) == want
        plain = small.get_server_info()
    with _engine(
        model, max_total_tokens=256, enable_hierarchical_cache=True, hicache_page_size=PAGE
    ) as tiered:
        _run(tiered, prompts)
        info = tiered.get_server_info()
    assert info["cached_tokens"] > plain["cached_tokens"]
    assert "hicache_host_hit_tokens" not in plain  # no tiers, no tier counters


def test_meta_info_says_where_a_prefix_came_from(model: Path) -> None:
    tenants = _tenants(3, 96, seed=5)
    with _engine(
        model, max_total_tokens=160, enable_hierarchical_cache=True, hicache_page_size=PAGE
    ) as engine:
        for tenant in tenants:  # each pushes the one before out of the pool
            engine.generate(input_ids=[[*tenant, 7, 8]], sampling_params=GREEDY)
        out = engine.generate(input_ids=[tenants[0] + [9, 10]], sampling_params=GREEDY)[0]
        engine.check_invariants()
    meta = out["meta_info"]
    details = meta["cached_tokens_details"]
    assert details["host"] > 0 and details["storage"] == 0
    assert details["device"] + details["host"] == meta["cached_tokens"] >= 80


def test_storage_pages_survive_a_restart(model: Path, tmp_path: Path) -> None:
    """A second engine on the same storage directory finds the first one's prefixes there
    (its own host pool starts empty), with the same outputs."""
    tenants = _tenants(3, 96, seed=7)
    prompts = [[*t, 11, 12, 13] for t in tenants]
    kwargs = _with_storage(tmp_path / "pages")
    with _engine(model, **kwargs) as first:
        before = _run(first, prompts)
        written = first.get_server_info()["hicache_storage_written_pages"]
    assert written >= 3 * (96 // PAGE)
    assert len(list((tmp_path / "pages").rglob("*"))) > written  # files and their folders
    with _engine(model, **kwargs) as second:
        after = _run(second, prompts)
        info = second.get_server_info()
    assert after == before
    assert info["hicache_storage_hit_tokens"] >= 3 * 80 and info["storage_cached_tokens"] > 0
    assert info["hicache_storage_read_pages"] >= 3 * (96 // PAGE)


def test_storage_pages_are_read_ahead_while_a_request_waits(model: Path, tmp_path: Path) -> None:
    """A queued request's storage pages are read on a thread while it waits behind another
    (two at once with one running): its admission takes them from memory."""
    tenants = _tenants(2, 96, seed=8)
    kwargs = _with_storage(tmp_path)
    with _engine(model, **kwargs) as first:
        want = _run(first, [[*t, 3] for t in tenants])
    params = {**GREEDY, "max_new_tokens": 40}
    with Engine(str(model), show_progress=False, cpu_threads=1, max_running_requests=1,
                **kwargs) as second:  # fmt: skip
        outs = second.generate(input_ids=[[*t, 3] for t in tenants], sampling_params=params)
        second.check_invariants()
        info = second.get_server_info()
    assert [o["output_ids"][: len(w)] for o, w in zip(outs, want, strict=True)] == want
    assert info["hicache_prefetched_pages"] > 0 and info["hicache_storage_hit_tokens"] >= 2 * 80


def test_a_damaged_storage_page_is_a_miss(model: Path, tmp_path: Path) -> None:
    tenant = _tenants(1, 64, seed=9)[0]
    kwargs = _with_storage(tmp_path)
    with _engine(model, **kwargs) as first:
        want = _run(first, [[*tenant, 5, 6]])
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert files
    for path in files:
        path.write_bytes(path.read_bytes()[:-1])  # torn copies
    with _engine(model, **kwargs) as second:
        got = _run(second, [[*tenant, 5, 6]])
        assert second.get_server_info()["hicache_storage_hit_tokens"] == 0
    assert got == want


def test_bad_settings_name_what_to_change(model: Path) -> None:
    with pytest.raises(ValueError, match="hicache_storage_dir"):
        _engine(model, enable_hierarchical_cache=True, hicache_storage_backend="file")
    with pytest.raises(ValueError, match="hicache_write_policy must be one of"):
        _engine(model, enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="needs the radix cache"):
        _engine(model, enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="multiple of the KV pool's page size"):
        _engine(model, enable_hierarchical_cache=True, page_size=16, hicache_page_size=24)


def test_a_smaller_host_dtype_holds_more_and_still_hits(model: Path) -> None:
    tenants = _tenants(3, 96, seed=11)
    with _engine(
        model,
        max_total_tokens=160,
        enable_hierarchical_cache=True,
        hicache_page_size=PAGE,
        hicache_host_dtype="bfloat16",
    ) as engine:
        for tenant in tenants + tenants:
            engine.generate(input_ids=[[*tenant, 7]], sampling_params=GREEDY)
        engine.check_invariants()
        info = engine.get_server_info()
    assert info["hicache_host_hit_tokens"] > 0


def test_a_paged_kv_pool_takes_whole_pages_back(
    model: Path, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """KV pages of 8 tokens under host pages of 32: what comes back is whole KV pages."""
    prompts, want = reference
    with _engine(
        model,
        max_total_tokens=256,
        page_size=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
        hicache_page_size=32,
    ) as engine:
        got = _run(engine, prompts)
        info = engine.get_server_info()
    assert got == want
    assert info["host_cached_tokens"] > 0 and info["host_cached_tokens"] % 8 == 0


def test_a_draft_model_recomputes_its_kv_of_a_prefix_that_came_back(
    model: Path, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """STANDALONE speculation (the model drafting for itself) over promoted prefixes: the
    same outputs, and its drafts still accepted as a self-draft's are (a draft K/V left from
    the slots' earlier owner would make them wrong)."""
    prompts, want = reference
    with _engine(
        model,
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
        hicache_page_size=PAGE,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(model),
        speculative_num_draft_tokens=3,
    ) as engine:
        engine.run_in_loop(_draft_always_and_catch_up)
        got = _run(engine, prompts)
        info = engine.get_server_info()
    assert got == want
    assert info["host_cached_tokens"] > 0 and info["spec_draft_tokens"] > 0
    assert info["spec_accepted_tokens"] >= 0.95 * info["spec_draft_tokens"]


def _draft_always_and_catch_up(core: Any) -> None:
    """Every step drafts, and a request catches up on any length of missing draft K/V (a
    promoted prefix's is all missing)."""
    drafter = core.scheduler.drafter
    drafter.threshold = lambda size: 0.0
    drafter.max_catch_up = 1 << 30
