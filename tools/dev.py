#!/usr/bin/env python3
"""Hatch, from this repository: installs the pinned hatch into tools/.hatch on first use, then
hands the command line over to it. The environments and scripts live in the root pyproject.toml.

    python3 tools/dev.py serve [FLAGS]     hatch run serve: `radixlm serve` (built-in model)
    python3 tools/dev.py test [PKG ...]    hatch test: every package's tests, in the workspace
    python3 tools/dev.py ARGS ...          hatch ARGS, e.g. `run check`, `run alone:test`,
                                           `run docs:build`, `env show`, `run release ...`

Only the standard library is used here, so the script runs on a bare Python 3.10+ with pip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / "tools" / ".hatch"
REQUIREMENTS = ROOT / "tools" / "hatch-requirements.txt"
SHORTCUTS = {"serve": ["run", "serve"], "test": ["test"]}


def hatch() -> Path:
    """tools/.hatch/venv/bin/hatch, installed (again) when tools/hatch-requirements.txt changed."""
    env = HOME / "venv"
    bin_dir = env / ("Scripts" if os.name == "nt" else "bin")
    stamp = env / "requirements.txt"
    wanted = REQUIREMENTS.read_text(encoding="utf-8")
    if not stamp.exists() or stamp.read_text(encoding="utf-8") != wanted:
        print(f"installing hatch into {env.relative_to(ROOT)}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(env)
        pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True)
        stamp.write_text(wanted, encoding="utf-8")
    return bin_dir / "hatch"


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    args = [*SHORTCUTS.get(argv[0], [argv[0]]), *argv[1:]] if argv else ["--help"]
    try:
        executable = hatch()
    except subprocess.CalledProcessError as exc:
        print(f"could not install hatch ({exc}); see tools/hatch-requirements.txt", file=sys.stderr)
        return 1
    env = dict(os.environ)
    # Hatch's own data (its environments other than .venv, their metadata) stays in the tree.
    env.setdefault("HATCH_DATA_DIR", str(HOME / "data"))
    # Scripts that call hatch (tools/workspace/release.py) find this one.
    env["PATH"] = os.pathsep.join([str(executable.parent), env.get("PATH", "")])
    os.chdir(ROOT)
    os.execve(executable, [str(executable), *args], env)
    return 1  # not reached: execve replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
