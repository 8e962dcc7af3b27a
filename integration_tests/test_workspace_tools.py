"""The hatch workspace's configuration and tools/workspace/: consistent with the packages."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "workspace"))

import members  # noqa: E402
import release  # noqa: E402
import run_tests  # noqa: E402

HATCH = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["hatch"]


def test_every_package_is_a_workspace_member_and_has_its_own_environment() -> None:
    folders = {name: path.relative_to(ROOT).as_posix() for name, path in members.PACKAGES.items()}
    listed = HATCH["envs"]["default"]["workspace"]["members"]
    paths = [m["path"] if isinstance(m, dict) else m for m in listed]
    assert sorted(paths) == sorted(folders.values())
    (matrix,) = HATCH["envs"]["alone"]["matrix"]
    assert matrix["package"] == list(members.PACKAGES)
    for folder in folders.values():
        assert (ROOT / folder / "pyproject.toml").is_file()
        # `radixlm-PKG[test]` must name an extra the package declares.
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        assert "test" in project.get("optional-dependencies", {}), folder


def test_sources_point_every_package_at_its_folder() -> None:
    lines = [
        line.split(" @ ")
        for line in (ROOT / "tools" / "workspace" / "sources.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    sources = {name: url for name, url in lines}
    assert sources == {
        f"radixlm-{name}": f"file://${{RADIXLM_ROOT}}/{path.relative_to(ROOT).as_posix()}"
        for name, path in members.PACKAGES.items()
    }


def test_member_features_exist() -> None:
    for member in HATCH["envs"]["default"]["workspace"]["members"]:
        if isinstance(member, dict) and member.get("features"):
            project = tomllib.loads((ROOT / member["path"] / "pyproject.toml").read_text())[
                "project"
            ]
            assert set(member["features"]) <= set(project["optional-dependencies"]), member


def test_parse_splits_packages_from_pytest_arguments() -> None:
    names, args, options = run_tests.parse(["runtime", "integration", "-k", "lora", "-p", "x"])
    assert (names, args, options) == (["runtime", "integration"], ["-k", "lora", "-p", "x"],
                                      run_tests.Options())  # fmt: skip
    names, args, options = run_tests.parse(
        ["--engine-mode", "process", "--installed", "--fast-subset",
         "--record-durations=out.json", "cache", "-x"]
    )  # fmt: skip
    assert (names, args) == (["cache"], ["-x"])
    assert options == run_tests.Options("process", True, True, "out.json")
    # A package name after pytest's own arguments is an argument, not a selection.
    assert run_tests.parse(["-k", "runtime"]) == ([], ["-k", "runtime"], run_tests.Options())
    with pytest.raises(SystemExit):
        run_tests.parse(["--engine-mode", "thread"])


def test_the_fast_subset_keeps_quick_and_unrecorded_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("test_quick.py", "test_slow.py", "test_new.py"):
        (tests / name).write_text("")
    monkeypatch.setattr(run_tests, "ROOT", tmp_path)
    record = tmp_path / "durations.json"
    monkeypatch.setattr(run_tests, "DURATIONS", record)
    assert run_tests.fast_files(tests) is None  # no record: everything runs
    limit = run_tests.FAST_FILE_SECONDS
    record.write_text(json.dumps({
        "tests/test_quick.py::a": 0.5,
        "tests/test_quick.py::b[1]": 0.5,
        "tests/test_slow.py::a": limit / 2,
        "tests/test_slow.py::b": limit / 2 + 0.1,
    }))  # fmt: skip
    chosen = run_tests.fast_files(tests)
    assert [path.name for path in chosen or []] == ["test_new.py", "test_quick.py"]


def test_the_committed_duration_record_names_existing_tests() -> None:
    """The record is written by `run_tests.py --record-durations` and read by the fast subset:
    every file it names exists (renew it after renaming test files: see the README)."""
    record = json.loads(run_tests.DURATIONS.read_text())
    files = {nodeid.partition("::")[0] for nodeid in record}
    assert len(files) > 100
    assert sorted(f for f in files if not (ROOT / f).exists()) == []


def test_current_internal_ranges_admit_current_versions() -> None:
    assert release.check() == 0


def test_a_minor_bump_is_refused_by_the_ranges_it_leaves_behind() -> None:
    dependants = {
        req.dependant for req in release.internal_requirements() if req.target == "sampling"
    }
    assert {"constrained", "runtime", "server", "lang", "router", release.META} <= dependants
    problems = release.refusals("sampling", Version("99.0.0"))
    assert len(problems) == len(
        [r for r in release.internal_requirements() if r.target == "sampling"]
    )
    assert any("packages/router/pyproject.toml" in p for p in problems)
    assert release.refusals("cache", Version("0.2.7")) == []


CHANGELOG = """# Changelog — radixlm-x

## Unreleased

- New thing.

## 0.3.0 — unreleased

- Bumped earlier.

## 0.2.0 — 2026-01-01

- Old thing.
"""


def test_release_changelog_dates_the_pending_entries() -> None:
    out = release.release_changelog(CHANGELOG, Version("0.3.0"), "2026-12-02")
    assert out == (
        "# Changelog — radixlm-x\n\n## Unreleased\n\n"
        "## 0.3.0 — 2026-12-02\n\n- New thing.\n\n- Bumped earlier.\n\n"
        "## 0.2.0 — 2026-01-01\n\n- Old thing.\n"
    )
    # Another version takes only "Unreleased"; the pre-bumped section stays as it was.
    other = release.release_changelog(CHANGELOG, Version("0.2.1"), "2026-12-02")
    assert "## 0.2.1 — 2026-12-02\n\n- New thing.\n\n## 0.3.0 — unreleased" in other


def test_release_changelog_refuses_an_empty_release() -> None:
    empty = "# Changelog\n\n## Unreleased\n\n## 0.2.0 — 2026-01-01\n\n- Old.\n"
    with pytest.raises(ValueError, match="nothing to release"):
        release.release_changelog(empty, Version("0.2.1"), "2026-12-02")
