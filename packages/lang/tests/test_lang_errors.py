"""Errors surface cleanly, name the failing primitive, and never hang."""

from __future__ import annotations

import socket
import time

import pytest

import radixlm.lang as sgl
from radixlm.sampling import InvalidRequest

pytestmark = pytest.mark.timeout(30)


@sgl.function
def ask(s):
    s += "The capital of France is" + sgl.gen("city", max_tokens=4)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_server_fails_at_construction():
    started = time.monotonic()
    with pytest.raises(sgl.BackendUnavailable, match="cannot reach"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{_closed_port()}", connect_timeout=2)
    assert time.monotonic() - started < 5


def test_a_server_that_goes_away_fails_the_primitive(make_server):
    server = make_server()
    backend = sgl.RuntimeEndpoint(server.url)
    server.stop()
    state = ask.run(backend=backend)
    with pytest.raises(sgl.ProgramError, match=r"gen\('city'\) failed: cannot reach") as caught:
        state["city"]
    assert isinstance(caught.value.cause, sgl.BackendUnavailable)


def test_a_server_that_hangs_times_out(make_server):
    server = make_server()
    backend = sgl.RuntimeEndpoint(server.url, timeout=0.5)
    server.core.hang = True
    started = time.monotonic()
    error = ask.run(backend=backend).error()
    assert error is not None and "did not answer within 0.5 s" in str(error)
    assert time.monotonic() - started < 5


def test_a_bad_regex_is_rejected_when_the_gen_is_written():
    with pytest.raises(InvalidRequest, match=r"gen\('code'\).*not a valid regular expression"):
        sgl.gen("code", regex="[A-Z")


def test_a_regex_the_server_rejects_fails_naming_the_gen(endpoint):
    @sgl.function
    def prog(s):
        s += "Code: " + sgl.gen("code", regex=r"(?=A)[A-Z]+")

    error = prog.run(backend=endpoint).error()
    assert isinstance(error, sgl.ProgramError)
    assert error.primitive == "gen('code')"
    assert isinstance(error.cause, sgl.BackendError) and error.cause.status == 400
    assert "lookaround assertions are not supported" in str(error)


def test_reading_a_failed_variable_in_the_body_raises_from_run(endpoint):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", temperature=-1.0)
        if s["a"] == "yes":
            s += "never"

    with pytest.raises(sgl.ProgramError, match=r"gen\('a'\) failed: .*temperature"):
        prog.run(backend=endpoint)


def test_a_failed_state_raises_on_text_and_keeps_the_partial_text(endpoint):
    @sgl.function
    def prog(s):
        s += "Before. " + sgl.gen("a", top_p=0.0) + " after"

    state = prog.run(backend=endpoint)
    with pytest.raises(sgl.ProgramError) as caught:
        state.text()
    assert caught.value.text == "Before. "
    assert state.error() is caught.value


def test_primitives_after_a_failure_are_skipped(make_server):
    server = make_server()

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", temperature=-1.0)
        s += "y" + sgl.gen("b", max_tokens=1)

    state = prog.run(backend=sgl.RuntimeEndpoint(server.url))
    with pytest.raises(sgl.ProgramError, match=r"gen\('a'\)"):
        state["b"]
    assert server.core.requests == []


def test_bad_run_level_values_are_rejected_at_once(endpoint):
    with pytest.raises(InvalidRequest, match="top_p"):
        ask.run(backend=endpoint, top_p=0)


def test_running_without_a_backend_says_how_to_set_one():
    with pytest.raises(ValueError, match="set_default_backend"):
        ask.run()


def test_adding_a_non_string_says_what_to_do(endpoint):
    @sgl.function
    def prog(s):
        s += 42

    with pytest.raises(TypeError, match="str"):
        prog.run(backend=endpoint)


def test_a_finished_state_takes_no_more_primitives(endpoint):
    state = ask.run(backend=endpoint)
    with pytest.raises(RuntimeError, match="has ended"):
        state += "more"


def test_an_unknown_variable_is_a_key_error(endpoint):
    state = ask.run(backend=endpoint)
    with pytest.raises(KeyError, match="city"):
        state["town"]


def test_select_refuses_a_temperature():
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.select("x", ["a", "b"], temperature=0.7)


def test_an_unknown_backend_object_is_refused():
    with pytest.raises(TypeError, match="not a backend"):
        sgl.set_default_backend(object())
