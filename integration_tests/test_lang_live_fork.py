"""fork / join on the live server: children start from the parent's text, hit the radix cache
for it, run in parallel and come back as lists."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import endpoint_fixture, live_fixture, token_count  # noqa: F401

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(60)

PREFIX = "Here are three tips for a healthy life, written by an engine with a radix tree cache.\n"


@sgl.function
def tips(s):
    s += PREFIX
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Tip {i}:" + sgl.gen("tip", max_tokens=6, stop="\n")
    forks.join()
    s += "Summary:"


def test_join_gathers_the_forks_variables_as_a_list(endpoint):
    state = tips.run(backend=endpoint, temperature=0)
    assert isinstance(state["tip"], list) and len(state["tip"]) == 3
    assert all(isinstance(t, str) and "\n" not in t for t in state["tip"])


def test_join_leaves_the_parents_text_alone(endpoint):
    assert tips.run(backend=endpoint, temperature=0).text() == PREFIX + "Summary:"


def test_each_fork_continues_the_parents_text(endpoint, live):
    state = tips.run(backend=endpoint, temperature=0)
    for i, tip in enumerate(state["tip"]):
        alone = live.generate(
            {
                "text": f"{PREFIX}Tip {i}:",
                "sampling_params": {"max_new_tokens": 6, "stop": "\n", "temperature": 0},
            }
        )
        assert tip == alone["text"]


def test_every_fork_finds_the_shared_prefix_in_the_cache(endpoint, live):
    live.flush_cache()
    state = tips.run(backend=endpoint, temperature=0)
    prefix_tokens = token_count(live, PREFIX)
    assert all(m["cached_tokens"] >= prefix_tokens for m in state.get_meta_info("tip"))


def test_concate_and_append_adds_each_forks_text_in_order(endpoint):
    @sgl.function
    def prog(s):
        s += PREFIX
        forks = s.fork(3)
        forks += lambda i: f"Tip {i}:" + sgl.gen("tip", max_tokens=4, stop="\n") + "\n"
        s["tips"] = [f["tip"] for f in forks]  # this mode brings texts back, not variables
        forks.join(mode="concate_and_append")
        s += "End."

    state = prog.run(backend=endpoint, temperature=0)
    lines = "".join(f"Tip {i}:{t}\n" for i, t in enumerate(state["tips"]))
    assert state.text() == PREFIX + lines + "End."


def test_forks_take_a_list_a_function_a_string_and_an_expression(endpoint):
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += ["A", "B"]
        forks += lambda i: f"{i}"
        forks += "-"
        forks += sgl.gen("x", max_tokens=2)
        forks.join()
        s["texts"] = [f.text() for f in forks]

    state = prog.run(backend=endpoint, temperature=0)
    assert [t[:3] for t in state["texts"]] == ["A0-", "B1-"]
    assert [t[3:] for t in state["texts"]] == state["x"]


def test_forks_inside_a_chat_turn_keep_the_template(endpoint):
    @sgl.function
    def judge(s):
        s += sgl.user("Rate this.")
        forks = s.fork(2)
        for f, dim in zip(forks, ("style", "facts"), strict=True):
            f += sgl.assistant(dim + ":" + sgl.gen("score", max_tokens=3))
        s["replies"] = [f.messages()[-1] for f in forks]

    state = judge.run(backend=endpoint, temperature=0)
    assert [m["role"] for m in state["replies"]] == ["assistant", "assistant"]
    assert state.text() == "<|im_start|>user\nRate this.<|im_end|>\n"
