"""Hostile or oversized constraints against the real engine: each is refused with a 400 that
says what to change (or, when it is a valid constraint, served within bounded time), the server
stays healthy, and a normal request sent at the same time completes with its usual output.
Also: strict_constraint, and meta_info["grammar"] of a constrained request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
NORMAL = {"text": "the radix tree", "sampling_params": GREEDY}
REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 4}
HUGE_ENUM = {"enum": [f"value-{i}" for i in range(50_000)]}
SMALL_LIMIT = 4096  # bytes: --max-constraint-bytes of the `limited` server
COMPILE_TIMEOUT = 1.0  # seconds: --grammar-compile-timeout of the `slow_compiles` server
BOUND_S = 60.0  # every reply, even to a constraint that is slow to compile, comes within it


def _generate(params: dict[str, Any], text: str = "x") -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": 8, **params}}


def _schema(schema: Any, **extra: Any) -> dict[str, Any]:
    return _generate({"json_schema": json.dumps(schema), **extra})


# (label, /generate body): each must be refused with a 400.
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("malformed JSON schema", _generate({"json_schema": '{"type": "object",'})),
    ("not JSON Schema: properties is a number", _schema({"type": "object", "properties": 5})),
    ("not JSON Schema: minLength is a string", _schema({"type": "string", "minLength": "x"})),
    ("invalid regex: unclosed group", _generate({"regex": "(ab"})),
    ("invalid regex: bounds reversed", _generate({"regex": "a{2,1}"})),
    ("invalid EBNF: unterminated string", _generate({"ebnf": 'root ::= "a'})),
    ("invalid EBNF: unknown rule", _generate({"ebnf": "root ::= missing"})),
]
# Valid constraints that are pathological for some regex engines: a 200 or a 400, in bounded
# time, and never a 500.
PATHOLOGICAL: list[tuple[str, dict[str, Any]]] = [
    ("nested alternation", _generate({"regex": "((a|aa)*(b|bb)*)*c"})),
    ("nested pluses", _generate({"regex": "(x+x+)+y"})),
    ("a million repetitions", _generate({"regex": "a{1000}{1000}"})),
]


@pytest.fixture(scope="module")
def limited(serve: Callable[..., Any]) -> Any:
    """A server with a small constraint size limit whose requests are strict by default."""
    return serve(max_constraint_bytes=SMALL_LIMIT, strict_constraints=True)


@pytest.fixture
def limited_http(limited: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited.url, timeout=BOUND_S) as client:
        yield client


@pytest.fixture(scope="module")
def normal_output(server: Any) -> list[int]:
    with httpx.Client(base_url=server.url, timeout=BOUND_S) as client:
        return list(client.post("/generate", json=NORMAL).json()["output_ids"])


class Alongside:
    """A normal request sent from another thread while the hostile one is served."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=BOUND_S) as client:
            response = client.post("/generate", json=NORMAL)
            self.result = {"status": response.status_code, "body": response.json()}

    def __enter__(self) -> Alongside:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(BOUND_S)

    def output_ids(self) -> list[int]:
        assert self.result.get("status") == 200, self.result
        return list(self.result["body"]["output_ids"])


def _refused(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def _healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200


@pytest.mark.parametrize(("label", "body"), REFUSED, ids=[label for label, _ in REFUSED])
def test_bad_constraint_is_a_400_and_a_concurrent_request_completes(
    http: httpx.Client, server: Any, normal_output: list[int], label: str, body: dict[str, Any]
) -> None:
    with Alongside(server.url) as other:
        _refused(http.post("/generate", json=body))
    assert other.output_ids() == normal_output
    _healthy(http)
    server.assert_no_leaks()


def test_schema_whose_ref_points_to_itself_is_a_400(http: httpx.Client, server: Any) -> None:
    _refused(http.post("/generate", json=_schema(REF_CYCLE)))
    _healthy(http)
    server.assert_no_leaks()


def test_schema_with_a_ref_cycle_never_hangs_nor_breaks_the_server(
    http: httpx.Client, server: Any, normal_output: list[int]
) -> None:
    with Alongside(server.url) as other:
        started = time.monotonic()
        response = http.post("/generate", json=_schema(REF_CYCLE))
        assert time.monotonic() - started < BOUND_S
    assert response.status_code in (200, 400), response.text
    assert other.output_ids() == normal_output
    _healthy(http)
    server.assert_no_leaks()


@pytest.mark.parametrize(("label", "body"), PATHOLOGICAL, ids=[label for label, _ in PATHOLOGICAL])
def test_pathological_regex_is_served_or_refused_in_bounded_time(
    http: httpx.Client, server: Any, normal_output: list[int], label: str, body: dict[str, Any]
) -> None:
    with Alongside(server.url) as other:
        started = time.monotonic()
        response = http.post("/generate", json=body)
        assert time.monotonic() - started < BOUND_S
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200:
        assert response.json()["meta_info"]["finish_reason"] is not None
    assert other.output_ids() == normal_output
    _healthy(http)
    server.assert_no_leaks()


def test_constraint_above_the_size_limit_is_a_400_naming_the_flag(
    limited_http: httpx.Client, limited: Any
) -> None:
    big = {"enum": [f"value-{i}" for i in range(SMALL_LIMIT // 8)]}
    for body in (
        _schema(big, strict_constraint=False),
        _generate({"regex": "(" + "|".join(f"word{i}" for i in range(SMALL_LIMIT // 5)) + ")"}),
        _generate({"choice": [f"choice number {i}" for i in range(SMALL_LIMIT // 10)]}),
    ):
        error = _refused(limited_http.post("/generate", json=body))
        assert "--max-constraint-bytes" in error["message"], error
        assert str(SMALL_LIMIT) in error["message"], error
    _healthy(limited_http)
    limited.assert_no_leaks()


def test_huge_enum_over_the_size_limit_is_refused_before_compiling(
    limited_http: httpx.Client, limited: Any
) -> None:
    started = time.monotonic()
    error = _refused(
        limited_http.post("/generate", json=_schema(HUGE_ENUM, strict_constraint=False))
    )
    assert "--max-constraint-bytes" in error["message"], error
    assert time.monotonic() - started < 10  # refused on its size, not compiled first
    _healthy(limited_http)


@pytest.fixture(scope="module")
def slow_compiles(serve: Callable[..., Any]) -> Any:
    """A server whose compile timeout is short and size limit the default."""
    return serve(grammar_compile_timeout=COMPILE_TIMEOUT)


def test_huge_enum_is_refused_at_the_compile_timeout_and_others_are_served(
    slow_compiles: Any,
) -> None:
    with httpx.Client(base_url=slow_compiles.url, timeout=BOUND_S) as http:
        expected = http.post("/generate", json=NORMAL).json()["output_ids"]
        with Alongside(slow_compiles.url) as other:
            started = time.monotonic()
            response = http.post("/generate", json=_schema(HUGE_ENUM))
            elapsed = time.monotonic() - started
        if response.status_code == 200:  # a machine fast enough to compile it in time
            out = response.json()
            if out["meta_info"]["finish_reason"]["type"] == "stop":
                assert json.loads(out["text"]) in HUGE_ENUM["enum"]
        else:
            error = _refused(response)
            assert "--grammar-compile-timeout" in error["message"], error
            assert elapsed < COMPILE_TIMEOUT + 10
        assert other.output_ids() == expected
        _healthy(http)
    slow_compiles.assert_no_leaks()


def test_strict_request_refuses_a_keyword_the_grammar_cannot_enforce(
    http: httpx.Client, server: Any
) -> None:
    error = _refused(http.post("/generate", json=_schema(UNIQUE, strict_constraint=True)))
    assert "uniqueItems" in error["message"], error
    _healthy(http)
    server.assert_no_leaks()


def test_strict_server_default_refuses_it_unless_the_request_opts_out(
    limited_http: httpx.Client, limited: Any
) -> None:
    error = _refused(limited_http.post("/generate", json=_schema(UNIQUE)))
    assert "uniqueItems" in error["message"], error
    reply = limited_http.post("/generate", json=_schema(UNIQUE, strict_constraint=False))
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["grammar"]["validated"] == ["uniqueItems"]
    limited.assert_no_leaks()


def test_strict_constraint_reaches_the_engine_from_the_openai_routes(
    http: httpx.Client,
) -> None:
    body = {
        "messages": [{"role": "user", "content": "numbers"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": UNIQUE}},
        "strict_constraint": True,
    }
    assert "uniqueItems" in _refused(http.post("/v1/chat/completions", json=body))["message"]
    body = {"prompt": "x", "max_tokens": 8, "json_schema": UNIQUE, "strict_constraint": True}
    assert "uniqueItems" in _refused(http.post("/v1/completions", json=body))["message"]


def test_validated_keyword_is_enforced_and_reported_in_meta_info(
    http: httpx.Client, server: Any
) -> None:
    params = {"temperature": 1.0, "seed": 5, "max_new_tokens": 48}
    reply = http.post("/generate", json=_schema(UNIQUE, **params))
    assert reply.status_code == 200, reply.text
    out = reply.json()
    grammar = out["meta_info"]["grammar"]
    assert grammar["validated"] == ["uniqueItems"]
    assert grammar["backend"] in ("xgrammar", "llguidance", "outlines")
    assert isinstance(grammar["rollbacks"], int) and grammar["rollbacks"] >= 0
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        value = json.loads(out["text"])
        assert len(value) == len(set(value)) <= 4
    server.assert_no_leaks()


def test_json_schema_request_reports_the_backend_that_served_it(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = http.post("/generate", json=_schema(schema)).json()
    grammar = out["meta_info"]["grammar"]
    assert grammar["backend"] in ("xgrammar", "llguidance", "outlines")
    assert grammar["validated"] == [] and grammar["rollbacks"] == 0
    streamed = [
        json.loads(line[len("data: ") :])
        for line in http.post("/generate", json={**_schema(schema), "stream": True}).text.split(
            "\n"
        )
        if line.startswith("data: {")
    ]
    assert streamed and all("grammar" in chunk["meta_info"] for chunk in streamed)
    assert "grammar" not in http.post("/generate", json=NORMAL).json()["meta_info"]


def test_server_info_reports_the_grammar_settings(http: httpx.Client, limited: Any) -> None:
    info = http.get("/get_server_info").json()
    assert (info["grammar_backend"], info["strict_constraints"]) == ("auto", False)
    assert info["max_constraint_bytes"] == 8 * 1024 * 1024
    limited_info = httpx.get(f"{limited.url}/get_server_info", timeout=BOUND_S).json()
    assert limited_info["strict_constraints"] is True
    assert limited_info["max_constraint_bytes"] == SMALL_LIMIT


def test_cli_offers_the_runtimes_grammar_backends() -> None:
    from radixlm.runtime.config import GRAMMAR_BACKENDS
    from radixlm.server.cli import build_parser

    for name in GRAMMAR_BACKENDS:
        assert build_parser().parse_args(["--grammar-backend", name]).grammar_backend == name


def test_cli_offers_the_runtimes_quantization_methods_and_kv_dtypes() -> None:
    from radixlm.runtime.config import ENGINE_CHOICES, QUANTIZATION_METHODS
    from radixlm.runtime.quant import QUANTIZATION_METHODS as RUNTIME_METHODS
    from radixlm.server import cli

    assert QUANTIZATION_METHODS == RUNTIME_METHODS
    parser = cli.build_parser()
    offered = {a.dest: tuple(a.choices) for a in parser._actions if a.choices is not None}
    for keyword in ENGINE_CHOICES.keys() & cli.ENGINE_FLAGS.keys():
        assert offered[keyword] == ENGINE_CHOICES[keyword], keyword
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule-policy", "longest"])
    args = cli.build_parser().parse_args(["--quantization", "int4", "--kv-cache-dtype", "fp8_e4m3"])
    assert (args.quantization, args.kv_cache_dtype) == ("int4", "fp8_e4m3")
