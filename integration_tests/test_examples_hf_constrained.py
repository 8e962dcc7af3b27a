"""examples/hf_constrained.py: radixlm-constrained under plain `transformers` `model.generate`
on the built-in demo model (run in this process, as `__main__`, to share the imports)."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hf_constrained.py"


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    """The example's namespace, loaded without running main()."""
    return runpy.run_path(str(SCRIPT), run_name="hf_constrained_example")


@pytest.fixture(scope="module")
def demo(example: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixlm.runtime import builtin_model_path

    path = builtin_model_path()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _main_output(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                 *args: str) -> list[str]:  # fmt: skip
    monkeypatch.setattr("sys.argv", [str(SCRIPT), *args])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    return capsys.readouterr().out.splitlines()


def test_the_script_prints_a_record_that_validates_and_the_regex_answer(
    example: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = _main_output(monkeypatch, capsys)
    assert lines[0].startswith("json_schema: ")
    record = json.loads(lines[0].removeprefix("json_schema: "))
    jsonschema.validate(record, example["SCHEMA"])
    assert record["name"] == "Paris"  # the documented answer of the demo model
    assert lines[-1] == "regex: France"


def test_every_country_record_validates_against_the_schema(
    example: dict[str, Any], demo: tuple[Any, Any]
) -> None:
    from radixlm.constrained import GrammarSpec

    model, tokenizer = demo
    schema = {
        "type": "object",
        "properties": {
            "country": {"type": "string", "maxLength": 16},
            "capital": {"type": "string", "maxLength": 16},
            "population": {"type": "integer", "minimum": 0},
        },
        "required": ["country", "capital", "population"],
        "additionalProperties": False,
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    for country in ("Japan", "Peru"):
        prompt = f"The facts about {country} in JSON:\n"
        text = example["constrained_generate"](model, tokenizer, prompt, spec, "xgrammar", 64)
        jsonschema.validate(json.loads(text), schema)


def test_the_regex_constraint_holds_where_the_model_would_write_otherwise(
    example: dict[str, Any], demo: tuple[Any, Any]
) -> None:
    from radixlm.constrained import GrammarSpec

    model, tokenizer = demo
    spec = GrammarSpec("regex", "[0-9]{3}")  # the model would continue with words here
    text = example["constrained_generate"](
        model, tokenizer, "The capital of France is", spec, "xgrammar", 8
    )
    assert len(text) == 3 and text.isdigit()
