"""Structured output through the engine: constrained text, jump-forward, grammar errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CAPITALS = {
    "enum": [
        "Paris is the capital of France, a country of Europe",
        "London is the capital of England, a country of Europe",
    ]
}
CITY = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Paris", "London"]},
        "country": {"enum": ["France", "England"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(params=["thread", "process"])
def engine_process(request: pytest.FixtureRequest) -> bool:
    """The core on a thread, and in its own process (forced tokens and rollbacks then reach
    the front end as deltas)."""
    return bool(request.param == "process")


def _run(
    model_dir: Path, schema: dict[str, Any], jump_forward: bool, engine_process: bool
) -> tuple[str, int]:
    params = {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(schema)}
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=2048,
        disable_jump_forward=not jump_forward,
        engine_process=engine_process,
    ) as engine:
        out = engine.generate("the answer", params)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        return out["text"], engine.server_info(fresh=True)["forward_passes"]


def test_jump_forward_gives_the_same_text_in_fewer_forward_passes(
    model_dir: Path, engine_process: bool
) -> None:
    text_jf, passes_jf = _run(model_dir, CAPITALS, True, engine_process)
    text, passes = _run(model_dir, CAPITALS, False, engine_process)
    assert text_jf == text
    assert json.loads(text) in CAPITALS["enum"]
    assert passes_jf < passes / 2


def test_object_schema_output_validates_with_and_without_jump_forward(
    model_dir: Path, engine_process: bool
) -> None:
    text_jf, passes_jf = _run(model_dir, CITY, True, engine_process)
    text, passes = _run(model_dir, CITY, False, engine_process)
    for output in (text_jf, text):
        value = json.loads(output)
        assert set(value) == {"name", "country", "population"}
        assert value["name"] in ("Paris", "London") and value["country"] in ("France", "England")
        assert isinstance(value["population"], int) and 0 <= value["population"] <= 99999
    assert passes_jf < passes


def test_regex_and_choice_constraints_hold(model_dir: Path, engine_process: bool) -> None:
    with Engine(
        str(model_dir), show_progress=False, max_total_tokens=2048, engine_process=engine_process
    ) as engine:
        out = engine.generate("pick", {"temperature": 0, "regex": "(France|England)"})
        assert out["text"] in ("France", "England")
        out = engine.generate(
            "pick", {"temperature": 1.0, "seed": 3, "regex": r"[0-9]{3}-[a-z]{2}"}
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out["text"])
        ebnf = 'root ::= "Hello" | "Hi" | "Hey"'
        out = engine.generate("greet", {"temperature": 0, "ebnf": ebnf, "n": 2})
        assert all(o["text"] in ("Hello", "Hi", "Hey") for o in out)
        engine.check_invariants()


def test_grammar_backend_none_refuses_constraints(model_dir: Path) -> None:
    from radixlm.sampling import InvalidRequest

    with Engine(
        str(model_dir), show_progress=False, max_total_tokens=1024, grammar_backend="none"
    ) as engine:
        with pytest.raises(InvalidRequest, match="grammar_backend"):
            engine.generate("x", {"regex": "a+"})
        assert engine.generate("x", {"max_new_tokens": 2})["output_ids"]
