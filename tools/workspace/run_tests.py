"""Run the packages' tests, one pytest process per package, then `integration_tests/`.

`hatch test` and `hatch run test` call it in the workspace environment, `hatch run alone:test`
in each package's own environment (with `--installed --fast-subset`):

    python tools/workspace/run_tests.py [--engine-mode process] [--installed] [--fast-subset]
        [--record-durations FILE] [PKG ...] [PYTEST ARGS]

The leading package names (some of `members.PACKAGES`, or `integration`) choose what runs,
every package and the integration tests by default; what follows them goes to pytest.
`--engine-mode process` runs every engine a test builds with its core in its own process
(tools/testing/pytest_engine_process.py). `--installed` runs against the installed package
rather than the checkout: no pytest cache is written into the tree. `--record-durations FILE`
adds each test's time to FILE (tools/testing/pytest_durations.py); `--fast-subset` runs only
the test files whose tests took at most `FAST_FILE_SECONDS` together in the committed record
(`DURATIONS`, written by a workspace run with `--record-durations`), and every file the
record does not know: the per-package runs check that a package works with only what it
declares, which its quick tests show as well as its slow ones, and the workspace run has
already run them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from members import PACKAGES, ROOT

INTEGRATION = ROOT / "integration_tests"
PYTEST_NO_TESTS = 5
TESTING = ROOT / "tools" / "testing"
DURATIONS = ROOT / "tools" / "workspace" / "test_durations.json"
FAST_FILE_SECONDS = 5.0


@dataclass
class Options:
    """How run_tests runs pytest (its own flags, before the package names)."""

    engine_mode: str = "default"
    installed: bool = False
    fast_subset: bool = False
    record_durations: str | None = None


def parse(argv: list[str]) -> tuple[list[str], list[str], Options]:
    """(package names, pytest arguments, options) from the command line."""
    names: list[str] = []
    options = Options()
    rest = list(argv)
    while rest:
        arg = rest[0]
        if arg in PACKAGES or arg == "integration":
            names.append(rest.pop(0))
        elif arg == "--installed":
            options.installed = True
            rest.pop(0)
        elif arg == "--fast-subset":
            options.fast_subset = True
            rest.pop(0)
        elif arg in ("--engine-mode", "--record-durations") and len(rest) > 1:
            setattr(options, arg[2:].replace("-", "_"), rest[1])
            del rest[:2]
        elif arg.startswith(("--engine-mode=", "--record-durations=")):
            key, value = rest.pop(0)[2:].split("=", 1)
            setattr(options, key.replace("-", "_"), value)
        else:
            break
    if options.engine_mode not in ("default", "process"):
        sys.exit(f"--engine-mode must be 'default' or 'process', not {options.engine_mode!r}")
    return names, rest, options


def fast_files(tests: Path) -> list[Path] | None:
    """The test files under `tests` that the duration record calls fast (or does not know);
    None without a record (then everything runs)."""
    if not DURATIONS.exists():
        return None
    per_file: dict[str, float] = {}
    for nodeid, seconds in json.loads(DURATIONS.read_text()).items():
        file = nodeid.partition("::")[0]
        per_file[file] = per_file.get(file, 0.0) + float(seconds)
    chosen = []
    for path in sorted(tests.glob("test_*.py")):
        recorded = per_file.get(path.relative_to(ROOT).as_posix())
        if recorded is None or recorded <= FAST_FILE_SECONDS:
            chosen.append(path)
    return chosen


def is_skeleton(name: str) -> bool:
    """A package not built yet holds only its version module and py.typed."""
    src = PACKAGES[name] / "src" / "radixlm" / name
    return not any(p.name != "_version.py" for p in src.rglob("*.py"))


def run_pytest(name: str, pytest_args: list[str], options: Options) -> bool:
    tests = INTEGRATION if name == "integration" else PACKAGES[name] / "tests"
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    targets: list[Path] = [tests]
    if options.fast_subset:
        chosen = fast_files(tests)
        if chosen is not None:
            skipped = len(list(tests.glob("test_*.py"))) - len(chosen)
            print(f"[{name}] fast subset: {len(chosen)} test files ({skipped} slow ones ran "
                  "in the workspace run)", flush=True)  # fmt: skip
            targets = chosen
    cmd = [sys.executable, "-m", "pytest", *map(str, targets), "-q"]
    if options.installed:
        cmd += ["-p", "no:cacheprovider"]
    plugins = []
    if options.engine_mode == "process":
        plugins.append("pytest_engine_process")
    if options.record_durations is not None:
        plugins.append("pytest_durations")
        env["RADIXLM_DURATIONS_OUT"] = str(Path(options.record_durations).resolve())
    if plugins:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTING), env.get("PYTHONPATH")]))
        for plugin in plugins:
            cmd += ["-p", plugin]
    cmd += pytest_args
    print("+", " ".join(cmd), flush=True)
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code == PYTEST_NO_TESTS:
        # No tests collected is fine only for a package that is still a skeleton, or for a
        # fast subset that `-m` emptied.
        if name in PACKAGES and is_skeleton(name):
            print(f"[{name}] skeleton package, no tests yet", flush=True)
            return True
        if options.fast_subset:
            print(f"[{name}] no fast test selected", flush=True)
            return True
        print(f"[{name}] FAILED: no tests were collected", flush=True)
        return False
    return code == 0


def main(argv: list[str]) -> int:
    names, pytest_args, options = parse(argv)
    selected = names or [*PACKAGES, "integration"]
    failed = []
    for name in selected:
        if name == "integration" and not any(INTEGRATION.glob("test_*.py")):
            print("[integration] no integration tests yet", flush=True)
            continue
        if not run_pytest(name, pytest_args, options):
            failed.append(name)
    print("\n== test summary ==")
    for name in selected:
        print(f"  {name:12s} {'FAILED' if name in failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
