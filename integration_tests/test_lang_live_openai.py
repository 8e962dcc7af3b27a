"""The OpenAI backend against radixlm's own /v1 API on the live server (the `openai` client)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import SERVED_MODEL_NAME, endpoint_fixture, live_fixture  # noqa: F401

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(60)

QUESTION = "Is Paris in France? Answer:"


@pytest.fixture
def chat_model(live):
    return sgl.OpenAI(SERVED_MODEL_NAME, base_url=live.url + "/v1", max_retries=0, timeout=30)


@pytest.fixture
def completion_model(live):
    return sgl.OpenAI(
        SERVED_MODEL_NAME,
        base_url=live.url + "/v1",
        is_chat_model=False,
        max_retries=0,
        timeout=30,
    )


@sgl.function
def ask(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, ignore_eos=True))


def test_a_chat_gen_fills_the_assistant_turn(chat_model):
    state = ask.run(question="Hi?", backend=chat_model, temperature=0)
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 8 and meta["finish_reason"]["type"] == "length"
    assert state.messages() == [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": state["answer"].strip()},
    ]


def test_a_chat_gen_equals_the_native_gen_on_the_rendered_template(chat_model, endpoint):
    through_v1 = ask.run(question="Hi?", backend=chat_model, temperature=0)["answer"]
    native = ask.run(question="Hi?", backend=endpoint, temperature=0)["answer"]
    assert through_v1 == native


def test_a_completion_gen_equals_the_native_gen(completion_model, endpoint):
    @sgl.function
    def prog(s):
        s += "Q: Capital of France?\nA:" + sgl.gen("answer", max_tokens=8)

    through_v1 = prog.run(backend=completion_model, temperature=0)["answer"]
    assert through_v1 == prog.run(backend=endpoint, temperature=0)["answer"]


def test_json_schema_on_a_chat_model_holds(chat_model):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
    }

    @sgl.function
    def prog(s):
        s += sgl.user("Where?")
        s += sgl.assistant(sgl.gen("place", json_schema=schema, max_tokens=32))

    jsonschema.validate(json.loads(prog.run(backend=chat_model, temperature=0)["place"]), schema)


def test_a_regex_travels_as_a_server_extension_and_holds(chat_model):
    @sgl.function
    def prog(s):
        s += sgl.user("Code?")
        s += sgl.assistant(sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", max_tokens=16))

    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", prog.run(backend=chat_model)["code"])


@pytest.mark.parametrize(
    ("prompt", "choices"),
    [(QUESTION, [" no", " yes", " maybe so"]), ("<|im_start|>assistant\n", ["yes", "no"])],
    ids=["plain", "special-tokens"],
)
def test_select_on_a_completion_model_scores_like_the_native_api(
    completion_model, endpoint, prompt, choices
):
    # Echoed prompt logprobs are cut at the prompt by text offsets: the tokens' texts, special
    # tokens included, must spell the prompt.
    @sgl.function
    def prog(s):
        s += prompt + sgl.select("answer", choices)

    through_v1 = prog.run(backend=completion_model)
    native = prog.run(backend=endpoint)
    assert through_v1["answer"] == native["answer"]
    assert through_v1.get_meta_info("answer")["normalized_prompt_logprobs"] == pytest.approx(
        native.get_meta_info("answer")["normalized_prompt_logprobs"], abs=1e-4
    )


def test_select_on_a_chat_model_is_refused_clearly(chat_model):
    @sgl.function
    def prog(s):
        s += sgl.user("Yes or no?")
        s += sgl.assistant(sgl.select("x", ["yes", "no"]))

    error = prog.run(backend=chat_model).error()
    assert isinstance(error, sgl.ProgramError) and "needs prompt logprobs" in str(error)


@sgl.function
def ask_long(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=160, ignore_eos=True))


def test_streaming_a_chat_reply(chat_model):
    # 160 tokens: a few chunks however fast the engine is against the reader (the tiny model
    # decodes a token in a fraction of a millisecond on the C kernels, and chunks that queue
    # up while the reader is busy are merged), and whatever bytes the random model writes
    # (pieces ending inside a UTF-8 character wait for the rest).
    state = ask_long.run(question="Hi?", backend=chat_model, stream=True, temperature=0)
    pieces = list(state.text_iter("answer"))
    assert len(pieces) > 1 and "".join(pieces) == state["answer"]


def test_completion_speculation_keeps_each_gens_text_and_stop(completion_model):
    @sgl.function(num_api_spec_tokens=16)
    def facts(s):
        s += "Facts about Paris.\nName:" + sgl.gen("name", stop="\n")
        s += "\nCountry:" + sgl.gen("country", stop="\n")

    state = facts.run(backend=completion_model, temperature=0, max_new_tokens=12)
    assert state.text() == (
        "Facts about Paris.\nName:" + state["name"] + "\nCountry:" + state["country"]
    )
    assert "\n" not in state["name"] and "\n" not in state["country"]


def test_a_server_error_fails_the_gen_naming_it(chat_model):
    @sgl.function
    def prog(s):
        s += sgl.user("Code?")
        s += sgl.assistant(sgl.gen("code", regex=r"(?=A)[A-Z]+"))

    error = prog.run(backend=chat_model).error()
    assert isinstance(error, sgl.ProgramError) and error.primitive == "gen('code')"
    assert isinstance(error.cause, sgl.BackendError) and error.cause.status == 400
