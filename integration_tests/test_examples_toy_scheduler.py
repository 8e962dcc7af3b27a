"""examples/toy_scheduler.py: radixlm-cache alone under a toy scheduler, run as a script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "toy_scheduler.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    done = _run("--json")
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_every_turn_of_every_chat_is_served(figures: dict[str, Any]) -> None:
    assert figures["small"]["requests"] == figures["unbounded"]["requests"] == 12 * 3
    assert figures["small"]["prompt_tokens"] == figures["unbounded"]["prompt_tokens"]


def test_the_reported_hit_rate_is_cached_over_prompt_tokens(figures: dict[str, Any]) -> None:
    for run in figures.values():
        assert run["hit_rate"] == pytest.approx(run["cached_tokens"] / run["prompt_tokens"])


def test_shared_prefixes_hit_the_cache_even_in_the_small_pool(figures: dict[str, Any]) -> None:
    small, unbounded = figures["small"], figures["unbounded"]
    assert 0.5 < small["hit_rate"] <= unbounded["hit_rate"] < 1.0


def test_the_small_pool_evicts_and_never_overflows(figures: dict[str, Any]) -> None:
    small, unbounded = figures["small"], figures["unbounded"]
    assert small["evicted_tokens"] > 0 and unbounded["evicted_tokens"] == 0
    assert small["peak_used"] <= small["pool"] < unbounded["peak_used"]


def test_no_slot_leaks_every_slot_is_free_or_cached(figures: dict[str, Any]) -> None:
    for run in figures.values():
        assert run["free"] + run["cached_at_end"] == run["pool"]


def test_the_human_readable_report_states_the_hit_rate_and_no_leak() -> None:
    done = _run("--pool", "256")
    assert done.returncode == 0, done.stderr
    assert "hit rate" in done.stdout
    assert "no leak:" in done.stdout and "= 256 slots" in done.stdout


def test_a_pool_too_small_for_one_request_fails_with_a_clear_error() -> None:
    done = _run("--pool", "64")
    assert done.returncode != 0
    assert "needs more than the 64-slot pool" in done.stderr
