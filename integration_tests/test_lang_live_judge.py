"""The paper's multi_dimensional_judge (branch-solve-merge), text-only, on the live server.

The program is the paper's with the image removed. One change is forced by the random model:
the summary in OUTPUT_REGEX is bounded ({1,24} instead of +) and holds letters, digits and
spaces only, so the constrained JSON always closes inside the token budget and stays valid JSON
(a random model seldom picks the closing '.', and `\\s` admits raw control characters).
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import endpoint_fixture, live_fixture  # noqa: F401

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(90)

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
OUTPUT_REGEX = r'\{"summary": "[\w\d ]{1,24}\.", "grade": "[ABCD][+-]?"\}'
GRADE_REGEX = r" [ABCD][+-]?"
ESSAYS = [
    ("Rivers", "Rivers shape valleys."),
    ("Rivers", "Deltas grow at river mouths."),
    ("Cities", "Paris is a city in France."),
    ("Cats", "Cats purr when happy."),
]
# Every gen without max_tokens takes this (the JSON needs at most about 40 tokens).
MAX_NEW_TOKENS = 48


@sgl.function
def multi_dimensional_judge(s, topic, essay):
    s += sgl.system("Evaluate an essay about a topic.")
    s += sgl.user("Topic: " + topic + "\nEssay: " + essay)
    s += sgl.assistant("Sure!")

    # Stop early if the essay is off topic.
    s += sgl.user("Is the essay related to the topic?")
    s += sgl.assistant(sgl.select("related", choices=["yes", "no"]))
    if s["related"] == "no":
        return

    # Branch: judge each dimension in parallel.
    forks = s.fork(len(DIMENSIONS))
    for f, dim in zip(forks, DIMENSIONS, strict=True):
        f += sgl.user(
            "Evaluate based on the following dimension: "
            + dim
            + ". End your judgment with the word 'END'"
        )
        f += sgl.assistant("Judgment:" + sgl.gen("judgment", stop="END"))

    # Merge, summarise, grade, then return JSON.
    judgment = "\n".join(f["judgment"] for f in forks)
    s += sgl.user("Provide the judgment, summary, and a letter grade")
    s += sgl.assistant(
        judgment
        + "In summary,"
        + sgl.gen("summary", stop=".")
        + "The grade of it is"
        + sgl.gen("grade", regex=GRADE_REGEX)
    )
    s += sgl.user("Return in the JSON format.")
    s += sgl.assistant(sgl.gen("output", regex=OUTPUT_REGEX))


@pytest.fixture(scope="module", params=["runtime_endpoint", "engine"])
def judged(request, live):
    """The judge run as a batch over ESSAYS through HTTP, and in-process on the same engine."""
    if request.param == "engine":
        backend = sgl.EngineBackend(live.engine)
    else:
        backend = sgl.RuntimeEndpoint(live.url, timeout=60)
    states = multi_dimensional_judge.run_batch(
        ESSAYS, backend=backend, temperature=0, max_new_tokens=MAX_NEW_TOKENS, progress_bar=False
    )
    yield states
    if isinstance(backend, sgl.EngineBackend):
        backend.shutdown()  # stops its event loop; the engine is the server's and keeps running
    else:
        backend.close()


def _related(states):
    return [s for s in states if s["related"] == "yes"]


def test_every_essay_is_judged_without_error(judged):
    assert [s.error() for s in judged] == [None] * len(ESSAYS)
    assert all(s["related"] in ("yes", "no") for s in judged)


def test_the_related_choice_is_the_best_scored(judged):
    for state in judged:
        scores = state.get_meta_info("related")["normalized_prompt_logprobs"]
        assert state["related"] == ["yes", "no"][scores.index(max(scores))]


def test_an_unrelated_essay_stops_after_the_select(judged):
    for state in judged:
        if state["related"] == "no":
            assert "summary" not in state and "output" not in state
            assert state.text().endswith("<|im_start|>assistant\nno<|im_end|>\n")


def test_a_related_essay_gets_a_grade_matching_its_regex(judged):
    related = _related(judged)
    assert related, "the tiny model judged no essay related; pick other ESSAYS"
    for state in related:
        assert re.fullmatch(GRADE_REGEX, state["grade"])
        assert "." not in state["summary"]


def test_a_related_essay_returns_json_matching_the_output_regex(judged):
    for state in _related(judged):
        assert re.fullmatch(OUTPUT_REGEX, state["output"])
        output = json.loads(state["output"])
        assert set(output) == {"summary", "grade"}
        assert re.fullmatch(r"[ABCD][+-]?", output["grade"])


def test_the_merged_turn_holds_the_summary_and_grade(judged):
    for state in _related(judged):
        merged = "In summary," + state["summary"] + "The grade of it is" + state["grade"]
        assert merged + "<|im_end|>\n" in state.text()
        roles = [m["role"] for m in state.messages()]
        assert roles == ["system"] + ["user", "assistant"] * 4


def test_the_branches_share_the_conversation_prefix_in_the_cache(live, endpoint):
    state = multi_dimensional_judge.run(
        *ESSAYS[0], backend=endpoint, temperature=0, max_new_tokens=MAX_NEW_TOKENS
    )
    if state["related"] == "no":
        pytest.skip("the tiny model judged this essay unrelated")
    meta = state.get_meta_info("output")
    assert meta["cached_tokens"] > 0.5 * meta["prompt_tokens"]


def test_judges_on_both_backends_at_once_leave_no_memory_behind(live):
    """HTTP and in-process programs share one engine: forks, selects and grammars from both
    interleave in its batches, and every KV slot comes back afterwards."""
    essays = [(topic, f"{essay} Essay {i}.") for i in range(3) for topic, essay in ESSAYS]
    backends = [sgl.RuntimeEndpoint(live.url, timeout=60), sgl.EngineBackend(live.engine)]
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(
                    multi_dimensional_judge.run_batch,
                    essays,
                    backend=backend,
                    temperature=0,
                    max_new_tokens=MAX_NEW_TOKENS,
                    progress_bar=False,
                )
                for backend in backends
            ]
            http_states, local_states = (run.result(timeout=120) for run in runs)
    finally:
        backends[0].close()
        backends[1].shutdown()
    for states in (http_states, local_states):
        assert [s.error() for s in states] == [None] * len(essays)
        assert all(re.fullmatch(OUTPUT_REGEX, s["output"]) for s in _related(states))
    live.assert_no_leaks()
