"""The full reference server end to end on the built-in demo model.

`python -m radixlm.server --port N` with no `--model-path` (what `radixlm serve` runs for a
newcomer) in a subprocess; then the official `openai` client and radixlm-lang programs against
it. Where the demo model knows the answer (its corpus: capitals, languages, greetings) the
documented answer is asserted; elsewhere the structure.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_process import free_port, served  # this folder is not a package

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(120)

MODEL = "radixlm-demo"
ROOT = Path(__file__).resolve().parents[1]
RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
PROFILE = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 20},
        "capital": {"type": "string", "maxLength": 20},
        "language": {"type": "string", "maxLength": 20},
    },
    "required": ["country", "capital", "language"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(url, log file) of `python -m radixlm.server --port N` on the built-in model."""
    log = tmp_path_factory.mktemp("reference-server") / "serve.log"
    with served(["--log-level", "warning", "--enable-cache-report"], log, free_port()) as url:
        yield url, log


@pytest.fixture(scope="module")
def url(server: tuple[str, Path]) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def capitals() -> dict[str, str]:
    """Country -> capital, from the corpus the demo model was trained on."""
    sys.path.insert(0, str(ROOT / "tools" / "demo_model"))
    try:
        from corpus import COUNTRIES
    finally:
        sys.path.pop(0)
    return {c.name: c.capital for c in COUNTRIES}


def _chat(client: openai.OpenAI, content: str, **kwargs: Any) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **kwargs,
    )
    return reply.choices[0].message.content or ""


# ------------------------------------------------------------------------ the openai client


def test_serve_without_a_model_path_serves_the_builtin_model(
    server: tuple[str, Path], client: openai.OpenAI
) -> None:
    assert "serving the built-in model 'radixlm-demo'" in server[1].read_text()
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_of_the_capital_of_france_is_paris(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert reply.choices[0].text.startswith(" Paris")


def test_chat_lists_three_correct_country_capital_pairs(
    client: openai.OpenAI, capitals: dict[str, str]
) -> None:
    text = _chat(client, "List 3 countries and their capitals.", max_tokens=64)
    pairs = re.findall(r"^\d\. (.+): (.+)$", text.strip(), flags=re.MULTILINE)
    assert len(pairs) == 3 and len({country for country, _ in pairs}) == 3, text
    assert all(capitals[country] == capital for country, capital in pairs), text


def test_chat_streams_the_same_answer_it_gives_at_once(client: openai.OpenAI) -> None:
    question = "What is the capital of Japan?"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=24,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == _chat(client, question, max_tokens=24)
    assert "Tokyo" in streamed


def test_chat_response_format_json_schema_validates(client: openai.OpenAI) -> None:
    text = _chat(
        client,
        "Give the capital of France in JSON.",
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": RECORD, "strict": True},
        },
    )
    record = json.loads(text)
    jsonschema.validate(record, RECORD)


def test_completion_json_schema_example_gives_paris_and_a_number(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="Here is the information of the capital of France in the JSON format.\n",
        max_tokens=64,
        temperature=0,
        extra_body={"json_schema": json.dumps(RECORD)},
    )
    record = json.loads(reply.choices[0].text)
    assert record["name"] == "Paris" and isinstance(record["population"], int)


def test_regex_and_ebnf_examples_give_the_documented_answers(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="Paris is the capital of",
        max_tokens=8,
        temperature=0,
        extra_body={"regex": "(France|England)"},
    )
    assert reply.choices[0].text == "France"
    greeting = _chat(
        client,
        "Write a greeting.",
        max_tokens=8,
        extra_body={"ebnf": 'root ::= "Hello" | "Hi" | "Hey"'},
    )
    assert greeting in {"Hello", "Hi", "Hey"}


def test_a_repeated_chat_reports_cached_prompt_tokens(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What language do people speak in Brazil?"}]
    for _ in range(2):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16
        )
    assert "Portuguese" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert (reply.usage.prompt_tokens_details.cached_tokens or 0) > 0


# ------------------------------------------------------------------- radixlm-lang programs


@sgl.function
def capital_facts(s, country):
    """The paper's simplest programs: a gen, a regex-constrained gen and a select."""
    s += "The capital of " + country + " is" + sgl.gen("capital", max_tokens=4, stop=".")
    s += "\nParis is the capital of" + sgl.gen("of", max_tokens=4, regex=" (France|England)")
    s += "\nParis is the capital of " + sgl.select("choice", choices=["France", "England"])


@sgl.function
def country_profile(s, country):
    """Branch-solve-merge: ask in parallel forks, merge the answers, return JSON."""
    s += sgl.system("You are a helpful assistant.")
    questions = [
        f"What is the capital of {country}?",
        f"What language do people speak in {country}?",
    ]
    forks = s.fork(len(questions))
    for f, question in zip(forks, questions, strict=True):
        f += sgl.user(question)
        f += sgl.assistant(sgl.gen("answer", max_tokens=24, stop="\n"))
    forks.join()
    s += sgl.user(f"Tell me about {country}.")
    s += sgl.assistant(" ".join(f["answer"] for f in forks))
    s += sgl.user(f"Return the facts about {country} in JSON.")
    s += sgl.assistant(sgl.gen("profile", max_tokens=64, json_schema=json.dumps(PROFILE)))


@pytest.fixture
def endpoint(url: str) -> Iterator[sgl.RuntimeEndpoint]:
    backend = sgl.RuntimeEndpoint(url, timeout=60)
    yield backend
    backend.close()


def test_lang_gen_regex_and_select_give_the_documented_answers(
    endpoint: sgl.RuntimeEndpoint,
) -> None:
    state = capital_facts.run(country="France", backend=endpoint, temperature=0)
    assert state.error() is None
    assert state["capital"] == " Paris"
    assert state["of"] == " France"
    assert state["choice"] == "France"


@pytest.fixture(scope="module")
def profiles(url: str) -> list[Any]:
    backend = sgl.RuntimeEndpoint(url, timeout=60)
    try:
        countries = ["France", "Japan", "Kenya", "Peru"]
        return list(
            country_profile.run_batch(
                [{"country": c} for c in countries],
                backend=backend,
                temperature=0,
                progress_bar=False,
            )
        )
    finally:
        backend.close()


def test_lang_branch_solve_merge_runs_every_program_without_error(profiles: list[Any]) -> None:
    assert [state.error() for state in profiles] == [None] * 4
    for state in profiles:
        assert len(state["answer"]) == 2 and all(a.strip() for a in state["answer"])


def test_lang_branches_answer_what_the_demo_model_knows(
    profiles: list[Any], capitals: dict[str, str]
) -> None:
    france = profiles[0]
    assert france["answer"][0] == "The capital of France is Paris."
    for state, country in zip(profiles, ["France", "Japan", "Kenya", "Peru"], strict=True):
        assert capitals[country] in state["answer"][0]


def test_lang_merged_profile_is_json_matching_the_schema(profiles: list[Any]) -> None:
    for state in profiles:
        jsonschema.validate(json.loads(state["profile"]), PROFILE)
    assert json.loads(profiles[0]["profile"])["capital"] == "Paris"


def test_lang_merge_reuses_the_shared_system_prompt_from_the_cache(profiles: list[Any]) -> None:
    for state in profiles:
        meta = state.get_meta_info("profile")
        assert meta["cached_tokens"] > 0 and meta["finish_reason"]["type"] == "stop"
    roles = [m["role"] for m in profiles[0].messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]


def test_lang_openai_backend_against_the_v1_api(url: str) -> None:
    @sgl.function
    def ask(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=24))

    backend = sgl.OpenAI(MODEL, base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    state = ask.run(question="What is the capital of France?", backend=backend, temperature=0)
    assert state.error() is None
    assert "Paris" in state["answer"]


def test_the_server_is_idle_after_every_client_finished(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert info["cache_hit_rate"] > 0
