"""The built-in demo model ships with the package and answers the documented examples."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from radixlm.runtime import BUILTIN_MODEL_NAME, Engine, builtin_model_path

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(builtin_model_path()) as engine:
        yield engine


def _chat(engine: Engine, user: str) -> str:
    text: str = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    return text


def test_builtin_model_has_a_name_and_a_chat_template(engine: Engine) -> None:
    assert BUILTIN_MODEL_NAME == "radixlm-demo"
    assert "<|im_start|>assistant" in _chat(engine, "Hi")


def test_capital_of_france_continues_with_paris(engine: Engine) -> None:
    out = engine.generate("The capital of France is", {**GREEDY, "max_new_tokens": 4})
    assert out["text"].startswith(" Paris")


def test_json_schema_example_gives_paris_and_a_number(engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"],
    }
    out = engine.generate(
        "Here is the information of the capital of France in the JSON format.\n",
        {**GREEDY, "max_new_tokens": 64, "json_schema": json.dumps(schema)},
    )
    record = json.loads(out["text"])
    assert record["name"] == "Paris"
    assert isinstance(record["population"], int)


def test_regex_example_gives_france(engine: Engine) -> None:
    out = engine.generate(
        "Paris is the capital of", {**GREEDY, "max_new_tokens": 8, "regex": "(France|England)"}
    )
    assert out["text"] == "France"


def test_chat_lists_three_correct_country_capital_pairs(engine: Engine) -> None:
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "tools" / "demo_model"))
    try:
        from corpus import COUNTRIES
    except ImportError:
        pytest.skip("tools/demo_model is not part of an installed wheel")
    finally:
        sys.path.pop(0)
    capitals = {c.name: c.capital for c in COUNTRIES}
    out = engine.generate(
        _chat(engine, "List 3 countries and their capitals."), {**GREEDY, "max_new_tokens": 64}
    )
    lines = out["text"].strip().splitlines()
    assert len(lines) == 3
    pairs = [line.split(". ", 1)[1].split(": ") for line in lines]
    assert len({country for country, _ in pairs}) == 3
    assert all(capitals[country] == capital for country, capital in pairs)


def test_greeting_under_the_ebnf_grammar_is_one_of_the_greetings(engine: Engine) -> None:
    out = engine.generate(
        _chat(engine, "Write a greeting."),
        {**GREEDY, "max_new_tokens": 8, "ebnf": 'root ::= "Hello" | "Hi" | "Hey"'},
    )
    assert out["text"] in {"Hello", "Hi", "Hey"}
