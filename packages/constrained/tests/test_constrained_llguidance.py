"""The llguidance backend: its tokenizer, EBNF and structural tags, its errors, exact masks,
jump-forward, and what it enforces of JSON Schema (the measurements behind LLGUIDANCE_SUPPORT:
edge-case documents fed byte by byte and random walks, checked with jsonschema, and with RFC
references for the formats jsonschema does not check here)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

pytest.importorskip("llguidance")

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from radixlm.constrained import (
    GrammarError,
    GrammarOptions,
    GrammarSpec,
    TokenizerInfo,
    allocate_bitmask,
    create_backend,
    unpack_bitmask,
)
from radixlm.constrained._schema_support import LLGUIDANCE_SUPPORT, support_of
from radixlm.constrained.backends.llguidance_backend import (
    LLGuidanceMatcher,
    build_tokenizer,
    parser_limits,
)


@pytest.fixture(scope="module")
def llg(backends: dict[str, Any]) -> Any:
    return backends["llguidance"]


@pytest.fixture(scope="module")
def tokenizer(info: Any) -> Any:
    """llguidance's tokenizer over the byte-level test vocabulary."""
    return build_tokenizer(info)


@pytest.fixture(scope="module")
def byte_token(info: Any) -> dict[int, int]:
    """The one-byte token of every byte (the byte-level vocabulary has all 256)."""
    found = {data[0]: i for i, data in enumerate(info.token_bytes) if data and len(data) == 1}
    assert len(found) == 256
    return found


def allowed(grammar: Any, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist())


def takes(grammar: Any, byte_token: dict[int, int], text: str, stop: int = 0) -> bool:
    """Whether the grammar takes `text` fed one byte per token, then a stop token."""
    return all(grammar.accept_token(byte_token[b]) for b in text.encode()) and (
        grammar.accept_token(stop)
    )


def validator(schema: Any) -> Any:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


# -- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_spans_the_model_vocabulary_with_every_stop_token(hf_tokenizer: Any) -> None:
    two_stops = TokenizerInfo.from_hf(hf_tokenizer, vocab_size=1024, stop_token_ids=[0, 1])
    tokenizer = build_tokenizer(two_stops)
    assert tokenizer.vocab_size == 1024 and set(tokenizer.eos_tokens) == {0, 1}
    backend = create_backend("llguidance", two_stops)
    grammar = backend.matcher(backend.compile(GrammarSpec("choice", ["7"])))
    start = allowed(grammar, 1024)
    assert start and not start & {0, 1, *range(1000, 1024)}
    assert grammar.accept_token(hf_tokenizer.encode("7", add_special_tokens=False)[0])
    assert allowed(grammar, 1024) == {0, 1}  # nothing but the end, by either stop token
    assert grammar.accept_token(1) and grammar.is_terminated()
    grammar.rollback(1)
    assert allowed(grammar, 1024) == {0, 1} and grammar.accept_token(0)


def test_a_stop_token_with_text_only_ever_ends_the_output() -> None:
    synthetic = TokenizerInfo.from_vocab([None, "a", "b", "ab"], stop_token_ids=[2])
    backend = create_backend("llguidance", synthetic)
    grammar = backend.matcher(backend.compile(GrammarSpec("regex", "[ab]+")))
    assert allowed(grammar, 4) == {1, 3}
    assert grammar.accept_token(1)
    assert allowed(grammar, 4) == {1, 2, 3}
    assert grammar.accept_token(2) and grammar.is_terminated()


def test_matchers_of_a_shared_grammar_come_from_other_threads(llg: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    compiled = llg.compile(GrammarSpec("regex", "[0-9]{2}"))
    with ThreadPoolExecutor(2) as pool:
        grammars = list(pool.map(lambda _: llg.matcher(compiled), range(4)))
    assert len({frozenset(allowed(g, llg.tokenizer_info.vocab_size)) for g in grammars}) == 1


# -- masks ----------------------------------------------------------------------------------

MASKED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": -3, "maximum": 40},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
}


@pytest.mark.parametrize("which", ["info", "sp_info"])
def test_mask_is_exactly_what_accept_token_takes_along_a_walk(
    request: pytest.FixtureRequest, walk: Any, which: str
) -> None:
    tokenizer_info = request.getfixturevalue(which)
    size = tokenizer_info.vocab_size
    backend = create_backend("llguidance", tokenizer_info)
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(MASKED)))
    path = walk(backend.matcher(compiled), tokenizer_info, 1, stop_bias=3.0, close_bias=3.0)
    grammar = backend.matcher(compiled)
    bitmask = allocate_bitmask(1, size)
    for step, token in enumerate([*path.token_ids, None]):
        if step % 3 == 0 or token is None:
            grammar.fill_bitmask(bitmask, 0)
            mask = set(unpack_bitmask(bitmask, size)[0].nonzero().flatten().tolist())
            assert mask == {t for t in range(size) if grammar.fork().accept_token(t)}, step
            if size % 32:  # bits past the vocabulary, in the last word, stay 0
                assert (int(bitmask[0, -1]) & 0xFFFFFFFF) >> (size % 32) == 0
        if token is not None:
            assert grammar.accept_token(token)


# -- EBNF -----------------------------------------------------------------------------------

EBNF_AGREEMENT = [
    (
        'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= factor ("*" factor)*\n'
        'factor ::= number | "(" expr ")"\nnumber ::= [1-9] [0-9]? | "0"',
        ["1+2*3", "(1+2)*30", "0", "01", "1+", "100", "((7))", ""],
    ),
    # A rule llguidance would lex greedily: `word` eats the "b" it needs after it.
    ('root ::= word "b"\nword ::= [a-z]+', ["xb", "xbb", "b", "abcb", "x"]),
    ('root ::= ("ab" | "abc") "c"', ["abc", "abcc", "ab", "abccc"]),
    (
        'root ::= "\\u00e9" [\\u00e0-\\u00ff]+ "\\x41" ["\\\\\\]]* [^a-z\\n]',
        ["éàA!", "é\u00ffA\\]\\Z", "éA!", "éàAa", "éàA\n", "éàA東"],
    ),
    (
        'root ::= line ("\\n" line){0,2}  # comment\nline ::= [a-z] [a-z0-9_]{0,5} "="\n'
        '    ([0-9]+ | "\\"" [a-z ]* "\\"")',
        ["a=1", 'x_1="hi there"\nb=2', "a=1\nb=2\nc=3\nd=4", "toolong=1", "a="],
    ),
    ('root ::= my-rule.x{2}\nmy-rule.x ::= "ab" | [0-9]', ["abab", "1ab", "ab", "123"]),
]


@pytest.mark.parametrize(("grammar", "texts"), EBNF_AGREEMENT)
def test_ebnf_takes_what_xgrammar_takes(
    backends: dict[str, Any], byte_token: dict[int, int], grammar: str, texts: list[str]
) -> None:
    spec = GrammarSpec("ebnf", grammar)
    xgrammar, llguidance = (backends[n].compile(spec) for n in ("xgrammar", "llguidance"))
    verdicts = set()
    for text in texts:
        expected = takes(backends["xgrammar"].matcher(xgrammar), byte_token, text)
        assert takes(backends["llguidance"].matcher(llguidance), byte_token, text) == expected, text
        verdicts.add(expected)
    assert verdicts == {True, False}


def test_gbnf_to_lark_would_lose_sentences_to_greedy_lexing(
    llg: Any, tokenizer: Any, byte_token: dict[int, int]
) -> None:
    grammar = 'root ::= word "b"\nword ::= [a-z]+'
    theirs = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(gbnf_to_lark(grammar)))
    theirs = LLGuidanceMatcher(theirs, llg.tokenizer_info, llg.options, [])
    assert not takes(theirs, byte_token, "xb")
    assert takes(llg.matcher(llg.compile(GrammarSpec("ebnf", grammar))), byte_token, "xb")


def test_ebnf_walks_end_in_sentences(llg: Any, info: Any, walk: Any) -> None:
    grammar = 'root ::= group group?\ngroup ::= "(" group? ")" | "[" group? "]"'
    compiled = llg.compile(GrammarSpec("ebnf", grammar))
    for seed in range(4):
        result = walk(llg.matcher(compiled), info, seed, stop_bias=3.0, close_bias=3.0)
        text = result.text
        assert result.terminated
        while any(pair in text for pair in ("()", "[]")):
            text = text.replace("()", "").replace("[]", "")
        assert text == ""


@pytest.mark.parametrize(
    ("grammar", "says"),
    [
        ('root ::= "a" (', "expected an element"),
        ("root ::= missing_rule", "'missing_rule' is not defined"),
        ('start ::= "a"', "no rule named 'root'"),
        ('root ::= "unterminated', "unterminated"),
        ("root ::= [z-a]", "invalid character range"),
        ('root ::= "a" (= "b")', "lookahead"),
        ('root ::= "\\q"', "invalid escape"),
        ('root ::= "a"{2,1}', "upper bound"),
        ('root ::= "a"\nroot ::= "b"', "defined twice"),
        ('root ::= "a" | ', "expected an element"),
    ],
)
def test_broken_ebnf_is_a_grammar_error_saying_where(llg: Any, grammar: str, says: str) -> None:
    with pytest.raises(GrammarError) as caught:
        llg.compile(GrammarSpec("ebnf", grammar))
    assert caught.value.backend == "llguidance" and caught.value.kind == "ebnf"
    assert "does not compile" in caught.value.message and says in caught.value.message


# -- structural tags ------------------------------------------------------------------------

DAYS = {"type": "object", "properties": {"d": {"type": "integer"}}, "required": ["d"]}
TAGGED = [
    "",
    "hi",
    '<f=a>{"d":1}</f>',
    'hi<f=a>{"d":1}</f>',
    '<f=a>{"d":1}</f>bye',
    '<f=a>{"d":1}</f>x<f=a>{"d":2}</f>',
    "a<f",
    "a<f=b",
    '<f=a>{"d":"x"}</f>',
]


def triggered(at_least_one: bool, stop_after_first: bool) -> GrammarSpec:
    tag = {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": DAYS}}
    fmt = {
        "type": "triggered_tags",
        "triggers": ["<f="],
        "tags": [{**tag, "end": "</f>"}],
        "at_least_one": at_least_one,
        "stop_after_first": stop_after_first,
    }
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


@pytest.mark.parametrize(
    ("at_least_one", "stop_after_first", "expected"),
    [
        (False, False, {0, 1, 2, 3, 4, 5, 6}),
        (False, True, {0, 1, 2, 3, 6}),
        (True, False, {2, 4, 5}),
        (True, True, {2}),
    ],
)
def test_triggered_tags_mean_what_they_mean_on_xgrammar(
    backends: dict[str, Any],
    byte_token: dict[int, int],
    at_least_one: bool,
    stop_after_first: bool,
    expected: set[int],
) -> None:
    spec = triggered(at_least_one, stop_after_first)
    for name in ("xgrammar", "llguidance"):
        compiled = backends[name].compile(spec)
        took = {
            i
            for i, t in enumerate(TAGGED)
            if takes(backends[name].matcher(compiled), byte_token, t)
        }
        assert took == expected, name


def test_legacy_structural_tag_walks_hold_valid_tagged_json(llg: Any, info: Any, walk: Any) -> None:
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    }
    tag = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<function=get_weather>", "schema": weather, "end": "</function>"}
        ],
        "triggers": ["<function="],
    }
    compiled = llg.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    for seed in range(4):
        result = walk(llg.matcher(compiled), info, seed, stop_bias=1.0, max_steps=150)
        bodies = re.findall(r"<function=get_weather>(.*?)</function>", result.text, re.S)
        for body in bodies:
            jsonschema.validate(json.loads(body), weather)
        assert result.text.count("<function=") == len(bodies) or not result.terminated


def test_structural_tag_formats_compose(llg: Any, byte_token: dict[int, int]) -> None:
    fmt = {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "Answer: "},
            {
                "type": "or",
                "elements": [
                    {"type": "const_string", "value": "yes"},
                    {"type": "json_schema", "json_schema": DAYS},
                ],
            },
            {
                "type": "tags_with_separator",
                "separator": ",",
                "tags": [
                    {
                        "type": "tag",
                        "begin": "<t>",
                        "content": {"type": "grammar", "grammar": 'root ::= [0-9]+ "x"'},
                        "end": "</t>",
                    },
                    {"type": "tag", "begin": "<u>", "content": {"type": "any_text"}, "end": "</u>"},
                ],
            },
        ],
    }
    compiled = llg.compile(GrammarSpec("structural_tag", json.dumps({"format": fmt})))
    for text, expected in [
        ("Answer: yes", True),
        ('Answer: {"d":3}<t>12x</t>', True),
        ("Answer: yes<t>1x</t>,<u>any </t> text</u>", True),
        ("Answer: yes<t>1</t>", False),
        ('Answer: {"d": 3}', False),  # compact JSON, as everywhere
        ("Answer: no", False),
    ]:
        assert takes(llg.matcher(compiled), byte_token, text) == expected, text


@pytest.mark.parametrize(
    ("fmt", "says"),
    [
        ({"type": "regex", "pattern": "a+"}, "'regex'"),
        ({"type": "any_tokens"}, "'any_tokens'"),
        (
            {
                "type": "sequence",
                "elements": [{"type": "any_text"}, {"type": "const_string", "value": "x"}],
            },
            "any_text",
        ),
        ({"type": "any_text", "excludes": ["x"]}, "excludes"),
        ({"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}, "qwen_xml"),
    ],
)
def test_structural_tags_beyond_llguidance_are_refused_naming_what(
    llg: Any, fmt: dict[str, Any], says: str
) -> None:
    with pytest.raises(GrammarError) as caught:
        llg.compile(GrammarSpec("structural_tag", json.dumps({"format": fmt})))
    assert caught.value.backend == "llguidance" and caught.value.kind == "structural_tag"
    assert says in caught.value.message and "xgrammar" in caught.value.message


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        (
            {"type": "object", "patternProperties": {"^x": {"type": "integer"}, "a$": {}}},
            "patternProperties",
        ),
        ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, "maxProperties"),
        ({"type": "number", "maximum": 1e300}, "maximum"),
        ({"type": "string", "pattern": "(?=a)b"}, "pattern"),
    ],
)
def test_schemas_llguidance_refuses_name_the_keyword(
    llg: Any, schema: dict[str, Any], keyword: str
) -> None:
    with pytest.raises(GrammarError) as caught:
        llg.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert caught.value.keyword == keyword and caught.value.backend == "llguidance"
    assert keyword in caught.value.message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "allOf": [{"properties": {"a": {}}}], "unevaluatedProperties": False},
        {"$defs": {"t": {"prefixItems": [{}], "unevaluatedItems": False}}, "$ref": "#/$defs/t"},
    ],
)
def test_unevaluated_false_closes_what_the_merged_schema_does_not_list(
    llg: Any, schema: dict[str, Any], info: Any, vwalk: Any, check_schema_of: Any
) -> None:
    # llguidance writes members a schema does not list (JSON Schema's default): the
    # normalizer turns `false` into additionalProperties / items false once allOf and $ref
    # are merged, so walks stay valid.
    compiled = llg.compile(GrammarSpec("json_schema", json.dumps(schema)))
    check = check_schema_of(schema)
    finished = 0
    for seed in range(8):
        text, _ = vwalk(llg.matcher(compiled), info, seed)
        if text is not None:
            finished += 1
            assert not list(check.iter_errors(json.loads(text))), text
    assert finished >= 4


def test_unimplemented_keys_are_named_even_past_the_normalizer() -> None:
    from radixlm.constrained.backends.llguidance_backend import _grammar_error

    grammar = LLMatcher.grammar_from_json_schema('{"type": "array", "contains": {}}')
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits())
    assert failed and messages
    error = _grammar_error(GrammarSpec("json_schema", "{}"), messages[0])
    assert error.keyword == "contains" and "'contains'" in error.message
    unknown = _grammar_error(GrammarSpec("json_schema", "{}"), "Unknown format: credit-card")
    assert unknown.keyword == "format" and "credit-card" in unknown.message


@pytest.mark.parametrize(
    ("regex", "says"),
    [
        ("(unclosed", "unclosed group"),
        ("a{3,1}", "invalid repetition"),
        ("[z-a]", "invalid character class range"),
        ("a\\", "lone backslash"),
        ("(?=look)ahead", "look-around"),
        ("(a)\\1", "backreferences are not supported"),
    ],
)
def test_bad_regex_is_a_grammar_error_with_the_reason(llg: Any, regex: str, says: str) -> None:
    with pytest.raises(GrammarError) as caught:
        llg.compile(GrammarSpec("regex", regex))
    assert caught.value.backend == "llguidance" and says in caught.value.message


def test_a_regex_past_llguidances_fuel_is_a_fatal_violation(llg: Any, info: Any) -> None:
    # Nested counted repetitions: after a few long tokens, building the lexer's states for a
    # step runs past its fuel. The matcher then allows nothing and says why.
    grammar = llg.matcher(llg.compile(GrammarSpec("regex", "([a-z]{1,100}){1,100}")))
    assert grammar.violation() is None
    for _ in range(20):
        mask = allowed(grammar, info.vocab_size) - set(info.stop_token_ids)
        if not mask:
            break
        assert grammar.accept_token(max(mask, key=lambda t: (len(info.token_bytes[t]), t)))
    assert not allowed(grammar, info.vocab_size)
    assert not grammar.accept_token(info.stop_token_ids[0])
    violation = grammar.violation()
    assert violation is not None and violation.fatal and "too complex" in violation.message


def test_a_blowing_up_regex_decodes_in_bounded_time(llg: Any, info: Any, walk: Any) -> None:
    compiled = llg.compile(GrammarSpec("regex", "(a|b|c)*a(a|b|c){18}"))
    result = walk(llg.matcher(compiled), info, 0, max_steps=60, stop_bias=-5.0)
    assert result.model_calls == 60  # never terminated, never stuck


# -- jump-forward ---------------------------------------------------------------------------


def test_llguidances_own_forced_tokens_are_not_the_tokenizers(
    llg: Any, tokenizer: Any, hf_tokenizer: Any, info: Any
) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "integer"}}, "required": ["name"]}
    brace = hf_tokenizer.get_vocab()["{"]
    # llguidance left to force tokens itself: the forced bytes tokenized on their own.
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=llg.json_options())
    theirs = LLMatcher(tokenizer, grammar, log_level=0)
    assert theirs.try_consume_tokens([brace]) == 1
    forced = [brace, *theirs.compute_ff_tokens()]
    canonical = info.encode_exact(info.decode_bytes(forced).decode())
    assert forced != canonical  # `{` + `"`: the tokenizer writes `{"`
    ours = llg.matcher(llg.compile(GrammarSpec("json_schema", json.dumps(schema))))
    assert ours.accept_token(brace)
    jump = ours.jump_forward()
    assert jump is not None and jump.rollback == 1
    assert list(jump.token_ids) == canonical


def stand_in_model(info: Any, target: str) -> Callable[[list[int]], torch.Tensor]:
    """Seeded noise plus a strong preference for writing `target` as the tokenizer does (or,
    between its token boundaries, with the longest token that fits)."""
    goal = target.encode()
    boundary, position = {}, 0
    for token in info.encode_exact(target):
        boundary[position] = token
        position += len(info.token_bytes[token])

    def logits(output: list[int]) -> torch.Tensor:
        text = info.decode_bytes(output)
        seed = int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
        row = torch.randn(1, info.vocab_size, generator=torch.Generator().manual_seed(seed))
        if goal.startswith(text):
            rest = goal[len(text) :]
            choice = boundary.get(len(text)) if rest else info.stop_token_ids[0]
            if choice is None:
                fits = [i for i, b in enumerate(info.token_bytes) if b and rest.startswith(b)]
                choice = max(fits, key=lambda i: len(info.token_bytes[i]))
            row[0, choice] += 100.0
        return row

    return logits


@pytest.mark.parametrize("which", ["info", "sp_info"])
def test_jump_forward_writes_the_tokenizers_own_tokens(
    request: pytest.FixtureRequest, walk: Any, which: str
) -> None:
    tokenizer_info = request.getfixturevalue(which)
    backend = create_backend("llguidance", tokenizer_info)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"enum": ["Paris", "東京", "New York"]},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}},
        },
        "required": ["name", "city", "tags"],
    }
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    for target in (
        '{"name":"Zoë","city":"東京","tags":["green"]}',
        '{"name":"","city":"New York","tags":[]}',
    ):
        model = stand_in_model(tokenizer_info, target)
        plain = walk(backend.matcher(compiled), tokenizer_info, 0, logits=model)
        jumping = walk(
            backend.matcher(compiled), tokenizer_info, 0, logits=model, jump_forward=True
        )
        assert plain.text == jumping.text == target
        assert jumping.token_ids == tokenizer_info.encode_exact(target)
        assert jumping.model_calls < plain.model_calls


# -- fork and rollback ----------------------------------------------------------------------


def test_fork_and_rollback_are_exact(llg: Any, hf_tokenizer: Any, info: Any) -> None:
    grammar = llg.matcher(llg.compile(GrammarSpec("choice", ["alpha", "alps"])))
    start = allowed(grammar, info.vocab_size)
    assert all(grammar.accept_token(t) for t in hf_tokenizer.encode("al", add_special_tokens=False))
    twin = grammar.fork()
    assert all(twin.accept_token(t) for t in hf_tokenizer.encode("pha", add_special_tokens=False))
    assert twin.accept_token(info.stop_token_ids[0]) and twin.is_terminated()
    assert twin.fork().is_terminated() and not grammar.is_terminated()
    assert info.stop_token_ids[0] not in allowed(grammar, info.vocab_size)
    twin.rollback(len(twin.history))
    assert allowed(twin, info.vocab_size) == start and twin.history == []
    assert grammar.history == hf_tokenizer.encode("al", add_special_tokens=False)


# -- whitespace -----------------------------------------------------------------------------


def test_flexible_whitespace_is_bounded_and_compact_has_none(info: Any, walk: Any) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer"}},
            "b": {"type": "boolean"},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    flexible = create_backend("llguidance", info, GrammarOptions(json_whitespace="flexible"))
    runs = []
    for seed in range(4):
        result = walk(
            flexible.matcher(flexible.compile(spec)), info, seed, stop_bias=3.0, close_bias=3.0
        )
        jsonschema.validate(json.loads(result.text), schema)
        runs += re.findall(r"\s+", result.text)
        assert not result.text[0].isspace() and not result.text[-1].isspace()
    assert runs and max(map(len, runs)) <= 2
    llg = create_backend("llguidance", info)
    compact = walk(llg.matcher(llg.compile(spec)), info, 0, stop_bias=3.0, close_bias=3.0)
    assert not re.search(r"\s", compact.text)


# -- what llguidance enforces of JSON Schema ------------------------------------------------

# Each schema with documents around its edges; any document the grammar takes must be valid.
EDGES: list[tuple[dict[str, Any], list[str]]] = [
    (
        {"type": "integer", "minimum": -5, "exclusiveMaximum": 300},
        ["-6", "-5", "0", "-0", "299", "300", "299.0", "1e2", "12345678901234567890"],
    ),
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, ["0", "5", "7", "100", "-5", "1e1"]),
    (
        {"type": "number", "minimum": 0.5, "exclusiveMaximum": 10},
        ["0.5", "0.4999", "0.5000001", "5e-1", "4.9e-1", "9.9999", "10", "10.0", "1e1", "0.1e1"],
    ),
    ({"type": "number", "exclusiveMinimum": -0.001, "maximum": 0.3}, ["-0.001", "-0.0009", "0", "0.3", "0.30000000000000004"]),
    (
        {"type": "string", "minLength": 2, "maxLength": 3},
        ['"a"', '"ab"', '"abcd"', '"Zoë"', '"東京都"', '"🙂🙂"', '"🙂🙂🙂🙂"', '"\\n\\t"', '"\\u00e9"', '"\\ud83d\\ude42\\ud83d\\ude42"', '"a\x7f"', '"\x01a"'],
    ),
    (
        {"type": "string", "pattern": "^\\d{2}-\\w+$"},
        ['"12-ab"', '"١٢-ab"', '"12-é"', '"12-ab\\n"', '"x12-ab"', '"12-"'],
    ),
    ({"type": "string", "pattern": "b+c"}, ['"abbcd"', '"ac"', '"bc"', '"a\\"bc"', '"\\\\bc"']),
    ({"type": "string", "pattern": '^a"\\\\$'}, ['"a\\"\\\\"', '"a\\"\\\\\\\\"', '"a\\""']),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, ['["a"]', '["a",1]', '["a",1,2]', '["a",1,2,3]', '[1,1]', '["a","b"]']),
    (
        {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"], "additionalProperties": {"type": "string"}, "maxProperties": 2},
        ['{"id":1}', '{"id":1,"x":"s"}', '{"id":1,"x":"s","y":"t"}', '{"id":1,"x":2}', '{"id":1,"id":"s"}', '{"x":"s","id":1}'],
    ),
    (
        {"type": "object", "properties": {"xa": {"type": "integer"}}, "patternProperties": {"^x": {"minimum": 5}, "^b": {"type": "string"}}, "additionalProperties": False},
        ['{"xa":1}', '{"xa":7}', '{"xq":7}', '{"xq":"s"}', '{"ba":"s"}', '{"ba":1}', '{"q":1}', '{"xa":7,"xa":1}'],
    ),
    (
        {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}, "required": ["v", "next"]}}, "$ref": "#/$defs/n"},
        ['{"v":1,"next":null}', '{"v":1,"next":{"v":2,"next":null}}', '{"v":1,"next":{"v":2}}', '{"v":1,"next":{"v":"x","next":null}}'],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "documents"), EDGES, ids=lambda v: json.dumps(v)[:40])
def test_documents_at_the_edges_are_taken_only_when_valid(
    llg: Any, byte_token: dict[int, int], schema: dict[str, Any], documents: list[str]
) -> None:
    compiled = llg.compile(GrammarSpec("json_schema", json.dumps(schema)))
    check = validator(schema)
    took = 0
    for document in documents:
        if takes(llg.matcher(compiled), byte_token, document):
            took += 1
            assert check.is_valid(json.loads(document)), document
    assert took


_U, _PCT, _SUB = r"[A-Za-z0-9\-._~]", r"%[0-9A-Fa-f]{2}", r"[!$&'()*+,;=]"
_PCHAR = f"(?:{_U}|{_PCT}|{_SUB}|[:@])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_ATEXT = r"[A-Za-z0-9!#$%&'*+\-/=?^_`{|}~]"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_DUR_TIME = r"T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
_DUR_DATE = r"(?:[0-9]+D|[0-9]+M(?:[0-9]+D)?|[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?)"


def _ipv6(text: str) -> bool:
    try:
        return "%" not in text and bool(ipaddress.IPv6Address(text))
    except ValueError:
        return False


def _uri(text: str) -> bool:
    """RFC 3986 `URI` (scheme, hier-part, query, fragment)."""
    found = re.fullmatch(
        r"([A-Za-z][A-Za-z0-9+\-.]*):(//([^/?#]*))?([^?#]*)(\?[^#]*)?(#.*)?", text, re.S
    )
    if not found:
        return False
    authority, path, query, fragment = (
        found.group(3),
        found.group(4),
        found.group(5),
        found.group(6),
    )
    if authority is not None:
        parts = re.fullmatch(
            rf"(?:(?:{_U}|{_PCT}|{_SUB}|:)*@)?(\[[^\]]*\]|[^:@]*)(?::[0-9]*)?", authority
        )
        if not parts:
            return False
        host = parts.group(1)
        if host.startswith("["):
            inner = host[1:-1]
            if not (_ipv6(inner) or re.fullmatch(rf"v[0-9A-Fa-f]+\.(?:{_U}|{_SUB}|:)+", inner)):
                return False
        elif not re.fullmatch(f"(?:{_U}|{_PCT}|{_SUB})*", host):
            return False
        shape = f"(?:/{_PCHAR}*)*"
    else:
        shape = f"(?:/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?|{_PCHAR}+(?:/{_PCHAR}*)*)?"
    rest = f"(?:{_PCHAR}|[/?])*"
    return bool(
        re.fullmatch(shape, path)
        and all(p is None or re.fullmatch(rest, p[1:]) for p in (query, fragment))
    )


FORMATS: dict[str, tuple[Callable[[str], bool], list[str]]] = {
    "uri": (_uri, ["http://a", "http://[1:2:3:4:5:6:7:8:9]/", "http://[::1::2]/", "http://[1:2:3:4:5:6:7]/", "http://[v1.x]/", "http://h:port/", "http://a/%4", "http://a/%41", "mailto:x@y", "a:", "1a:b", "http://a b", "http://u@h:80/p?q#f", "http://[1:2:3:4:5:6::7:8]/", "http://a#b#c", "http://ä", "http:///a", "http://a@b@c", "http://[vg.x]/", "a:b/c//d"]),
    "ipv6": (_ipv6, ["::", "::1", "1::", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", "1:2:3:4:5:6:7::", "1:2:3:4:5:6::7:8", ":1:2:3:4:5:6:7", "::ffff:1.2.3.4", "fe80::1%eth0", "g::", "1:2:3:4:5:6:7::8"]),
    "duration": (lambda t: bool(re.fullmatch(f"P(?:{_DUR_DATE}(?:{_DUR_TIME})?|{_DUR_TIME}|[0-9]+W)", t)), ["P1D", "PT1H", "P1W", "P1Y2M3DT4H5M6S", "P", "PT", "P1DT", "P1H", "PT1D", "P1Y1D", "P1M1Y", "P1W1D", "PT1S1M", "P1.5D", "p1d"]),
    "email": (lambda t: bool(re.fullmatch(rf"{_ATEXT}+(?:\.{_ATEXT}+)*@(?:{_LABEL}(?:\.{_LABEL})*|\[{_OCTET}(?:\.{_OCTET}){{3}}\])", t)), ["a@b", "a.b@c", "a..b@c", ".a@b", "a.@b", "a@b.", "a@-b", "a@b-", "a@[1.2.3.4]", "a@[1.2.3.256]", '"a b"@c', "a@b..c", "@b", "a@", "a b@c", "a@b_c", 'a"b@c', "a@1.2.3.4"]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_formats_take_only_strings_their_rfc_allows(
    llg: Any, byte_token: dict[int, int], info: Any, walk: Any, name: str
) -> None:
    assert name in LLGUIDANCE_SUPPORT.formats
    reference, candidates = FORMATS[name]
    compiled = llg.compile(
        GrammarSpec("json_schema", json.dumps({"type": "string", "format": name}))
    )
    taken = [t for t in candidates if takes(llg.matcher(compiled), byte_token, json.dumps(t))]
    assert taken and all(map(reference, taken)), [t for t in taken if not reference(t)]
    for seed in range(3):
        result = walk(
            llg.matcher(compiled), info, seed, stop_bias=2.0, close_bias=1.0, max_steps=80
        )
        if result.terminated:
            assert reference(json.loads(result.text)), result.text


def _raw_llguidance_takes(
    llg: Any, tokenizer: Any, byte_token: dict[int, int], schema: Any, text: str
) -> bool:
    """llguidance's own grammar for `schema`, past our normalizer."""
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=llg.json_options())
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return takes(LLGuidanceMatcher(matcher, llg.tokenizer_info, llg.options, []), byte_token, text)


def test_what_stays_out_is_looser_on_llguidance(
    llg: Any, tokenizer: Any, byte_token: dict[int, int]
) -> None:
    # hostname: no bound on the length, "--" in third and fourth place is fine.
    hostname = {"type": "string", "format": "hostname"}
    assert _raw_llguidance_takes(
        llg, tokenizer, byte_token, hostname, json.dumps(".".join(["a" * 60] * 5))
    )
    assert _raw_llguidance_takes(llg, tokenizer, byte_token, hostname, '"ab--cd"')
    # minProperties: names of additionalProperties may repeat; a parser keeps one of them.
    at_least_two = {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "minProperties": 2,
    }
    assert _raw_llguidance_takes(llg, tokenizer, byte_token, at_least_two, '{"c":"x","c":"y"}')
    assert not validator(at_least_two).is_valid(json.loads('{"c":"x","c":"y"}'))
    assert {"minProperties", "unevaluatedProperties", "uniqueItems"}.isdisjoint(
        LLGUIDANCE_SUPPORT.keywords
    )
    assert "hostname" not in LLGUIDANCE_SUPPORT.formats


def test_the_auto_backend_finds_llguidances_table() -> None:
    assert support_of("llguidance") is LLGUIDANCE_SUPPORT
