"""Run the packages' tests, one pytest process per package, then `integration_tests/`.

`hatch test` and `hatch run test` call it in the workspace environment, `hatch run alone:test`
in each package's own environment (with `--installed`):

    python tools/workspace/run_tests.py [--engine-mode process] [--installed] [PKG ...] [PYTEST ARGS]

The leading package names (some of `members.PACKAGES`, or `integration`) choose what runs,
every package and the integration tests by default; what follows them goes to pytest.
`--engine-mode process` runs every engine a test builds with its core in its own process
(tools/testing/pytest_engine_process.py). `--installed` runs against the installed package
rather than the checkout: no pytest cache is written into the tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from members import PACKAGES, ROOT

INTEGRATION = ROOT / "integration_tests"
PYTEST_NO_TESTS = 5


def parse(argv: list[str]) -> tuple[list[str], list[str], str, bool]:
    """(package names, pytest arguments, engine mode, installed) from the command line."""
    names: list[str] = []
    engine_mode = "default"
    installed = False
    rest = list(argv)
    while rest:
        arg = rest[0]
        if arg in PACKAGES or arg == "integration":
            names.append(rest.pop(0))
        elif arg == "--installed":
            installed = True
            rest.pop(0)
        elif arg == "--engine-mode" and len(rest) > 1:
            engine_mode = rest[1]
            del rest[:2]
        elif arg.startswith("--engine-mode="):
            engine_mode = rest.pop(0).split("=", 1)[1]
        else:
            break
    if engine_mode not in ("default", "process"):
        sys.exit(f"--engine-mode must be 'default' or 'process', not {engine_mode!r}")
    return names, rest, engine_mode, installed


def is_skeleton(name: str) -> bool:
    """A package not built yet holds only its version module and py.typed."""
    src = PACKAGES[name] / "src" / "radixlm" / name
    return not any(p.name != "_version.py" for p in src.rglob("*.py"))


def run_pytest(name: str, pytest_args: list[str], engine_mode: str, installed: bool) -> bool:
    tests = INTEGRATION if name == "integration" else PACKAGES[name] / "tests"
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    cmd = [sys.executable, "-m", "pytest", str(tests), "-q"]
    if installed:
        cmd += ["-p", "no:cacheprovider"]
    if engine_mode == "process":
        testing = str(ROOT / "tools" / "testing")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [testing, env.get("PYTHONPATH")]))
        cmd += ["-p", "pytest_engine_process"]
    cmd += pytest_args
    print("+", " ".join(cmd), flush=True)
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code == PYTEST_NO_TESTS:
        # No tests collected is fine only for a package that is still a skeleton.
        if name in PACKAGES and is_skeleton(name):
            print(f"[{name}] skeleton package, no tests yet", flush=True)
            return True
        print(f"[{name}] FAILED: no tests were collected", flush=True)
        return False
    return code == 0


def main(argv: list[str]) -> int:
    names, pytest_args, engine_mode, installed = parse(argv)
    selected = names or [*PACKAGES, "integration"]
    failed = []
    for name in selected:
        if name == "integration" and not any(INTEGRATION.glob("test_*.py")):
            print("[integration] no integration tests yet", flush=True)
            continue
        if not run_pytest(name, pytest_args, engine_mode, installed):
            failed.append(name)
    print("\n== test summary ==")
    for name in selected:
        print(f"  {name:12s} {'FAILED' if name in failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
