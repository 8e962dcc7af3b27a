"""The schema corpora on every backend: 99 real-world schemas shipped inside PyPI packages
(tests/data/real_schemas, with their licences) and 129 generated schemas exercising every
keyword (tests/data/keyword_schemas.json). Each schema compiles, or is refused with an error
naming the keyword (or the limit) at fault; every random walk that finishes validates against
the whole schema with jsonschema's validator for its draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixlm.constrained import GrammarCompiler, GrammarError, GrammarSpec, create_backend

DATA = Path(__file__).parent / "data"
REAL = DATA / "real_schemas"
MANIFEST = json.loads((REAL / "MANIFEST.json").read_text(encoding="utf-8"))
KEYWORDS = json.loads((DATA / "keyword_schemas.json").read_text(encoding="utf-8"))
BACKENDS = ("xgrammar", "llguidance", "outlines", "auto")
SCHEMAS: dict[str, str] = {
    f"real/{item['file']}": (REAL / item["file"]).read_text(encoding="utf-8") for item in MANIFEST
}
SCHEMAS.update({f"keyword/{item['name']}": json.dumps(item["schema"]) for item in KEYWORDS})
WALKS = {"auto": 3}  # seeds per compiled schema (named backends: 2)


class Outcomes:
    """Compilations, each done once per session (compiled grammar or the GrammarError)."""

    def __init__(self, info: Any) -> None:
        self.compilers = {
            name: GrammarCompiler(create_backend(name, info), time_limit_s=20) for name in BACKENDS
        }
        self.results: dict[tuple[str, str], Any] = {}

    def get(self, backend: str, name: str) -> Any:
        key = (backend, name)
        if key not in self.results:
            try:
                self.results[key] = self.compilers[backend].compile(
                    GrammarSpec("json_schema", SCHEMAS[name])
                )
            except GrammarError as error:
                self.results[key] = error
        return self.results[key]


@pytest.fixture(scope="module")
def outcomes(info: Any) -> Any:
    found = Outcomes(info)
    yield found
    for compiler in found.compilers.values():
        compiler.shutdown()


def test_the_real_corpus_holds_forty_schemas_with_their_licences() -> None:
    assert len(MANIFEST) >= 40
    packages = {item["package"] for item in MANIFEST}
    assert len(packages) >= 10
    for item in MANIFEST:
        assert (REAL / item["file"]).is_file()
        assert item["license"]
        assert (REAL / "LICENSES" / f"{item['package']}.txt").is_file(), item["package"]


def test_the_keyword_corpus_covers_every_keyword_no_grammar_enforces() -> None:
    covered = {item["keyword"] for item in KEYWORDS}
    needed = {
        "uniqueItems", "oneOf", "if", "not", "dependentRequired", "dependentSchemas",
        "dependencies", "contains", "minContains", "maxContains", "propertyNames",
        "patternProperties", "format-unknown", "unevaluatedProperties", "unevaluatedItems",
    }  # fmt: skip
    assert needed <= covered, needed - covered


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_each_schema_is_refused_naming_what_to_change_or_every_finished_walk_validates(
    outcomes: Any, backend: str, name: str, info: Any, vwalk: Any, check_schema_of: Any
) -> None:
    compiled = outcomes.get(backend, name)
    if isinstance(compiled, GrammarError):
        assert compiled.keyword or compiled.limit, compiled.message
        if compiled.keyword:
            assert compiled.keyword in compiled.message
        return
    schema = json.loads(SCHEMAS[name])
    check = check_schema_of(schema)
    matcher = outcomes.compilers[backend].backend.matcher
    for seed in range(WALKS.get(backend, 2)):
        text, _ = vwalk(matcher(compiled), info, seed)
        if text is None:
            continue
        errors = [e.message for e in check.iter_errors(json.loads(text))]
        assert not errors, f"{text!r}: {errors}"


@pytest.mark.parametrize("corpus", ["real", "keyword"])
def test_auto_compiles_everything_a_single_backend_does_and_more(
    outcomes: Any, corpus: str
) -> None:
    names = [n for n in SCHEMAS if n.startswith(corpus + "/")]
    compiled = {
        backend: {n for n in names if not isinstance(outcomes.get(backend, n), GrammarError)}
        for backend in BACKENDS
    }
    for backend in ("xgrammar", "llguidance", "outlines"):
        assert compiled[backend] <= compiled["auto"], compiled[backend] - compiled["auto"]
        assert len(compiled["auto"]) > len(compiled[backend])
    share = len(compiled["auto"]) / len(names)
    # Real schemas auto refuses: references to other files (not the metaschemas, which are
    # bundled), draft-3 schemas in `type`.
    assert share >= (0.9 if corpus == "real" else 1.0), sorted(set(names) - compiled["auto"])
