"""The import contracts (pyproject's [tool.importlinter]) hold, and fail when the graph breaks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")


def _lint(extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True
    )


def _sampling_copy(tmp_path: Path) -> Path:
    # A regular package found first on PYTHONPATH shadows the installed one inside the namespace.
    target = tmp_path / "radixlm" / "sampling"
    shutil.copytree(ROOT / "packages/sampling/src/radixlm/sampling", target)
    return target


def test_the_repository_keeps_every_contract(tmp_path: Path) -> None:
    _sampling_copy(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_forbidden_import_breaks_the_contract(tmp_path: Path) -> None:
    target = _sampling_copy(tmp_path)
    (target / "_forbidden.py").write_text("import radixlm.cache\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "radixlm.sampling._forbidden -> radixlm.cache" in result.stdout


# import-linter cannot tell a lazy import from a module-level one; the two modules allowed to
# reach the runtime must do so only inside functions, so importing them never pulls torch in.
LAZY_RUNTIME_IMPORTERS = [
    ROOT / "packages/server/src/radixlm/server/launcher.py",
    ROOT / "packages/lang/src/radixlm/lang/backends/engine.py",
]


def _module_level_runtime_imports(path: Path) -> list[int]:
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside_functions = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    lines = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n.startswith("radixlm.runtime") for n in names) and id(node) not in inside_functions:
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", LAZY_RUNTIME_IMPORTERS, ids=lambda p: p.name)
def test_runtime_is_imported_only_lazily(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path.name} not written yet")
    assert _module_level_runtime_imports(path) == []
