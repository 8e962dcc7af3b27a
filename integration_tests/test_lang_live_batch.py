"""run_batch on the live server: results in order, and the prefix hint makes the batch hit the
radix cache (per-gen cached_tokens and the server's own hit-rate counters)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import endpoint_fixture, live_fixture, token_count  # noqa: F401

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(60)

FEW_SHOT = (
    "Answer each question with one word.\n"
    "Q: What colour is the sky?\nA: Blue\n"
    "Q: What colour is grass?\nA: Green\n"
)
QUESTIONS = ["a river", "a city", "the tree", "a model", "the answer", "a token"]


@sgl.function
def qa(s, question):
    s += FEW_SHOT
    s += "Q: What is " + question + "?\nA:" + sgl.gen("answer", max_tokens=4, stop="\n")


def _counters(info: dict) -> tuple[int, int, int]:
    return info["prompt_tokens"], info["cached_tokens"], info["finished_requests"]


def test_run_batch_returns_one_state_per_item_in_order(endpoint):
    states = qa.run_batch(
        [{"question": q} for q in QUESTIONS[:3]], backend=endpoint, progress_bar=False
    )
    assert [s.text().split("Q: What is ")[-1].split("?")[0] for s in states] == QUESTIONS[:3]


def test_run_batch_takes_tuples_of_arguments(endpoint):
    states = qa.run_batch([(q,) for q in QUESTIONS[:2]], backend=endpoint, progress_bar=False)
    assert all(f"What is {q}?" in s.text() for s, q in zip(states, QUESTIONS, strict=False))


def test_a_batch_gives_the_same_greedy_answers_as_single_runs(endpoint):
    batch = qa.run_batch(
        [{"question": q} for q in QUESTIONS[:3]],
        backend=endpoint,
        temperature=0,
        progress_bar=False,
    )
    single = [qa.run(question=q, backend=endpoint, temperature=0) for q in QUESTIONS[:3]]
    assert [s["answer"] for s in batch] == [s["answer"] for s in single]


def test_the_prefix_hint_makes_the_batch_hit_the_cache(endpoint, live):
    live.flush_cache()
    before = _counters(live.wait_idle())
    states = qa.run_batch(
        [{"question": q} for q in QUESTIONS], backend=endpoint, temperature=0, progress_bar=False
    )
    after = _counters(live.wait_idle())
    prompt, cached, finished = (a - b for a, b in zip(after, before, strict=True))
    # One hint request (the few-shot prefix, max_new_tokens=0), then one gen per item.
    assert finished == len(QUESTIONS) + 1
    shared = token_count(live, FEW_SHOT)
    assert all(s.get_meta_info("answer")["cached_tokens"] >= shared for s in states)
    # The batch's hit rate by the server's own counters: everything but the hint and the
    # questions came from the cache.
    assert cached >= len(QUESTIONS) * shared
    assert cached / prompt > 0.7


def test_the_servers_hit_rate_rises_over_a_batch(endpoint, live):
    before = live.wait_idle()["cache_hit_rate"]
    long_shot = FEW_SHOT * 6  # a long shared prefix: the batch is mostly cache hits

    @sgl.function
    def prog(s, question):
        s += long_shot + "Q: What is " + question + "?\nA:" + sgl.gen("answer", max_tokens=2)

    prog.run_batch([{"question": q} for q in QUESTIONS * 2], backend=endpoint, progress_bar=False)
    assert live.wait_idle()["cache_hit_rate"] > before


def test_run_batch_shows_a_progress_bar(endpoint, capsys):
    qa.run_batch([{"question": "a?"}, {"question": "b?"}], backend=endpoint)
    assert "2/2" in capsys.readouterr().err


def test_a_failing_item_does_not_stop_the_batch(endpoint):
    @sgl.function
    def prog(s, temperature):
        s += "Q: Capital of France?\nA:" + sgl.gen("answer", max_tokens=2, temperature=temperature)

    good, bad = prog.run_batch(
        [{"temperature": 0.0}, {"temperature": -1.0}], backend=endpoint, progress_bar=False
    )
    assert good.error() is None and isinstance(good["answer"], str)
    assert bad.error() is not None and "temperature" in str(bad.error())
