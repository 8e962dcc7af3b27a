"""The backend registry: lazy imports, availability, errors that say what to install."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from radixlm.constrained import (
    GrammarOptions,
    GrammarSpec,
    available_backends,
    create_backend,
    register_backend,
    registered_backends,
)


def test_both_backends_are_available_here() -> None:
    assert set(available_backends()) >= {"xgrammar", "outlines"}


def test_unknown_backend_lists_the_registered_ones(info: Any) -> None:
    with pytest.raises(ValueError, match="xgrammar"):
        create_backend("llguidance-typo", info)


def test_backends_advertise_their_kinds(backends: dict[str, Any]) -> None:
    assert backends["xgrammar"].supported_kinds == {
        "json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object"
    }  # fmt: skip
    assert backends["outlines"].supported_kinds == {"json_schema", "regex", "choice", "json_object"}


def test_a_registered_factory_is_used(info: Any, backends: dict[str, Any]) -> None:
    made: list[GrammarOptions] = []

    def factory(tokenizer_info: Any, options: GrammarOptions) -> Any:
        made.append(options)
        return backends["xgrammar"]

    register_backend("custom-test", factory)
    assert "custom-test" in registered_backends()
    assert create_backend("custom-test", info) is backends["xgrammar"]
    assert made == [GrammarOptions()]


def test_a_backend_with_a_missing_package_names_the_extra(info: Any) -> None:
    register_backend(
        "needs-missing", lambda i, o: None, requires=("no_such_module_xyz",), extra="x"
    )
    from radixlm.constrained import BackendUnavailable

    with pytest.raises(BackendUnavailable, match=r"radixlm-constrained\[x\]"):
        create_backend("needs-missing", info)


BLOCKED = ("xgrammar", "outlines_core", "torch", "transformers", "tokenizers", "numpy")
WITHOUT_EXTRAS = textwrap.dedent(
    f"""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(name)
            return None
    sys.meta_path.insert(0, Block())
    import json
    import radixlm.constrained as rc
    spec = rc.GrammarSpec("json_schema", {{"type": "integer"}})
    info = rc.TokenizerInfo.from_vocab(["0", "1"], stop_token_ids=[1])
    try:
        rc.create_backend("xgrammar", info)
        failure = None
    except rc.BackendUnavailable as error:
        failure = str(error)
    print(json.dumps({{"available": rc.available_backends(), "failure": failure,
                      "loaded": sorted(m for m in {BLOCKED!r} if m in sys.modules)}}))
    """
)


def test_core_imports_without_any_backend_and_says_none_is_available() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["available"] == []
    assert report["loaded"] == []
    assert "pip install 'radixlm-constrained[xgrammar]'" in report["failure"]


def test_spec_from_a_backend_free_import_compiles_later(backends: dict[str, Any]) -> None:
    spec = GrammarSpec("regex", "[0-9]+")
    assert backends["outlines"].compile(spec).spec == spec
