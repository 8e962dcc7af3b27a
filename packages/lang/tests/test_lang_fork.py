"""fork / join: children start from the parent's text, run in parallel, and come back."""

from __future__ import annotations

import pytest

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(30)

RULES = {
    "Tip 0:": " Drink water.\n",
    "Tip 1:": " Sleep well.\n",
    "Tip 2:": " Walk daily.\n",
}
PREFIX = "Here are three tips for a healthy life.\n"


@pytest.fixture
def backend(make_server):
    server = make_server(RULES)
    endpoint = sgl.RuntimeEndpoint(server.url, timeout=20)
    endpoint.fake = server
    yield endpoint
    endpoint.close()


@sgl.function
def tips(s):
    s += PREFIX
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Tip {i}:" + sgl.gen("tip", stop="\n")
    forks.join()
    s += "Summary:"


def test_join_gathers_the_forks_variables_as_a_list(backend):
    state = tips.run(backend=backend)
    assert state["tip"] == [" Drink water.", " Sleep well.", " Walk daily."]


def test_forks_start_from_the_parents_text(backend):
    state = tips.run(backend=backend)
    state.sync()
    prompts = sorted(
        r["text"] for r in backend.fake.core.requests if r["sampling_params"].get("stop")
    )
    assert prompts == [f"{PREFIX}Tip {i}:" for i in range(3)]


def test_join_leaves_the_parents_text_alone(backend):
    assert tips.run(backend=backend).text() == PREFIX + "Summary:"


def test_forking_sends_the_shared_prefix_to_the_cache_first(backend):
    state = tips.run(backend=backend)
    state.sync()
    first = backend.fake.core.requests[0]
    assert first == {"text": PREFIX, "sampling_params": {"max_new_tokens": 0}}
    assert len(backend.fake.core.requests) == 4
    # Every fork then finds the whole prefix (10 tokens) in the cache.
    assert all(m["cached_tokens"] >= 10 for m in state.get_meta_info("tip"))


def test_forks_run_in_parallel(backend):
    backend.fake.core.delay = 0.3
    tips.run(backend=backend).sync()
    assert backend.fake.core.max_in_flight == 3


def test_forks_take_a_list_a_function_a_string_and_an_expression(backend):
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += ["A", "B"]
        forks += lambda i: f"{i}"
        forks += "-"
        forks += sgl.gen("x", max_tokens=1)
        forks.join()

    state = prog.run(backend=backend)
    assert len(state["x"]) == 2
    requests = backend.fake.core.requests
    texts = [r["text"] for r in requests if r["sampling_params"] == {"max_new_tokens": 1}]
    assert sorted(texts) == ["A0-", "B1-"]


def test_concate_and_append_adds_each_forks_text_in_order(backend):
    @sgl.function
    def prog(s):
        s += PREFIX
        forks = s.fork(3)
        forks += lambda i: f"Tip {i}:" + sgl.gen("tip", stop="\n") + "\n"
        forks.join(mode="concate_and_append")
        s += "End."

    state = prog.run(backend=backend)
    assert state.text() == (
        PREFIX + "Tip 0: Drink water.\nTip 1: Sleep well.\nTip 2: Walk daily.\nEnd."
    )


def test_fork_items_are_readable_before_the_join(backend):
    @sgl.function
    def prog(s):
        s += PREFIX
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i}:" + sgl.gen("tip", stop="\n")
        s["first"] = forks[0]["tip"]
        forks.join()

    assert prog.run(backend=backend)["first"] == " Drink water."


def test_fork_copy_is_a_single_joined_fork(backend):
    @sgl.function
    def prog(s):
        s += PREFIX
        with s.copy() as child:
            child += "Tip 1:" + sgl.gen("tip", stop="\n")
        s += "Done."

    state = prog.run(backend=backend)
    assert state["tip"] == [" Sleep well."]
    assert state.text() == PREFIX + "Done."


def test_a_failing_fork_fails_the_join_naming_it(backend):
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks[0] += "ok" + sgl.gen("x", max_tokens=1)
        forks[1] += "bad" + sgl.gen("x", max_tokens=1, temperature=-1.0)
        forks.join()

    error = prog.run(backend=backend).error()
    assert error is not None
    assert "join" in str(error) and "fork 1" in str(error) and "gen('x')" in str(error)
