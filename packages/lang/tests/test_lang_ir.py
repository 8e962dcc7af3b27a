"""The program representation stands alone; the choices methods decide as documented."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import radixlm.lang as sgl
from radixlm.lang.choices import ChoicesMethod
from radixlm.lang.ir import ConstantText, ExprList, Gen, RoleBegin, RoleEnd, Select

INTERPRETER = {
    "radixlm.lang.executor",
    "radixlm.lang.state",
    "radixlm.lang.program",
    "radixlm.lang.api",
    "radixlm.lang.tracing",
    "radixlm.lang.speculative",
}


def _imports(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_expressions_concatenate_into_a_flat_list():
    expr = sgl.user("Hi " + sgl.gen("name", 4)) + "!"
    assert isinstance(expr, ExprList)
    kinds = [type(item) for item in expr.items]
    assert kinds == [RoleBegin, ConstantText, Gen, RoleEnd, ConstantText]


def test_gen_keeps_only_the_values_it_sets():
    expr = sgl.gen("x", 8, stop="\n", temperature=0.0)
    assert isinstance(expr, Gen)
    assert dict(expr.sampling) == {"max_new_tokens": 8, "stop": "\n", "temperature": 0.0}


def test_gen_accepts_a_pydantic_model_as_json_schema():
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str

    expr = sgl.gen("city", json_schema=City)
    assert isinstance(expr, Gen) and '"name"' in expr.sampling["json_schema"]


def test_expressions_describe_themselves_for_errors():
    assert sgl.gen("answer").describe() == "gen('answer')"
    assert sgl.select("x", ["a", "b"]).describe() == "select('x', choices=['a', 'b'])"
    assert sgl.user_begin().describe() == "user_begin()"


@pytest.mark.parametrize(
    "module", ["radixlm.lang.ir", "radixlm.lang.choices", "radixlm.lang.chat_template"]
)
def test_the_representation_does_not_import_the_interpreter_or_backends(module):
    imported = _imports(module)
    assert not imported & INTERPRETER
    assert not any(name.startswith("radixlm.lang.backends") for name in imported)


@pytest.mark.parametrize(
    "module",
    [
        "radixlm.lang.backends.base",
        "radixlm.lang.backends.native",
        "radixlm.lang.backends.runtime_endpoint",
        "radixlm.lang.backends.engine",
        "radixlm.lang.backends.openai",
    ],
)
def test_backends_do_not_import_the_interpreter(module):
    assert not _imports(module) & INTERPRETER


def test_the_engine_backend_is_the_only_module_naming_the_runtime():
    root = Path(importlib.util.find_spec("radixlm.lang").origin).parent  # type: ignore[union-attr,arg-type]
    naming = sorted(
        str(p.relative_to(root)) for p in root.rglob("*.py") if "radixlm.runtime" in p.read_text()
    )
    assert naming == ["backends/engine.py"]


def _entries(*values: float) -> list[list[object]]:
    return [[v, i, f"t{i}"] for i, v in enumerate(values)]


def _decide(method: ChoicesMethod, inputs, unconditional=None):
    from radixlm.lang.choices import normalized_logprob

    return method(
        choices=["short", "long"],
        normalized_prompt_logprobs=[normalized_logprob(e) for e in inputs],
        input_token_logprobs=inputs,
        output_token_logprobs=[[], []],
        unconditional_token_logprobs=unconditional,
    )


def test_token_length_normalized_picks_the_best_mean():
    decision = _decide(sgl.token_length_normalized, [_entries(-1.0), _entries(-0.2, -1.0)])
    assert decision.decision == "long"
    assert decision.meta_info["normalized_prompt_logprobs"] == [-1.0, -0.6]


def test_greedy_token_selection_decides_at_the_first_differing_token():
    decision = _decide(sgl.greedy_token_selection, [_entries(-0.1, -5.0), _entries(-0.2, -0.1)])
    assert decision.decision == "short"
    assert decision.meta_info["greedy_logprob_matrix"] == [[-0.1, -5.0], [-0.2, -0.1]]


def test_greedy_token_selection_pads_a_shorter_choice_with_its_mean():
    decision = _decide(sgl.greedy_token_selection, [_entries(-0.5), _entries(-0.5, -0.4)])
    assert decision.decision == "long"


def test_unconditional_likelihood_normalized_prefers_what_the_prompt_made_likely():
    inputs = [_entries(-1.0), _entries(-1.0)]
    alone = [_entries(-3.0), _entries(-0.5)]
    decision = _decide(sgl.unconditional_likelihood_normalized, inputs, alone)
    assert decision.decision == "short"
    assert decision.meta_info["normalized_unconditional_prompt_logprobs"] == [2.0, -0.5]


def test_unconditional_likelihood_normalized_needs_the_unconditional_scores():
    with pytest.raises(ValueError, match="alone"):
        _decide(sgl.unconditional_likelihood_normalized, [_entries(-1.0), _entries(-1.0)])


def test_select_builds_a_select_node():
    node = sgl.select("x", ["a", "b"], choices_method=sgl.greedy_token_selection)
    assert isinstance(node, Select) and node.choices == ("a", "b")
