"""GrammarService: strictness of the specs it compiles, the settings it reports and the
limit errors it explains (no model needed: the compiler is a stand-in)."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from radixlm.constrained import GrammarError, GrammarSpec
from radixlm.runtime.config import GrammarConfig
from radixlm.runtime.grammar import GrammarService
from radixlm.sampling import InvalidRequest, SamplingParams


class RecordingCompiler:
    def __init__(self) -> None:
        self.specs: list[GrammarSpec] = []

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        self.specs.append(spec)
        future: Future[Any] = Future()
        future.set_result(None)
        return future


def _service(**config: Any) -> tuple[GrammarService, RecordingCompiler]:
    service = GrammarService(GrammarConfig(**config), tokenizer=None, vocab_size=32)
    compiler = RecordingCompiler()
    service._get_compiler = lambda: compiler  # type: ignore[method-assign]
    return service, compiler


@pytest.mark.parametrize(
    ("server_strict", "request_strict", "strict"),
    [(False, None, False), (True, None, True), (True, False, False), (False, True, True)],
)
def test_a_requests_strict_constraint_overrides_the_servers_default(
    server_strict: bool, request_strict: bool | None, strict: bool
) -> None:
    service, compiler = _service(strict=server_strict)
    service.submit(SamplingParams(regex="a+", strict_constraint=request_strict))
    assert compiler.specs == [GrammarSpec("regex", "a+", strict=strict)]
    assert compiler.specs[0].strict is strict


def test_unconstrained_requests_compile_nothing() -> None:
    service, compiler = _service(strict=True)
    assert service.submit(SamplingParams(strict_constraint=True)) is None
    assert compiler.specs == []


def test_backend_none_refuses_a_constraint_naming_the_setting() -> None:
    service, _ = _service(backend="none")
    with pytest.raises(InvalidRequest, match="grammar_backend='none'"):
        service.submit(SamplingParams(regex="a+"))


def test_settings_report_backend_strictness_and_limits() -> None:
    service, _ = _service(backend="xgrammar", strict=True, max_constraint_bytes=1000)
    assert service.settings() == {
        "grammar_backend": "xgrammar",
        "strict_constraints": True,
        "max_constraint_bytes": 1000,
        "grammar_compile_timeout": 30.0,
        "json_schema_dir": None,
        "json_schema_documents": [],
    }


def test_a_constraint_over_the_size_limit_names_the_flag_that_raises_it() -> None:
    service, _ = _service()
    error = GrammarError(
        "the JSON schema is 5000 bytes, above the limit of 4096 bytes; simplify it or raise "
        "GrammarOptions.max_source_bytes",
        kind="json_schema",
        backend="auto",
    )
    explained = service.explain(error)
    assert isinstance(explained, GrammarError) and explained.field == "json_schema"
    assert "--max-constraint-bytes" in explained.message
    assert "GrammarOptions" not in explained.message
    assert "5000 bytes" in explained.message


def test_a_constraint_past_the_compile_time_limit_names_the_timeout_flag() -> None:
    service, _ = _service()
    error = GrammarError(
        "the regex constraint took longer than 30 s to compile; simplify it", kind="regex"
    )
    explained = service.explain(error)
    assert "--grammar-compile-timeout" in str(explained)
    assert str(explained).startswith("regex: the regex constraint took longer than 30 s")


def test_other_errors_are_left_as_they_are() -> None:
    service, _ = _service()
    error = GrammarError("the regex constraint does not compile", kind="regex")
    assert service.explain(error) is error
    crash = RuntimeError("boom")
    assert service.explain(crash) is crash


def test_documents_of_the_json_schema_dir_reach_the_grammar(tmp_path: Path) -> None:
    pytest.importorskip("xgrammar")
    from radixlm.runtime.fixtures import build_tiny_tokenizer

    schemas = tmp_path / "schemas"
    (schemas / "shapes").mkdir(parents=True)
    point = {
        "type": "object",
        "properties": {"x": {"type": "integer"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    (schemas / "shapes" / "point.json").write_text(json.dumps(point))
    tokenizer = build_tiny_tokenizer(tmp_path / "tokenizer")
    params = SamplingParams(json_schema=json.dumps({"$ref": "shapes/point.json"}))
    config = GrammarConfig(backend="xgrammar", schema_dir=str(schemas))
    service = GrammarService(config, tokenizer, vocab_size=len(tokenizer))
    bare = GrammarService(GrammarConfig(backend="xgrammar"), tokenizer, vocab_size=len(tokenizer))
    try:
        assert service.settings()["json_schema_documents"] == ["shapes/point.json"]
        future = service.submit(params)
        assert future is not None
        grammar = service.matcher(future.result(timeout=60))
        for token in tokenizer.encode('{"x":12}', add_special_tokens=False):
            assert grammar.accept_token(token)
        assert grammar.accept_token(tokenizer.eos_token_id) and grammar.is_terminated()
        # Without the directory the same constraint is a 400 saying how to ship the document.
        refused = bare.submit(params)
        assert refused is not None
        error = refused.exception(timeout=60)
        assert isinstance(error, GrammarError) and error.keyword == "$ref"
        assert "--json-schema-dir" in error.message
    finally:
        service.shutdown()
        bare.shutdown()


def test_a_json_schema_dir_with_a_file_that_is_not_json_fails_the_start(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json"):
        GrammarService(GrammarConfig(schema_dir=str(tmp_path)), tokenizer=None, vocab_size=32)
