"""Check a package's own environment (`hatch run alone.PKG:test` runs this first).

    python tools/workspace/footprint.py PKG

In the environment of radixlm-PKG alone it checks that:
- `radixlm.PKG` imports from the environment (the installed wheel), not from the checkout;
- every radixlm package installed holds exactly the files of its folder in the checkout, so the
  wheel leaves nothing out and the environment is not older than the tree (after a change,
  `hatch env remove alone.PKG` makes it anew);
- the only radixlm distributions installed are the ones radixlm-PKG[test] requires, directly or
  through others: nothing of the workspace came in undeclared;
- for packages that promise a small footprint, what installing the package brings (its
  requirements without the `test` extra, followed through) stays within the promise.
It prints what the package brought either way.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
from members import PACKAGES, canonical, declared_requirements

PYDANTIC = {
    "pydantic",
    "pydantic-core",
    "typing-extensions",
    "annotated-types",
    "typing-inspection",
}
# What installing the package alone may bring, beyond itself and its radixlm dependencies.
FOOTPRINT: dict[str, set[str]] = {
    "sampling": PYDANTIC,
    "cache": set(),
    # Torch-free: the cache and the request types (pydantic), nothing else.
    "router": PYDANTIC,
}


def closure(name: str, extras: set[str]) -> set[str]:
    """The distributions `name[extras]` requires, followed through what is installed."""
    found: set[str] = set()
    pending = [(canonical(name), frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        dist_name, dist_extras = pending.pop()
        if (dist_name, dist_extras) in seen:
            continue
        seen.add((dist_name, dist_extras))
        found.add(dist_name)
        try:
            requires = metadata.requires(dist_name) or []
        except metadata.PackageNotFoundError:
            sys.exit(f"{dist_name} is required but not installed")
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": e} for e in dist_extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                pending.append((canonical(req.name), frozenset(req.extras)))
    return found


def requirement_key(line: str) -> str:
    """A requirement without its marker, spelled one way (extras sorted, name canonical)."""
    req = Requirement(line)
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{canonical(req.name)}{extras}{req.specifier}"


def differences(dist_name: str) -> list[str]:
    """How the installed radixlm-X differs from the checkout: its files and its requirements."""
    short = dist_name.removeprefix("radixlm-")
    folder = PACKAGES[short]
    declared = {requirement_key(line) for line in declared_requirements(folder)}
    recorded = {requirement_key(line) for line in metadata.requires(dist_name) or []}
    found = [
        f"requirement not in the checkout's pyproject.toml: {r}"
        for r in sorted(recorded - declared)
    ]
    found += [f"requirement the install lacks: {r}" for r in sorted(declared - recorded)]
    source = folder / "src" / "radixlm" / short
    wanted = {
        p.relative_to(source).as_posix(): p
        for p in source.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    dist = metadata.distribution(dist_name)
    prefix = f"radixlm/{short}/"
    installed = {
        f.as_posix().removeprefix(prefix): Path(str(dist.locate_file(f)))
        for f in dist.files or []
        if f.as_posix().startswith(prefix) and "__pycache__" not in f.parts
    }
    found += [
        f"missing from the install: {name}" for name in sorted(wanted.keys() - installed.keys())
    ]
    found += [f"not in the checkout: {name}" for name in sorted(installed.keys() - wanted.keys())]
    found += [
        f"differs from the checkout: {name}"
        for name in sorted(wanted.keys() & installed.keys())
        if wanted[name].read_bytes() != installed[name].read_bytes()
    ]
    return found


def main(package: str) -> int:
    dist = f"radixlm-{package}"
    installed = {canonical(d.metadata["Name"]) for d in metadata.distributions()}
    for name in sorted(d for d in installed if d.startswith("radixlm-")):
        found = differences(name)
        if found:
            print(f"[{package}] FAILED: {name} as installed is not the checkout's:")
            print("\n".join(f"  {line}" for line in found[:10]))
            print(f"  (after a change: `hatch env remove alone.{package}`, then run again)")
            return 1
    module = importlib.import_module(f"radixlm.{package}")
    where = Path(next(iter(module.__path__))).resolve()
    if PACKAGES[package] in where.parents:
        print(f"[{package}] FAILED: radixlm.{package} imports from the checkout ({where})")
        return 1
    with_tests = closure(dist, {"test"})
    stray = sorted(d for d in installed if d.startswith("radixlm") and d not in with_tests)
    if stray:
        print(f"[{package}] FAILED: installed but not required by {dist}[test]: {stray}")
        return 1
    brought = sorted(d for d in closure(dist, set()) if not d.startswith("radixlm"))
    ours = sorted(d for d in closure(dist, set()) if d.startswith("radixlm") and d != dist)
    print(f"[{package}] {dist} alone brings: {', '.join(ours + brought) or 'nothing else'}")
    if package in FOOTPRINT and not set(brought) <= FOOTPRINT[package]:
        print(
            f"[{package}] FAILED: beyond its promised footprint: {sorted(set(brought) - FOOTPRINT[package])}"
        )
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
