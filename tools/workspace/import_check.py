"""Import every module of a package in its own environment (`hatch run alone.PKG:test` runs
this beside the package's fast tests):

    python tools/workspace/import_check.py PKG

A module that cannot be imported fails the check, unless what is missing belongs to one of
the package's optional extras that its environment does not install (those modules are
listed as skipped, with the extra that brings them). The quick tests then need not touch
every module for a missing declaration to show.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
from members import PACKAGES, canonical, pyproject


def _optional_requirements(name: str) -> dict[str, str]:
    """Canonical name of each requirement only an extra brings (not the test extra) -> extra."""
    project = pyproject(PACKAGES[name])["project"]
    core = {canonical(Requirement(line).name) for line in project.get("dependencies", [])}
    extras = project.get("optional-dependencies", {})
    tested = {canonical(Requirement(line).name) for line in extras.get("test", [])}
    found: dict[str, str] = {}
    for extra, lines in extras.items():
        for line in lines:
            requirement = canonical(Requirement(line).name)
            if requirement not in core and requirement not in tested:
                found.setdefault(requirement, extra)
    return found


def _extra_of(missing: str, optional: dict[str, str]) -> str | None:
    """The extra whose requirement provides the module `missing` (by name: `jsonschema_rs`
    is `jsonschema-rs`, `opentelemetry` comes with `opentelemetry-sdk`)."""
    top = canonical(missing.split(".")[0])
    for requirement, extra in optional.items():
        if requirement == top or requirement.startswith(top + "-"):
            return extra
    return None


def main(name: str) -> int:
    root = importlib.import_module(f"radixlm.{name}")
    optional = _optional_requirements(name)
    failed, skipped, imported = [], [], 0
    for module in pkgutil.walk_packages(root.__path__, prefix=f"radixlm.{name}."):
        if re.search(r"\.(tests?|conftest|__main__)(\.|$)", module.name):
            continue
        try:
            importlib.import_module(module.name)
            imported += 1
        except ModuleNotFoundError as error:
            extra = _extra_of(error.name or "", optional)
            if extra is None:
                failed.append(f"{module.name}: {error}")
            else:
                skipped.append(f"{module.name} (needs the {extra!r} extra: {error.name})")
        except Exception as error:  # any failure to import is reported
            failed.append(f"{module.name}: {type(error).__name__}: {error}")
    print(f"[{name}] imported {imported + 1} modules of radixlm.{name}")
    for line in skipped:
        print(f"[{name}] skipped {line}")
    for line in failed:
        print(f"[{name}] FAILED to import {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PACKAGES:
        sys.exit(f"usage: import_check.py {{{','.join(PACKAGES)}}}")
    sys.exit(main(sys.argv[1]))
