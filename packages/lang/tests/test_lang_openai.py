"""The OpenAI backend against a fake OpenAI-compatible /v1 (radixlm's own API shape)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import jsonschema
import pytest

import radixlm.lang as sgl

pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(30)

CHAT_RULES = {
    "<|user|>What is the capital of France?\n<|assistant|>": "Paris.",
    "<|user|>Describe Paris.\n<|assistant|>": "Name: Paris\nCountry: France\n",
    "<|user|>Describe Rome.\n<|assistant|>": "Rome is a city in Italy.",
}
COMPLETION_RULES = {
    "Q: Capital of France?\nA:": " Paris\nQ: Capital of Italy?\nA: Rome",
    "Facts about Paris.\nName:": " Paris\nCountry: France\nRiver: Seine\n",
    "Is Paris in France? Answer:": " yes",
}


@pytest.fixture
def fake(make_server):
    return make_server({**CHAT_RULES, **COMPLETION_RULES})


def _chat(fake, **kwargs):
    return sgl.OpenAI("toy-chat", base_url=fake.url + "/v1", max_retries=0, **kwargs)


def _completion(fake, **kwargs):
    return sgl.OpenAI(
        "toy-base", base_url=fake.url + "/v1", is_chat_model=False, max_retries=0, **kwargs
    )


@sgl.function
def ask(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16))


def test_a_chat_gen_sends_the_messages_and_stores_the_reply(fake):
    state = ask.run(question="What is the capital of France?", backend=_chat(fake))
    assert state["answer"] == "Paris."
    sent = fake.core.openai_requests[-1]
    assert sent["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    assert sent["max_tokens"] == 16
    assert state.messages()[-1] == {"role": "assistant", "content": "Paris."}


def test_a_chat_gen_outside_an_assistant_turn_is_refused(fake):
    @sgl.function
    def prog(s):
        s += sgl.user("Hi") + "Reply:" + sgl.gen("x")

    error = prog.run(backend=_chat(fake)).error()
    assert isinstance(error, sgl.ProgramError) and isinstance(error.cause, sgl.UnsupportedFeature)
    assert "must open an assistant turn" in str(error) and "num_api_spec_tokens" in str(error)


def test_regex_on_a_chat_model_without_server_extensions_is_refused(fake):
    @sgl.function
    def prog(s):
        s += sgl.user("Pick")
        s += sgl.assistant(sgl.gen("x", regex="[ab]"))

    error = prog.run(backend=_chat(fake, server_extensions=False)).error()
    assert isinstance(error, sgl.ProgramError)
    assert "regex is not part of the OpenAI API" in str(error)
    assert fake.core.openai_requests == []


def test_server_extension_fields_travel_in_the_body(fake):
    @sgl.function
    def prog(s):
        s += sgl.user("Pick")
        s += sgl.assistant(sgl.gen("x", regex="[ab]", top_k=5))

    assert prog.run(backend=_chat(fake))["x"] in ("a", "b")
    sent = fake.core.openai_requests[-1]
    assert (sent["regex"], sent["top_k"]) == ("[ab]", 5)


def test_json_schema_on_a_chat_model_becomes_response_format(fake):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    @sgl.function
    def prog(s):
        s += sgl.user("Where?")
        s += sgl.assistant(sgl.gen("place", json_schema=schema))

    place = json.loads(prog.run(backend=_chat(fake, server_extensions=False))["place"])
    jsonschema.validate(place, schema)
    sent = fake.core.openai_requests[-1]["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["schema"] == schema


def test_select_on_a_chat_model_is_refused_clearly(fake):
    @sgl.function
    def prog(s):
        s += sgl.user("Yes or no?")
        s += sgl.assistant(sgl.select("x", ["yes", "no"]))

    error = prog.run(backend=_chat(fake)).error()
    assert error is not None and "needs prompt logprobs" in str(error)


def test_a_completion_model_continues_the_text(fake):
    @sgl.function
    def prog(s):
        s += "Q: Capital of France?\nA:" + sgl.gen("answer", stop="\n")

    state = prog.run(backend=_completion(fake))
    assert state["answer"] == " Paris"
    assert fake.core.openai_requests[-1]["prompt"] == "Q: Capital of France?\nA:"


def test_select_on_a_completion_model_scores_echoed_logprobs(fake):
    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer:" + sgl.select("answer", [" no", " yes"])

    state = prog.run(backend=_completion(fake))
    assert state["answer"] == " yes"
    sent = fake.core.openai_requests[-1]
    assert sent["echo"] is True and sent["max_tokens"] == 0 and len(sent["prompt"]) == 2
    scores = state.get_meta_info("answer")["normalized_prompt_logprobs"]
    assert scores[1] > scores[0]


def test_streaming_a_chat_reply(fake):
    fake.core.delay = 0.0
    state = ask.run(question="Describe Rome.", backend=_chat(fake), stream=True)
    assert "".join(state.text_iter("answer")) == "Rome is a city in Italy."
    assert fake.core.openai_requests[-1]["stream"] is True


def test_chat_speculation_fills_a_turn_of_gens_with_one_call(fake):
    @sgl.function(num_api_spec_tokens=64)
    def card(s):
        s += sgl.user("Describe Paris.")
        s += sgl.assistant(
            "Name: " + sgl.gen("name", stop="\n") + "\nCountry: " + sgl.gen("country", stop="\n")
        )

    state = card.run(backend=_chat(fake))
    assert (state["name"], state["country"]) == ("Paris", "France")
    assert len(fake.core.openai_requests) == 1
    assert fake.core.openai_requests[0]["max_tokens"] == 64
    assert state.messages()[-1]["content"] == "Name: Paris\nCountry: France"


def test_chat_speculation_that_never_fits_fails_after_its_tries(fake):
    @sgl.function(num_api_spec_tokens=32)
    def card(s):
        s += sgl.user("Describe Rome.")
        s += sgl.assistant("Name: " + sgl.gen("name", stop="\n") + "\nPopulation: " + sgl.gen("n"))

    error = card.run(backend=_chat(fake)).error()
    assert error is not None and "did not fit" in str(error)
    assert len(fake.core.openai_requests) == 3


def test_completion_speculation_fills_consecutive_gens_from_one_call(fake):
    @sgl.function(num_api_spec_tokens=32)
    def facts(s):
        s += "Facts about Paris.\nName:" + sgl.gen("name", stop="\n")
        s += "\nCountry:" + sgl.gen("country", stop="\n")

    state = facts.run(backend=_completion(fake))
    assert (state["name"], state["country"]) == (" Paris", " France")
    assert len(fake.core.openai_requests) == 1
    assert "stop" not in fake.core.openai_requests[0]


def test_completion_speculation_falls_back_to_a_real_call_on_mismatch(fake):
    @sgl.function(num_api_spec_tokens=32)
    def facts(s):
        s += "Facts about Paris.\nName:" + sgl.gen("name", stop="\n")
        s += "\nMayor:" + sgl.gen("mayor", stop="\n")

    state = facts.run(backend=_completion(fake))
    assert state["name"] == " Paris"
    assert state.text().startswith("Facts about Paris.\nName: Paris\nMayor:")
    # "Mayor:" is not what the speculation predicted: the mayor needs a call of its own.
    assert len(fake.core.openai_requests) == 2
    assert fake.core.openai_requests[1]["prompt"] == "Facts about Paris.\nName: Paris\nMayor:"


def test_an_unreachable_api_fails_the_gen(fake):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = sgl.OpenAI("m", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=2)
    error = ask.run(question="Hi", backend=backend).error()
    assert isinstance(error, sgl.ProgramError) and isinstance(error.cause, sgl.BackendUnavailable)


def test_importing_the_language_does_not_import_openai_or_httpx():
    code = "import sys, radixlm.lang; print('openai' in sys.modules, 'httpx' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False False", result.stderr


def test_without_the_openai_client_the_backend_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=r"radixlm-lang\[openai\]"):
        sgl.OpenAI("gpt-4o-mini")
