"""Prove a package stands alone: install its wheel in a fresh venv, check what came with it, test it.

Used by `python3 tools/dev.py isolate [PKG ...]`, which builds the wheels first. For each package:
a new venv gets the package's wheel (and the wheels of the radixlm packages it declares, nothing
else of ours), resolved under constraints.txt; the distributions that arrived are listed and, for
packages with a promise about their footprint, checked; then pytest, hypothesis and the package's
`test` extra are added and the package's tests run against the installed wheel (not the source).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"]
# What installing the package alone may bring (beyond itself and its radixlm dependencies).
FOOTPRINT: dict[str, set[str]] = {
    "sampling": {
        "pydantic",
        "pydantic-core",
        "typing-extensions",
        "annotated-types",
        "typing-inspection",
    },
    "cache": set(),
    # Torch-free: the cache and the request types (pydantic), nothing else.
    "router": {
        "pydantic",
        "pydantic-core",
        "typing-extensions",
        "annotated-types",
        "typing-inspection",
    },
}
PACKAGING_TOOLS = {"pip", "setuptools", "wheel"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def internal_dependencies(folder: Path, folders: dict[str, Path]) -> list[str]:
    """The radixlm packages `folder` depends on, transitively, by short name."""
    text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)
    names = re.findall(r'"radixlm-([a-z]+)', block.group(1)) if block else []
    found: list[str] = []
    for name in names:
        for dep in [*internal_dependencies(folders[name], folders), name]:
            if dep not in found:
                found.append(dep)
    return found


def _wheel(wheels: Path, name: str) -> Path:
    matches = sorted(wheels.glob(f"radixlm_{name}-*.whl"))
    if not matches:
        raise FileNotFoundError(f"no wheel for radixlm-{name} in {wheels}")
    return matches[-1]


def _call(cmd: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], text=True, **kwargs)  # type: ignore[call-overload]


def isolate(name: str, folders: dict[str, Path], wheels: Path, keep: bool = False) -> bool:
    """Install radixlm-`name` alone in a fresh venv and run its tests there; True when all held."""
    folder = folders[name]
    env_dir = ROOT / ".isolation" / name
    shutil.rmtree(env_dir, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", CONSTRAINTS]
    try:
        ours = [_wheel(wheels, dep) for dep in internal_dependencies(folder, folders)]
        if _call([*pip, *ours, _wheel(wheels, name)]).returncode != 0:
            print(f"[{name}] FAILED: the wheel does not install alone")
            return False
        listed = _call([python, "-m", "pip", "list", "--format=json"], capture_output=True)
        installed = {_canonical(d["name"]) for d in json.loads(listed.stdout)} - PACKAGING_TOOLS
        third_party = sorted(d for d in installed if not d.startswith("radixlm-"))
        print(
            f"[{name}] installing radixlm-{name} alone brought: {', '.join(third_party) or 'nothing else'}"
        )
        if name in FOOTPRINT and not set(third_party) <= FOOTPRINT[name]:
            extra = sorted(set(third_party) - FOOTPRINT[name])
            print(f"[{name}] FAILED: unexpected dependencies {extra}")
            return False
        where = _call(
            [python, "-c", f"import radixlm.{name} as m; print(list(m.__path__)[0])"],
            capture_output=True,
        )
        if where.returncode != 0 or str(env_dir) not in where.stdout:
            print(
                f"[{name}] FAILED: radixlm.{name} does not import from the venv: {where.stdout}{where.stderr}"
            )
            return False
        test_spec = f"{_wheel(wheels, name)}[test]"
        if _call([*pip, *TEST_TOOLS, *ours, test_spec]).returncode != 0:
            print(f"[{name}] FAILED: test dependencies do not install")
            return False
        tests = _call(
            [python, "-m", "pytest", folder / "tests", "-q", "-p", "no:cacheprovider"],
            cwd=ROOT,
            env={
                "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin",
                "HF_HUB_OFFLINE": "1",
                "HOME": str(Path.home()),
            },
        )
        if tests.returncode not in (0, 5) or (tests.returncode == 5 and _has_code(folder, name)):
            print(f"[{name}] FAILED: tests failed in isolation (exit {tests.returncode})")
            return False
        print(f"[{name}] ok in isolation")
        return True
    finally:
        if not keep:
            shutil.rmtree(env_dir, ignore_errors=True)


def _has_code(folder: Path, name: str) -> bool:
    src = folder / "src" / "radixlm" / name
    return any(p.name != "_version.py" for p in src.rglob("*.py"))


if __name__ == "__main__":
    sys.exit("run it through: python3 tools/dev.py isolate [PKG ...]")
