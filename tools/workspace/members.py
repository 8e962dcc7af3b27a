"""The workspace's packages: where each lives and what its pyproject.toml declares.

Shared by the scripts in this folder; the standard library only (tomli on Python 3.10).
"""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10 (pytest brings tomli there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# Package name -> folder, in dependency order (leaves first).
PACKAGES: dict[str, Path] = {
    "sampling": ROOT / "packages" / "sampling",
    "cache": ROOT / "packages" / "cache",
    "kernels": ROOT / "kernels",
    "constrained": ROOT / "packages" / "constrained",
    "runtime": ROOT / "packages" / "runtime",
    "server": ROOT / "packages" / "server",
    "lang": ROOT / "packages" / "lang",
    "router": ROOT / "packages" / "router",
}


def canonical(name: str) -> str:
    """A distribution name as PEP 503 normalises it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject(folder: Path) -> dict:  # type: ignore[type-arg]
    return tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))


def declared_requirements(folder: Path) -> list[str]:
    """The requirement lines of the project in `folder`: its dependencies and every extra's."""
    project = pyproject(folder)["project"]
    lines = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    return lines
