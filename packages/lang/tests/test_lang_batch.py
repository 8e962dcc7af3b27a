"""run_batch: many runs at once, prefix hinting, progress bar, arguments as dicts or tuples."""

from __future__ import annotations

import pytest

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(30)

FEW_SHOT = (
    "Answer each question with one word.\n"
    "Q: What colour is the sky?\nA: Blue\n"
    "Q: What colour is grass?\nA: Green\n"
)


@pytest.fixture
def backend(make_server):
    server = make_server(
        {"Q: Capital of France?\nA:": " Paris\n", "Q: Capital of Italy?\nA:": " Rome\n"}
    )
    endpoint = sgl.RuntimeEndpoint(server.url, timeout=20)
    endpoint.fake = server
    yield endpoint
    endpoint.close()


@sgl.function
def qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n")


def test_run_batch_returns_one_state_per_item_in_order(backend):
    states = qa.run_batch(
        [{"question": "Capital of France?"}, {"question": "Capital of Italy?"}], backend=backend
    )
    assert [s["answer"] for s in states] == [" Paris", " Rome"]


def test_run_batch_takes_tuples_of_arguments(backend):
    states = qa.run_batch([("Capital of France?",), ("Capital of Italy?",)], backend=backend)
    assert [s["answer"] for s in states] == [" Paris", " Rome"]


def test_run_batch_rejects_tuples_of_the_wrong_length(backend):
    with pytest.raises(TypeError, match="a batch item has 2"):
        qa.run_batch([("a", "b")], backend=backend)


def test_run_batch_sends_the_common_prefix_once_before_the_batch(backend):
    qa.run_batch([{"question": f"q{i}?"} for i in range(4)], backend=backend)
    first = backend.fake.core.requests[0]
    assert first == {"text": FEW_SHOT + "Q: ", "sampling_params": {"max_new_tokens": 0}}
    assert all(r["text"].startswith(FEW_SHOT) for r in backend.fake.core.requests[1:])


def test_the_prefix_hint_uses_arguments_the_whole_batch_shares(backend):
    @sgl.function
    def prog(s, shots, question):
        s += shots + "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n")

    prog.run_batch([{"shots": FEW_SHOT, "question": f"q{i}?"} for i in range(3)], backend=backend)
    assert backend.fake.core.requests[0]["text"] == FEW_SHOT + "Q: "


def test_a_short_common_prefix_is_not_hinted(backend):
    @sgl.function
    def prog(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n")

    prog.run_batch([{"question": "a"}, {"question": "b"}], backend=backend)
    assert all(r["sampling_params"].get("max_new_tokens") != 0 for r in backend.fake.core.requests)


def test_tracing_does_not_run_nested_programs(backend):
    @sgl.function
    def inner(s):
        s += "inner" + sgl.gen("x", max_tokens=1)

    @sgl.function
    def outer(s, question):
        s += FEW_SHOT
        # Read its answer: a run's requests go out from its own thread, and the check below
        # must not race the last one.
        _answer = inner.run(backend=backend)["x"]
        s += question + sgl.gen("answer", max_tokens=1)

    outer.run_batch([{"question": "a"}, {"question": "b"}], backend=backend)
    inner_runs = [r for r in backend.fake.core.requests if r["text"].startswith("inner")]
    assert len(inner_runs) == 2


def test_run_batch_runs_items_concurrently(backend):
    backend.fake.core.delay = 0.2
    qa.run_batch([{"question": f"q{i}?"} for i in range(4)], backend=backend, num_threads=4)
    assert backend.fake.core.max_in_flight == 4


def test_run_batch_with_one_thread_runs_one_at_a_time(backend):
    backend.fake.core.delay = 0.05
    qa.run_batch([{"question": f"q{i}?"} for i in range(3)], backend=backend, num_threads=1)
    assert backend.fake.core.max_in_flight == 1


def test_run_batch_shows_a_progress_bar(backend, capsys):
    qa.run_batch([{"question": "a?"}, {"question": "b?"}], backend=backend)
    assert "2/2" in capsys.readouterr().err


def test_run_batch_progress_bar_can_be_turned_off(backend, capsys):
    qa.run_batch([{"question": "a?"}, {"question": "b?"}], backend=backend, progress_bar=False)
    assert "2/2" not in capsys.readouterr().err


def test_a_failing_item_does_not_stop_the_batch(backend):
    @sgl.function
    def prog(s, temperature):
        s += "Q: Capital of France?\nA:" + sgl.gen("answer", stop="\n", temperature=temperature)

    good, bad = prog.run_batch([{"temperature": 0.0}, {"temperature": -1.0}], backend=backend)
    assert good["answer"] == " Paris"
    assert bad.error() is not None and "temperature" in str(bad.error())


def test_run_level_values_apply_to_the_whole_batch(backend):
    qa.run_batch([{"question": "a?"}, {"question": "b?"}], backend=backend, temperature=0.25)
    gens = [r for r in backend.fake.core.requests if r["sampling_params"].get("stop")]
    assert [r["sampling_params"]["temperature"] for r in gens] == [0.25, 0.25]


def test_an_empty_batch_returns_nothing(backend):
    assert qa.run_batch([], backend=backend) == []
