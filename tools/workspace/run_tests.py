"""Run the packages' tests, one pytest process per package, then `integration_tests/`.

`hatch test` and `hatch run test` call it in the workspace environment, `hatch run alone:test`
in each package's own environment (with `--installed --fast-subset`):

    python tools/workspace/run_tests.py [--engine-mode process] [--installed] [--fast-subset]
        [--record-durations FILE] [--jobs 1|2] [PKG ...] [PYTEST ARGS]

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

Several packages run in two lanes side by side (`--jobs 2`, the default on two cores or more;
not when recording durations): `LANE_A` in one, the rest in the other, each pytest with one
OpenMP thread, and then the integration files in `SERIAL` alone with every core. A lane's
output is printed whole when both lanes are done (a line per package as each ends).
`--jobs 1` runs everything one after another, as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from members import PACKAGES, ROOT

INTEGRATION = ROOT / "integration_tests"
PYTEST_NO_TESTS = 5
TESTING = ROOT / "tools" / "testing"
DURATIONS = ROOT / "tools" / "workspace" / "test_durations.json"
FAST_FILE_SECONDS = 5.0
# With two lanes (`--jobs 2`, the default where there are two cores or more), these packages
# run one after another in the first lane, the rest (constrained, server, lang, router, the
# integration tests but SERIAL) in the second, each pytest single-threaded (OMP_NUM_THREADS=1:
# two processes with a thread per core each, not four threads fighting over two cores; a test
# that compares what the torch kernels compute pins two threads, see the runtime conftest).
LANE_A = ("runtime", "cache", "sampling", "kernels")
# Integration test files that run after the lanes, alone, with every core: the real model's
# (heavy arithmetic, faster on two threads) and those that time how a server drains, dies or
# serves, which a loaded machine would stretch.
SERIAL = (
    "test_real_model.py",
    "test_real_model_speculative.py",
    "test_server_engine_drain.py",
    "test_server_engine_restart.py",
    "test_bench_pd.py",
)


@dataclass
class Options:
    """How run_tests runs pytest (its own flags, before the package names)."""

    engine_mode: str = "default"
    installed: bool = False
    fast_subset: bool = False
    record_durations: str | None = None
    jobs: int | None = None  # None: 2 where there are 2 cores or more, else 1


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
        elif arg in ("--engine-mode", "--record-durations", "--jobs") and len(rest) > 1:
            setattr(options, arg[2:].replace("-", "_"), rest[1])
            del rest[:2]
        elif arg.startswith(("--engine-mode=", "--record-durations=", "--jobs=")):
            key, value = rest.pop(0)[2:].split("=", 1)
            setattr(options, key.replace("-", "_"), value)
        else:
            break
    if options.engine_mode not in ("default", "process"):
        sys.exit(f"--engine-mode must be 'default' or 'process', not {options.engine_mode!r}")
    if options.jobs is not None and str(options.jobs) not in ("1", "2"):
        sys.exit(f"--jobs must be 1 or 2, not {options.jobs!r}")
    options.jobs = None if options.jobs is None else int(options.jobs)
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


def run_pytest(
    name: str,
    pytest_args: list[str],
    options: Options,
    files: list[Path] | None = None,
    threads: int | None = None,
    out: TextIO | None = None,
) -> bool:
    """One pytest process over a package's tests (or `files` of them); `threads`: its
    OMP_NUM_THREADS; `out`: where its output goes (else this process's)."""
    tests = INTEGRATION if name == "integration" else PACKAGES[name] / "tests"
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    targets: list[Path] = [tests] if files is None else list(files)
    if options.fast_subset:
        chosen = fast_files(tests)
        if chosen is not None:
            if files is not None:  # a lane's share of the files: the fast ones among them
                chosen = [f for f in chosen if f in files]
            skipped = len(targets if files is not None else list(tests.glob("test_*.py")))
            skipped -= len(chosen)
            print(f"[{name}] fast subset: {len(chosen)} test files ({skipped} slow ones ran "
                  "in the workspace run)", file=out, flush=True)  # fmt: skip
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
    print("+", " ".join(cmd), file=out, flush=True)
    code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)
    if code == PYTEST_NO_TESTS:
        # No tests collected is fine only for a package that is still a skeleton, or for a
        # fast subset that `-m` emptied.
        if name in PACKAGES and is_skeleton(name):
            print(f"[{name}] skeleton package, no tests yet", file=out, flush=True)
            return True
        if options.fast_subset:
            print(f"[{name}] no fast test selected", file=out, flush=True)
            return True
        print(f"[{name}] FAILED: no tests were collected", file=out, flush=True)
        return False
    return code == 0


def run_lanes(selected: list[str], pytest_args: list[str], options: Options) -> list[str]:
    """The packages' runs in two lanes side by side (LANE_A and the rest), each lane's output
    printed whole when both are done, then the SERIAL integration files alone; the names of
    what failed."""
    serial = [INTEGRATION / f for f in SERIAL if (INTEGRATION / f).exists()]
    parallel = [f for f in sorted(INTEGRATION.glob("test_*.py")) if f not in serial]
    lanes = [[n for n in selected if n in LANE_A], [n for n in selected if n not in LANE_A]]

    def lane(index: int, names: list[str], log: Path) -> list[str]:
        failed = []
        with log.open("w") as out:
            for name in names:
                start = time.monotonic()
                files = parallel if name == "integration" else None
                ok = run_pytest(name, pytest_args, options, files, threads=1, out=out)
                failed += [] if ok else [name]
                verdict = "ok" if ok else "FAILED"
                print(f"[lane {'ab'[index]}] {name}: {verdict} ({time.monotonic() - start:.0f} s)",
                      flush=True)  # fmt: skip
        return failed

    print(f"two lanes, single-threaded pytest each: {' '.join(lanes[0])} | "
          f"{' '.join(lanes[1])}; then alone: {' '.join(f.name for f in serial)}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(2) as pool:
        logs = [Path(folder) / "a.log", Path(folder) / "b.log"]
        runs = [pool.submit(lane, i, names, logs[i]) for i, names in enumerate(lanes)]
        failed = [name for run in runs for name in run.result()]
        for log in logs:
            print(log.read_text(), end="", flush=True)
    ran_alone = "integration" in selected and serial
    if ran_alone and not run_pytest("integration", pytest_args, options, serial):
        failed.append("integration")
    return failed


def main(argv: list[str]) -> int:
    names, pytest_args, options = parse(argv)
    selected = names or [*PACKAGES, "integration"]
    if not any(INTEGRATION.glob("test_*.py")) and "integration" in selected:
        print("[integration] no integration tests yet", flush=True)
        selected.remove("integration")
    jobs = options.jobs
    if jobs is None:
        jobs = 2 if len(selected) > 1 and (os.cpu_count() or 1) >= 2 else 1
    if options.record_durations is not None:
        jobs = 1  # one writer of the record, and times measured alone
    if jobs > 1:
        failed = run_lanes(selected, pytest_args, options)
    else:
        failed = [name for name in selected if not run_pytest(name, pytest_args, options)]
    print("\n== test summary ==")
    for name in selected:
        print(f"  {name:12s} {'FAILED' if name in failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
