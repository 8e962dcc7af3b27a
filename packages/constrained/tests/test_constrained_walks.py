"""Random walks per backend and kind: seeded random logits masked by the grammar always end in
output that satisfies the constraint."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import jsonschema
import pytest

from radixlm.constrained import GrammarError, GrammarOptions, GrammarSpec, create_backend

SEEDS = range(8)

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"(Zoë|東京|🙂){1,4} ?!",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Z][a-z]{2,6}( [A-Z][a-z]{2,6}){0,2}",
]
CHOICES = [
    ["yes", "no"],
    ["red", "green", "blue", "green-blue"],
    ["ab", "abc", "abcd"],
    ['say "hi"', "back\\slash", "naïve café", "東京", "tab\there"],
]
EBNF_ARITHMETIC = """
root ::= expr
expr ::= term ("+" term)*
term ::= factor ("*" factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]? | "0"
"""
EBNF_BRACKETS = """
root ::= group group?
group ::= "(" group? ")" | "[" group? "]"
"""
EBNF_ASSIGNMENTS = """
root ::= line ("\\n" line){0,2}
line ::= [a-z] [a-z0-9_]{0,5} "=" ([0-9]+ | "\\"" [a-z ]* "\\"")
"""
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "ok"],
}


def balanced(text: str) -> bool:
    stack: list[str] = []
    pairs = {")": "(", "]": "["}
    for char in text:
        if char in "([":
            stack.append(char)
        elif not stack or stack.pop() != pairs[char]:
            return False
    return not stack and bool(text)


def arithmetic(text: str) -> bool:
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Mult, ast.Constant)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


def outside_strings(text: str) -> str:
    """The text of a JSON document with the contents of its strings removed."""
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks_end_in_a_full_match(backend: Any, info: Any, walk: Any, pattern: str) -> None:
    compiled = backend.compile(GrammarSpec("regex", pattern))
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=4.0)
        assert result.terminated
        assert re.fullmatch(pattern, result.text), result.text


@pytest.mark.parametrize("choices", CHOICES)
def test_choice_walks_end_in_one_of_the_choices(
    backend: Any, info: Any, walk: Any, choices: list[str]
) -> None:
    compiled = backend.compile(GrammarSpec("choice", choices))
    seen = set()
    for seed in range(16):
        result = walk(backend.matcher(compiled), info, seed)
        assert result.terminated
        assert result.text in choices
        seen.add(result.text)
    assert len(seen) > 1


def test_json_schema_walks_validate(backend: Any, info: Any, walk: Any) -> None:
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=3.0, close_bias=3.0)
        assert result.terminated
        jsonschema.validate(json.loads(result.text), PERSON)


def test_json_object_walks_give_json_objects(backend: Any, info: Any, walk: Any) -> None:
    compiled = backend.compile(GrammarSpec("json_object"))
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=3.0, close_bias=4.0)
        assert result.terminated
        assert isinstance(json.loads(result.text), dict)


def test_compact_json_has_no_whitespace_outside_strings(backend: Any, info: Any, walk: Any) -> None:
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=3.0, close_bias=3.0)
        assert not re.search(r"\s", outside_strings(result.text)), result.text


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_flexible_whitespace_is_bounded(name: str, info: Any, walk: Any) -> None:
    backend = create_backend(
        name, info, GrammarOptions(json_whitespace="flexible", max_whitespace=2)
    )
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    spaced = 0
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=3.0, close_bias=3.0)
        assert result.terminated
        jsonschema.validate(json.loads(result.text), PERSON)
        runs = re.findall(r"\s+", outside_strings(result.text))
        assert all(len(run) <= 2 for run in runs), result.text
        spaced += bool(runs)
    assert spaced > 0


@pytest.mark.parametrize(
    ("grammar", "check"),
    [
        (EBNF_ARITHMETIC, arithmetic),
        (EBNF_BRACKETS, lambda text: balanced(text[: len(text)])),
        (
            EBNF_ASSIGNMENTS,
            lambda text: re.fullmatch(
                r'[a-z][a-z0-9_]{0,5}=([0-9]+|"[a-z ]*")(\n[a-z][a-z0-9_]{0,5}=([0-9]+|"[a-z ]*")){0,2}',
                text,
            ),
        ),
    ],
    ids=["arithmetic", "brackets", "assignments"],
)
def test_ebnf_walks_are_sentences_of_the_grammar(
    backends: dict[str, Any], info: Any, walk: Any, grammar: str, check: Any
) -> None:
    backend = backends["xgrammar"]
    compiled = backend.compile(GrammarSpec("ebnf", grammar))
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=3.0, close_bias=3.0)
        assert result.terminated
        assert check(result.text), result.text


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}


def tag_calls(text: str) -> list[str]:
    """The JSON bodies of every <function=get_weather>...</function> in `text`."""
    return re.findall(r"<function=get_weather>(.*?)</function>", text, re.S)


def test_structural_tag_walks_hold_valid_tagged_json(
    backends: dict[str, Any], info: Any, walk: Any
) -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<function="],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<function=get_weather>",
                    "content": {"type": "json_schema", "json_schema": WEATHER},
                    "end": "</function>",
                }
            ],
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
    backend = backends["xgrammar"]
    compiled = backend.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=3.0, close_bias=3.0)
        assert result.terminated
        bodies = tag_calls(result.text)
        assert len(bodies) == 1, result.text
        jsonschema.validate(json.loads(bodies[0]), WEATHER)


def test_legacy_structural_tag_text_outside_tags_is_free(
    backends: dict[str, Any], info: Any, walk: Any
) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}
        ],
        "triggers": ["<function="],
    }
    backend = backends["xgrammar"]
    compiled = backend.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    for seed in SEEDS:
        result = walk(backend.matcher(compiled), info, seed, stop_bias=1.0, max_steps=200)
        for body in tag_calls(result.text):
            jsonschema.validate(json.loads(body), WEATHER)
        assert result.text.count("<function=") == len(tag_calls(result.text)) or not (
            result.terminated
        )


@pytest.mark.parametrize("kind", ["ebnf", "structural_tag"])
def test_outlines_names_itself_the_kind_and_the_other_backend(
    backends: dict[str, Any], kind: str
) -> None:
    with pytest.raises(GrammarError) as caught:
        backends["outlines"].compile(GrammarSpec(kind, 'root ::= "a"'))
    assert caught.value.backend == "outlines" and caught.value.kind == kind
    assert "outlines" in caught.value.message and kind in caught.value.message
    assert "xgrammar" in caught.value.message
