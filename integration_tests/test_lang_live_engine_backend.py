"""The in-process backend (EngineBackend) on the live server's own engine: no HTTP, and the same
answers as through RuntimeEndpoint."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import (  # noqa: F401
    ENGINE_KWARGS,
    LiveServer,
    endpoint_fixture,
    live_fixture,
    token_count,
)

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(60)

QUESTION = "Is Paris in France? Answer:"


@pytest.fixture
def in_process(live: LiveServer) -> Iterator[sgl.EngineBackend]:
    backend = sgl.EngineBackend(live.engine)
    yield backend
    backend.shutdown()


@sgl.function
def capital(s):
    s += "The capital of France is" + sgl.gen("city", max_tokens=8)


@sgl.function
def chat(s, question):
    s += sgl.system("Be brief.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))


def test_a_greedy_gen_equals_the_one_through_http(in_process, endpoint):
    local = capital.run(backend=in_process, temperature=0)
    remote = capital.run(backend=endpoint, temperature=0)
    assert local["city"] == remote["city"]
    assert local.get_meta_info("city")["completion_tokens"] > 0


def test_roles_use_the_engines_chat_template_like_the_server(in_process, endpoint):
    local = chat.run(question="Hi?", backend=in_process, temperature=0)
    remote = chat.run(question="Hi?", backend=endpoint, temperature=0)
    assert local.text() == remote.text()
    assert local.text().startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_select_scores_like_the_server(in_process, endpoint):
    @sgl.function
    def prog(s):
        s += QUESTION + sgl.select("answer", [" no", " yes", " maybe so"])

    local = prog.run(backend=in_process)
    remote = prog.run(backend=endpoint)
    assert local["answer"] == remote["answer"]
    assert local.get_meta_info("answer")["normalized_prompt_logprobs"] == pytest.approx(
        remote.get_meta_info("answer")["normalized_prompt_logprobs"], abs=1e-4
    )


def test_regex_holds_on_the_engine(in_process):
    @sgl.function
    def prog(s):
        s += "Pick a code: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", max_tokens=16)

    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", prog.run(backend=in_process)["code"])


def test_streaming_runs_on_the_engine(in_process):
    @sgl.function
    def prog(s):
        # Long enough that the reader below starts long before the generation ends (with 12
        # tokens a loaded machine sometimes read the whole text as one piece; the tiny model
        # decodes a token in a fraction of a millisecond on the C kernels).
        s += "Tell me" + sgl.gen("rest", max_tokens=160, ignore_eos=True)

    state = prog.run(backend=in_process, stream=True, temperature=0)
    pieces = list(state.text_iter("rest"))
    assert len(pieces) > 1 and "".join(pieces) == state["rest"]


def test_forks_on_the_engine_hit_its_cache(in_process, live):
    prefix = "Two tips for a healthy life, written by an engine with a radix tree cache.\n"

    @sgl.function
    def tips(s):
        s += prefix
        forks = s.fork(2)
        forks += lambda i: f"Tip {i}:" + sgl.gen("tip", max_tokens=4)
        forks.join()

    state = tips.run(backend=in_process, temperature=0)
    assert len(state["tip"]) == 2
    assert all(m["cached_tokens"] >= token_count(live, prefix) for m in state.get_meta_info("tip"))


def test_an_engine_given_as_the_default_backend_is_wrapped(live):
    sgl.set_default_backend(live.engine)
    try:
        assert isinstance(sgl.get_default_backend(), sgl.EngineBackend)
        assert isinstance(capital()["city"], str)
    finally:
        sgl.set_default_backend(None)


def test_an_engine_error_fails_the_gen_naming_it(in_process):
    @sgl.function
    def prog(s):
        s += "Code: " + sgl.gen("code", regex=r"(?=A)[A-Z]+")

    error = prog.run(backend=in_process).error()
    assert isinstance(error, sgl.ProgramError) and error.primitive == "gen('code')"
    assert "regex" in str(error)


def test_a_backend_built_from_a_model_path_owns_and_stops_its_engine(live, in_process):
    with sgl.EngineBackend(model_path=str(live.model_dir), **ENGINE_KWARGS) as backend:
        own = capital.run(backend=backend, temperature=0)["city"]
        assert own == capital.run(backend=in_process, temperature=0)["city"]
        engine = backend.engine
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("x", {"max_new_tokens": 1})
