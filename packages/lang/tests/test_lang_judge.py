"""The paper's multi_dimensional_judge (branch-solve-merge), text-only, end to end."""

from __future__ import annotations

import json
import re

import pytest

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(30)

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
OUTPUT_REGEX = r'\{"summary": "[\w\d\s]+\.", "grade": "[ABCD][+-]?"\}'
GRADE_REGEX = r" [ABCD][+-]?"


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


def _rules(related: str) -> dict[str, str]:
    tail = ". End your judgment with the word 'END'\nASSISTANT:Judgment:"
    return {
        "Is the essay related to the topic?\nASSISTANT:": related,
        "Clarity" + tail: " Clear and well organised. END",
        "Originality" + tail: " A fresh angle on an old topic. END",
        "Evidence" + tail: " Claims are backed by two studies. END",
        "In summary,": " a solid essay. The rest",
        "The grade of it is": " B+ overall",
        "Return in the JSON format.\nASSISTANT:": '{"summary": "A solid essay.", "grade": "B+"}',
    }


@pytest.fixture(params=["runtime_endpoint", "engine"])
def judge_backend(request, make_server, make_engine):
    def make(related: str):
        if request.param == "engine":
            engine = make_engine(_rules(related))
            return sgl.EngineBackend(engine), engine.core
        server = make_server(_rules(related))
        return sgl.RuntimeEndpoint(server.url, timeout=20), server.core

    return make


def test_the_judge_fills_every_dimension_and_returns_json(judge_backend):
    backend, _ = judge_backend("yes")
    state = multi_dimensional_judge.run(
        topic="Rivers", essay="Rivers shape valleys.", backend=backend
    )
    assert state["related"] == "yes"
    assert state["summary"] == " a solid essay"
    assert re.fullmatch(GRADE_REGEX, state["grade"])
    output = json.loads(state["output"])
    assert re.fullmatch(OUTPUT_REGEX, state["output"]) and output["grade"] == "B+"


def test_the_judge_merges_the_judgments_into_the_parent(judge_backend):
    backend, _ = judge_backend("yes")
    state = multi_dimensional_judge.run(
        topic="Rivers", essay="Rivers shape valleys.", backend=backend
    )
    merged = (
        " Clear and well organised. \n A fresh angle on an old topic. \n"
        " Claims are backed by two studies. In summary, a solid essay"
    )
    assert merged in state.text()
    assert [m["role"] for m in state.messages()].count("assistant") == 4


def test_the_judge_stops_early_for_an_unrelated_essay(judge_backend):
    backend, core = judge_backend("no")
    state = multi_dimensional_judge.run(topic="Rivers", essay="Cats purr.", backend=backend)
    assert state["related"] == "no"
    assert "summary" not in state and "output" not in state
    assert len(core.requests) == 2  # the prompt's length, then the choices scored together


def test_the_judge_runs_as_a_batch(judge_backend):
    backend, _ = judge_backend("yes")
    states = multi_dimensional_judge.run_batch(
        [("Rivers", "Rivers shape valleys."), ("Rivers", "Deltas grow.")], backend=backend
    )
    assert [json.loads(s["output"])["grade"] for s in states] == ["B+", "B+"]
