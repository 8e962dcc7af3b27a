"""Errors against the live server surface cleanly, name the failing primitive, and never hang."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import SERVED_MODEL_NAME, endpoint_fixture, live_fixture  # noqa: F401

import radixlm.lang as sgl
from radixlm.sampling import InvalidRequest

pytestmark = pytest.mark.timeout(60)


@sgl.function
def ask(s):
    s += "The capital of France is" + sgl.gen("city", max_tokens=4)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_server_fails_at_once_saying_so():
    started = time.monotonic()
    with pytest.raises(sgl.BackendUnavailable, match="cannot reach"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{_closed_port()}", connect_timeout=1)
    assert time.monotonic() - started < 5


def test_an_unreachable_openai_api_fails_the_gen():
    backend = sgl.OpenAI(
        SERVED_MODEL_NAME,
        base_url=f"http://127.0.0.1:{_closed_port()}/v1",
        max_retries=0,
        timeout=2,
    )

    @sgl.function
    def chat(s):
        s += sgl.user("Hi?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=2))

    started = time.monotonic()
    error = chat.run(backend=backend).error()
    assert isinstance(error, sgl.ProgramError) and error.primitive == "gen('answer')"
    assert isinstance(error.cause, sgl.BackendUnavailable)
    assert time.monotonic() - started < 10


def test_a_regex_python_cannot_read_is_refused_naming_the_gen():
    with pytest.raises(InvalidRequest, match=r"gen\('code'\).*not a valid regular expression"):
        sgl.gen("code", regex="[A-Z")


def test_a_regex_the_server_rejects_fails_naming_the_gen(endpoint):
    @sgl.function
    def prog(s):
        s += "Code: " + sgl.gen("code", regex=r"(?=A)[A-Z]+")

    started = time.monotonic()
    error = prog.run(backend=endpoint).error()
    assert isinstance(error, sgl.ProgramError) and error.primitive == "gen('code')"
    assert isinstance(error.cause, sgl.BackendError) and error.cause.status == 400
    assert "regex" in str(error) and "ookahead" in str(error)
    assert time.monotonic() - started < 10


def test_reading_a_failed_variable_in_the_body_raises_from_run(endpoint):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", max_tokens=2, regex=r"(?<=A)b")
        if s["a"] == "yes":
            s += "never"

    with pytest.raises(sgl.ProgramError, match=r"gen\('a'\) failed: .*regex"):
        prog.run(backend=endpoint)


def test_primitives_after_a_failure_are_skipped_and_the_text_is_kept(endpoint, live):
    before = live.wait_idle()["finished_requests"]

    @sgl.function
    def prog(s):
        s += "Before. " + sgl.gen("a", regex=r"(?=A)[A-Z]+") + " after"
        s += sgl.gen("b", max_tokens=1)

    state = prog.run(backend=endpoint)
    with pytest.raises(sgl.ProgramError, match=r"gen\('a'\)") as caught:
        state["b"]
    assert caught.value.text == "Before. "
    assert live.wait_idle()["finished_requests"] == before


def test_a_failing_fork_fails_the_join_naming_it(endpoint):
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks[0] += "ok" + sgl.gen("x", max_tokens=1)
        forks[1] += "bad" + sgl.gen("x", max_tokens=1, regex=r"(?=A)[A-Z]+")
        forks.join()

    error = prog.run(backend=endpoint).error()
    assert error is not None
    assert "join" in str(error) and "fork 1" in str(error) and "gen('x')" in str(error)


def test_a_request_past_the_timeout_fails_and_the_server_drops_it(live):
    # The default template adds no end-of-turn stop string: only the timeout can end this gen.
    impatient = sgl.RuntimeEndpoint(live.url, timeout=0.3, chat_template_name="default")
    generated = live.wait_idle()["generated_tokens"]

    @sgl.function
    def story(s):
        s += "Tell me a story." + sgl.gen("story", max_tokens=3000, ignore_eos=True)

    started = time.monotonic()
    error = story.run(backend=impatient, temperature=0).error()
    assert time.monotonic() - started < 5
    assert isinstance(error, sgl.ProgramError) and error.primitive == "gen('story')"
    assert "did not answer within 0.3 s" in str(error)
    # The client went away: the server aborts the generation instead of running it to the end.
    info = live.wait_idle(timeout=10)
    assert info["generated_tokens"] - generated < 3000
    live.assert_no_leaks()
    impatient.close()


def test_a_prompt_longer_than_the_context_is_refused_naming_the_gen(endpoint, live):
    too_long = "word " * (live.engine.context_length + 10)

    @sgl.function
    def prog(s):
        s += too_long + sgl.gen("x", max_tokens=1)

    error = prog.run(backend=endpoint).error()
    assert isinstance(error, sgl.ProgramError) and error.primitive == "gen('x')"
    assert isinstance(error.cause, sgl.BackendError) and error.cause.status == 400


def test_an_image_for_a_text_only_model_fails_naming_the_gen(endpoint):
    @sgl.function
    def prog(s):
        s += sgl.user(sgl.image(b"\x89PNG\r\n\x1a\nnot really") + "What is this?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=2))

    error = prog.run(backend=endpoint).error()
    assert isinstance(error, sgl.ProgramError) and error.primitive == "gen('answer')"
    assert isinstance(error.cause, sgl.BackendError) and error.cause.status == 400
    assert "image_data" in str(error)
