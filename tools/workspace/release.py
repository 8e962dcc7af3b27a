"""Versions, changelogs and builds of the workspace's packages, on hatch (`hatch run release ...`).

    release.py bump PKG BUMP [--date YYYY-MM-DD] [--dry-run]
        `hatch version BUMP` in the package's folder (BUMP: major, minor, patch, an explicit
        version, or `current` to release the version as it stands), then the package's
        CHANGELOG.md: the entries under "Unreleased" (and under "NEW — unreleased") become the
        section "NEW — DATE", under a fresh empty "Unreleased". Before anything is written it
        checks that every package depending on PKG (and the `radixlm` meta-distribution) still
        admits NEW; if one does not, nothing changes and the ranges to widen are named.
    release.py check
        Every internal requirement admits the current version of the package it names.
    release.py build [PKG ...]
        `hatch build` of each package (all of them and the meta-distribution by default) into
        dist/: a wheel and an sdist each.

docs/releasing.md describes the whole flow.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from members import PACKAGES, ROOT, canonical, declared_requirements, pyproject

META = "radixlm"  # the root: the meta-distribution that depends on every package


@dataclass(frozen=True)
class InternalRequirement:
    """`dependant` (a package short name, or META) requires `requirement` of radixlm-`target`."""

    dependant: str
    pyproject: Path
    target: str
    requirement: Requirement


def hatch_executable() -> str:
    found = shutil.which("hatch")
    if found is None:
        sys.exit("hatch is not on PATH: run this through `python3 tools/dev.py run release ...`")
    return found


def hatch_version(package: str, bump: str | None = None) -> Version:
    """The package's version from `hatch version`, after bumping it when `bump` is given."""
    folder = PACKAGES[package]
    if bump is not None:
        subprocess.run([hatch_executable(), "version", bump], cwd=folder, check=True)
    out = subprocess.run(
        [hatch_executable(), "version"], cwd=folder, check=True, capture_output=True, text=True
    )
    return Version(out.stdout.strip().splitlines()[-1])


def version_file(package: str) -> Path:
    return PACKAGES[package] / pyproject(PACKAGES[package])["tool"]["hatch"]["version"]["path"]


def current_version(package: str) -> Version:
    """The version `_version.py` holds (what `hatch version` reports, without hatch)."""
    text = version_file(package).read_text(encoding="utf-8")
    match = re.search(r"""__version__\s*=\s*["'](.+?)["']""", text)
    if match is None:
        sys.exit(f'{version_file(package)}: no __version__ = "X.Y.Z" line')
    return Version(match.group(1))


def internal_requirements() -> list[InternalRequirement]:
    """Every requirement of one radixlm package on another, extras' requirements included."""
    found = []
    for dependant, folder in [*PACKAGES.items(), (META, ROOT)]:
        for line in declared_requirements(folder):
            requirement = Requirement(line)
            target = canonical(requirement.name).removeprefix("radixlm-")
            if canonical(requirement.name).startswith("radixlm-") and target in PACKAGES:
                found.append(
                    InternalRequirement(dependant, folder / "pyproject.toml", target, requirement)
                )
    return found


def refusals(target: str, version: Version) -> list[str]:
    """What does not admit `version` of radixlm-`target`, one line each."""
    return [
        f"{req.pyproject.relative_to(ROOT)}: {req.requirement} does not admit {version}"
        for req in internal_requirements()
        if req.target == target
        and not req.requirement.specifier.contains(version, prereleases=True)
    ]


def release_changelog(text: str, version: Version, date: str) -> str:
    """`text` with the "Unreleased" and "VERSION — unreleased" entries under "VERSION — DATE"."""
    heading = re.compile(r"^## (.+?)\s*$", re.M)
    parts = heading.split(text)  # [preamble, title1, body1, title2, body2, ...]
    preamble, sections = parts[0], list(zip(parts[1::2], parts[2::2], strict=True))
    pending = {"unreleased", f"{version} — unreleased".lower()}
    entries = [body.strip() for title, body in sections if title.lower() in pending]
    entries = [e for e in entries if e]
    if not entries:
        raise ValueError(
            f'nothing to release: no entries under "Unreleased" or "{version} — unreleased"'
        )
    out = [preamble.rstrip() + "\n\n## Unreleased\n\n"]
    placed = False
    for title, body in sections:
        if title.lower() in pending:
            if not placed:
                out.append(f"## {version} — {date}\n\n" + "\n\n".join(entries) + "\n\n")
                placed = True
            continue
        out.append(f"## {title}\n{body.rstrip()}\n\n")
    return "".join(out).rstrip() + "\n"


def bump(package: str, how: str, date: str, dry_run: bool) -> int:
    vfile = version_file(package)
    changelog = PACKAGES[package] / "CHANGELOG.md"
    saved = vfile.read_text(encoding="utf-8")
    old = hatch_version(package)
    new = old if how == "current" else hatch_version(package, how)
    problems = refusals(package, new)
    try:
        updated = release_changelog(changelog.read_text(encoding="utf-8"), new, date)
    except ValueError as exc:
        problems.append(f"{changelog.relative_to(ROOT)}: {exc}")
    if problems or dry_run:
        vfile.write_text(saved, encoding="utf-8")
    if problems:
        print(f"radixlm-{package} {new} cannot be released; mend these first:")
        print("\n".join(f"  {p}" for p in problems))
        print(f"radixlm-{package} left at {old}")
        return 1
    if dry_run:
        print(f"radixlm-{package}: {old} -> {new} would be released (dry run; nothing written)")
        print(updated[:1500])
        return 0
    changelog.write_text(updated, encoding="utf-8")
    print(f"radixlm-{package}: {old} -> {new}; {changelog.relative_to(ROOT)} has its {new} section")
    print(f"next: `hatch env remove alone.{package}`, `hatch run alone.{package}:test`,")
    print(f"`hatch run release build {package}`, tag radixlm-{package}-v{new}")
    return 0


def check() -> int:
    problems = [
        line for package in PACKAGES for line in refusals(package, current_version(package))
    ]
    for problem in problems:
        print(problem)
    print(f"internal dependency ranges: {'FAILED' if problems else 'ok'}")
    return 1 if problems else 0


def build(packages: list[str]) -> int:
    out = ROOT / "dist"
    folders = [PACKAGES[p] for p in packages] if packages else [*PACKAGES.values(), ROOT]
    failed = []
    for folder in folders:
        cmd = [hatch_executable(), "build", str(out)]
        print(
            "+",
            " ".join(cmd),
            f"(in {folder.relative_to(ROOT) if folder != ROOT else '.'})",
            flush=True,
        )
        if subprocess.call(cmd, cwd=folder) != 0:
            failed.append(folder.name)
    if failed:
        print(f"build FAILED: {', '.join(failed)}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bump", help="bump one package's version and date its changelog")
    b.add_argument("package", choices=list(PACKAGES))
    b.add_argument(
        "bump", help="major, minor, patch, X.Y.Z (what `hatch version` takes) or current"
    )
    b.add_argument("--date", default=datetime.date.today().isoformat())
    b.add_argument("--dry-run", action="store_true", help="show what would change; write nothing")
    sub.add_parser("check", help="every internal range admits the current versions")
    bd = sub.add_parser("build", help="wheel and sdist of packages into dist/")
    bd.add_argument("packages", nargs="*", metavar="PKG", help=", ".join(PACKAGES))
    args = parser.parse_args()
    unknown = [p for p in getattr(args, "packages", []) if p not in PACKAGES]
    if unknown:
        parser.error(f"unknown package(s) {unknown}; choose from {', '.join(PACKAGES)}")
    if args.command == "bump":
        return bump(args.package, args.bump, args.date, args.dry_run)
    if args.command == "check":
        return check()
    return build(args.packages)


if __name__ == "__main__":
    sys.exit(main())
