#!/usr/bin/env python3
"""Developer entry point: set up the dev venv, run the tests, the quality gates and the builds.

    python3 tools/dev.py serve [FLAGS]    set up if needed, then `radixlm serve` (built-in model)
    python3 tools/dev.py setup            create/refresh .venv (every package editable + dev tools)
    python3 tools/dev.py test [PKG ...]   set up if needed, then run each package's tests
    python3 tools/dev.py test runtime --engine-mode process   the same, every engine in a process
    python3 tools/dev.py check            ruff (lint + format), mypy, import contracts
    python3 tools/dev.py isolate [PKG ..] each package alone in a fresh venv, its tests there
    python3 tools/dev.py build [PKG ...]  wheel + sdist for every package into dist/
    python3 tools/dev.py docs [--out DIR] the mkdocs site into site/ (warnings are errors)

Only the standard library is used here, so the script runs on a bare Python 3.10+ with pip.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
CONSTRAINTS = ROOT / "constraints.txt"
DEV_REQUIREMENTS = ROOT / "requirements-dev.txt"

# Package name -> folder. Order is the dependency order (leaves first).
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
INTEGRATION_TESTS = ROOT / "integration_tests"
PYTEST_NO_TESTS = 5


def venv_python(env: Path = VENV) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(cmd: list[str | Path], **kwargs: object) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], **kwargs)  # type: ignore[arg-type]


def must(cmd: list[str | Path], **kwargs: object) -> None:
    code = run(cmd, **kwargs)
    if code != 0:
        sys.exit(code)


def extras_of(folder: Path) -> list[str]:
    """The optional-dependency groups a package declares (read without a TOML library)."""
    text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if not match:
        return []
    return re.findall(r"^([A-Za-z0-9_-]+)\s*=", match.group(1), re.M)


#: Extras the dev venv leaves out: heavy, and only for tests that skip without them
#: (`pip install -e "packages/router[ray]"` runs the Ray Serve tests).
HEAVY_EXTRAS = {"ray"}


def editable_spec(folder: Path) -> str:
    extras = [extra for extra in extras_of(folder) if extra not in HEAVY_EXTRAS]
    return f"{folder}[{','.join(extras)}]" if extras else str(folder)


def setup_fingerprint() -> str:
    digest = hashlib.sha256()
    for path in [CONSTRAINTS, DEV_REQUIREMENTS, ROOT / "pyproject.toml"] + [
        folder / "pyproject.toml" for folder in PACKAGES.values()
    ]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cmd_setup(force: bool = False) -> None:
    stamp = VENV / ".radixlm-setup"
    fingerprint = setup_fingerprint()
    if not force and stamp.exists() and stamp.read_text() == fingerprint:
        return
    if not venv_python().exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [venv_python(), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    cmd: list[str | Path] = [*pip, "-c", CONSTRAINTS, "-r", DEV_REQUIREMENTS]
    for folder in PACKAGES.values():
        cmd += ["-e", editable_spec(folder)]
    must(cmd)
    # The meta-distribution last: its dependencies are the editable packages above.
    must([*pip, "-c", CONSTRAINTS, "-e", ROOT])
    stamp.write_text(fingerprint)


def is_skeleton(name: str) -> bool:
    """A package not built yet holds only its version module and py.typed."""
    src = PACKAGES[name] / "src" / "radixlm" / name
    return not any(p.name != "_version.py" for p in src.rglob("*.py"))


def pytest_env(engine_mode: str = "default") -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if engine_mode == "process":
        # tools/testing/pytest_engine_process.py: every Engine a test builds gets a process.
        testing = str(ROOT / "tools" / "testing")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [testing, env.get("PYTHONPATH")]))
    return env


def run_pytest(
    python: Path, name: str, tests: Path, extra: list[str], engine_mode: str = "default"
) -> bool:
    plugin = ["-p", "pytest_engine_process"] if engine_mode == "process" else []
    code = run(
        [python, "-m", "pytest", tests, "-q", *plugin, *extra],
        cwd=ROOT,
        env=pytest_env(engine_mode),
    )
    if code == PYTEST_NO_TESTS:
        # No tests collected is fine only for a package that is still a skeleton.
        if name in PACKAGES and is_skeleton(name):
            print(f"[{name}] skeleton package, no tests yet", flush=True)
            return True
        print(f"[{name}] FAILED: no tests were collected", flush=True)
        return False
    return code == 0


def cmd_test(names: list[str], extra: list[str], engine_mode: str = "default") -> int:
    cmd_setup()
    selected = names or [*PACKAGES, "integration"]
    failed = []
    for name in selected:
        tests = INTEGRATION_TESTS if name == "integration" else PACKAGES[name] / "tests"
        if name == "integration" and not any(tests.glob("test_*.py")):
            print("[integration] no integration tests yet", flush=True)
            continue
        if not run_pytest(venv_python(), name, tests, extra, engine_mode):
            failed.append(name)
    print("\n== test summary ==")
    for name in selected:
        print(f"  {name:12s} {'FAILED' if name in failed else 'ok'}")
    return 1 if failed else 0


def cmd_check() -> int:
    cmd_setup()
    bin_dir = venv_python().parent
    dirs = [str(p.relative_to(ROOT)) for p in PACKAGES.values()]
    dirs += ["tools", "integration_tests", "examples"]
    mypy_targets: list[str] = []
    for name in PACKAGES:
        if not is_skeleton(name):
            mypy_targets += ["-p", f"radixlm.{name}"]
    steps: list[tuple[str, list[str | Path]]] = [
        ("ruff lint", [bin_dir / "ruff", "check", *dirs]),
        ("ruff format", [bin_dir / "ruff", "format", "--check", *dirs]),
        ("mypy", [bin_dir / "mypy", *mypy_targets]),
        ("import contracts", [bin_dir / "lint-imports", "--no-cache"]),
    ]
    failed = [label for label, cmd in steps if run(cmd, cwd=ROOT) != 0]
    print("\n== check summary ==")
    for label, _ in steps:
        print(f"  {label:18s} {'FAILED' if label in failed else 'ok'}")
    return 1 if failed else 0


def cmd_build(names: list[str], out: Path) -> int:
    cmd_setup()
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in names or list(PACKAGES):
        if run([venv_python(), "-m", "build", "--no-isolation", "-o", out, PACKAGES[name]]) != 0:
            failed.append(name)
    if not names and run([venv_python(), "-m", "build", "--no-isolation", "-o", out, ROOT]) != 0:
        failed.append("radixlm")
    return 1 if failed else 0


def cmd_isolate(names: list[str], keep: bool) -> int:
    """Install each package alone (from wheels built here) in a fresh venv; run its tests there."""
    sys.path.insert(0, str(ROOT / "tools"))
    from isolation import isolate

    wheels = ROOT / "dist" / "isolation-wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    if cmd_build([], wheels) != 0:
        return 1
    failed = [n for n in names or list(PACKAGES) if not isolate(n, PACKAGES, wheels, keep)]
    return 1 if failed else 0


def cmd_docs(out: Path) -> int:
    """The documentation site (mkdocs.yml, docs/) built with warnings as errors, as CI does."""
    cmd_setup()
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    mkdocs = [venv_python(), "-m", "mkdocs", "build", "--strict", "--clean", "-d", out]
    return run(mkdocs, cwd=ROOT, env=env)


def cmd_serve(flags: list[str]) -> int:
    """The reference server (`radixlm serve FLAGS`) from the dev venv; blocks until stopped."""
    cmd_setup()
    radixlm = venv_python().parent / "radixlm"
    os.execv(radixlm, [str(radixlm), "serve", *flags])
    return 1  # not reached: execv replaces this process


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup")
    setup.add_argument("--force", action="store_true")
    test = sub.add_parser("test")
    test.add_argument("packages", nargs="*", help=f"some of: {', '.join(PACKAGES)}, integration")
    test.add_argument(
        "--engine-mode",
        choices=["default", "process"],
        default="default",
        help="process: every Engine a test builds runs its core in its own process "
        "(tests marked thread_only are skipped)",
    )
    sub.add_parser("serve", help="radixlm serve with the given flags (default: built-in model)")
    sub.add_parser("check")
    build = sub.add_parser("build")
    build.add_argument("packages", nargs="*")
    isolate = sub.add_parser("isolate")
    isolate.add_argument("packages", nargs="*")
    isolate.add_argument("--keep", action="store_true", help="keep the venvs in .isolation/")
    docs = sub.add_parser("docs", help="build the documentation site (mkdocs --strict)")
    docs.add_argument("--out", type=Path, default=ROOT / "site", help="output folder (site/)")
    args, extra = parser.parse_known_args()
    if args.command == "setup":
        cmd_setup(force=args.force)
        return 0
    if args.command == "serve":
        return cmd_serve(extra)
    if args.command == "test":
        return cmd_test(args.packages, extra, args.engine_mode)
    if args.command == "check":
        return cmd_check()
    if args.command == "build":
        return cmd_build(args.packages, ROOT / "dist")
    if args.command == "docs":
        return cmd_docs(args.out.resolve())
    return cmd_isolate(args.packages, args.keep)


if __name__ == "__main__":
    sys.exit(main())
