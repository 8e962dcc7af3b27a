#!/usr/bin/env python3
"""What tools/gpu/run.sh and wheels.sh need to know about a Python environment.

    python tools/gpu/environment.py report [--json FILE] [--require-cuda]
    python tools/gpu/environment.py pins                 # torch/triton/transformers as installed
    python tools/gpu/environment.py site-dirs            # this interpreter's site-packages
    python tools/gpu/environment.py check-wheels DIR [--python-version 3.12]
    python tools/gpu/environment.py missing-wheels DIR   # the wheels of what is not installed

`report` prints (and writes as JSON) the interpreter, torch, triton and transformers versions,
the CUDA device, and which of the distributions the GPU steps need are installed. `check-wheels`
checks that a wheels folder, together with what the GPU image already holds, satisfies every
dependency of the radixlm packages run.sh installs, that each wheel installs on CPython 3.12 on
manylinux x86_64, and that each distribution is there once; it exits 1 naming what is wrong.

Only the standard library is needed, except `packaging` for check-wheels.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import site
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: The radixlm packages run.sh installs (folder, extras), in dependency order.
INSTALL = (
    ("packages/sampling", ("dill",)),
    ("packages/cache", ()),
    ("kernels", ("test",)),
    ("packages/constrained", ("xgrammar", "llguidance")),
    ("packages/runtime", ()),
)

#: What the GPU image holds of what radixlm needs (docs/deployment.md, "On a GPU machine"):
#: the version where it is known, else None (present, version not recorded).
GPU_IMAGE: dict[str, str | None] = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "accelerate": "1.15.0",
    "tqdm": None,
    "jinja2": None,
    "psutil": None,
    "ninja": None,
    "typing-extensions": None,
    "packaging": None,
    "pathspec": None,
    "pluggy": None,
    "attrs": None,
    "pytest": None,
    "pytest-timeout": None,
    "hypothesis": None,
    "iniconfig": None,
    "pygments": None,
    "sortedcontainers": None,
}

#: The distributions the GPU steps need, beyond the standard library.
NEEDED = (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "pydantic", "dill",
    "jsonschema", "xgrammar", "llguidance", "pytest", "radixlm-sampling", "radixlm-cache",
    "radixlm-kernels", "radixlm-constrained", "radixlm-runtime",
)  # fmt: skip

#: The versions of the three packages run.sh must never replace.
PINNED = ("torch", "triton", "transformers")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------- report


def cuda_report() -> dict[str, Any]:
    try:
        import torch
    except ImportError as error:
        return {"available": False, "error": f"torch does not import: {error}"}
    info: dict[str, Any] = {
        "available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
    }
    if info["available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=torch.cuda.get_device_name(0),
            device_count=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
    return info


def cmd_report(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "versions": {name: version_of(name) for name in (*PINNED, "numpy", "tokenizers")},
        "cuda": cuda_report(),
        "installed": {name: version_of(name) for name in NEEDED},
    }
    for key in ("python", "executable", "machine", "cpus"):
        print(f"{key:12s} {report[key]}")
    for name, version in report["versions"].items():
        print(f"{name:12s} {version or 'not installed'}")
    cuda = report["cuda"]
    if cuda.get("available"):
        print(
            f"{'cuda':12s} {cuda['device_name']} (capability {cuda['capability']}, "
            f"{cuda['memory_gib']} GiB, {cuda['multiprocessors']} SMs; CUDA {cuda['torch_cuda']})"
        )
    else:
        print(f"{'cuda':12s} not available {cuda.get('error', '')}".rstrip())
    missing = [name for name, version in report["installed"].items() if version is None]
    print(f"{'installed':12s} {len(NEEDED) - len(missing)} of the {len(NEEDED)} needed")
    if missing:
        print(f"{'missing':12s} {', '.join(missing)} (the install step adds them)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.require_cuda and not cuda.get("available"):
        print("no CUDA device: this is not a GPU machine (use --dry-run on a CPU)")
        return 1
    return 0


# ---------------------------------------------------------------------------------- pins


def cmd_pins(_: argparse.Namespace) -> int:
    """Constraints that keep torch, triton and transformers at their installed versions."""
    for name in PINNED:
        version = version_of(name)
        if version:
            print(f"{name}=={version}")
    return 0


def cmd_site_dirs(_: argparse.Namespace) -> int:
    """The folders this interpreter imports installed packages from (for another venv's .pth)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    for path in dict.fromkeys(dirs):
        if Path(path).is_dir():
            print(path)
    return 0


# ------------------------------------------------------------------------------- wheels


def wheel_requirements(path: Path) -> tuple[str, str, list[str]]:
    """A wheel's distribution name, version and Requires-Dist lines (from its METADATA)."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode("utf-8")
    headers = text.split("\n\n", 1)[0].splitlines()
    field = {k: v for k, _, v in (h.partition(": ") for h in headers) if k in ("Name", "Version")}
    requires = [h.split(": ", 1)[1] for h in headers if h.startswith("Requires-Dist: ")]
    return field["Name"], field["Version"], requires


def project_requirements(folder: Path, extras: tuple[str, ...]) -> tuple[str, list[str]]:
    """A radixlm package's name and its requirements with the given extras."""
    import tomllib

    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    requires = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        requires += optional[extra]
    return project["name"], requires


def accepted_tags(python_version: str) -> set[Any]:
    from packaging import tags

    major, minor = (int(p) for p in python_version.split(".")[:2])
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    platforms += ["linux_x86_64"]
    found = set(tags.cpython_tags((major, minor), platforms=platforms))
    found |= set(tags.compatible_tags((major, minor), f"cp{major}{minor}", platforms))
    return found


def check_wheels(folder: Path, python_version: str) -> list[str]:
    """What is wrong with `folder` as the GPU machine's wheels (empty when nothing is)."""
    from packaging.requirements import Requirement
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    problems: list[str] = []
    wheels: dict[str, Version] = {}
    requires: list[tuple[str, str, set[str]]] = []  # (requirement, who needs it, extras)
    ok_tags = accepted_tags(python_version)
    files = sorted(folder.glob("*.whl"))
    if not files:
        return [f"no wheels in {folder}"]
    for path in files:
        wheel_name, version, _, wheel_tags = parse_wheel_filename(path.name)
        key = canonical(wheel_name)
        if key in wheels:
            problems.append(f"{key} is there twice ({wheels[key]} and {version}): keep one")
        wheels[key] = version
        if not wheel_tags & ok_tags:
            problems.append(f"{path.name} does not install on CPython {python_version} x86_64")
        _, _, lines = wheel_requirements(path)
        requires += [(line, path.name, set()) for line in lines]
    local = set()
    for relative, chosen in INSTALL:
        project, lines = project_requirements(ROOT / relative, chosen)
        local.add(canonical(project))
        requires += [(line, project, set(chosen)) for line in lines]
    major, minor = python_version.split(".")[:2]
    environment = {
        "python_version": f"{major}.{minor}",
        "python_full_version": f"{major}.{minor}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
    }
    for line, who, extras in requires:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker and not any(
            marker.evaluate({**environment, "extra": extra}) for extra in (extras or {""})
        ):
            continue
        key = canonical(requirement.name)
        if key in local:
            continue  # one of the radixlm packages installed from the checkout
        if key in wheels:
            if wheels[key] not in requirement.specifier:
                problems.append(f"{who} needs {line}; the folder has {key} {wheels[key]}")
        elif key in GPU_IMAGE:
            known = GPU_IMAGE[key]
            if known and Version(known) not in requirement.specifier:
                problems.append(f"{who} needs {line}; the GPU image has {key} {known}")
        else:
            problems.append(f"{who} needs {line}: neither in the folder nor on the GPU image")
    return sorted(set(problems))


def cmd_missing_wheels(args: argparse.Namespace) -> int:
    """The wheels in the folder whose distributions this interpreter does not have at all (what
    run.sh installs without resolving when pip cannot resolve from the folder alone)."""
    for path in sorted(Path(args.folder).glob("*.whl")):
        distribution = path.name.split("-", 1)[0]
        if version_of(distribution) is None:
            print(path)
    return 0


def cmd_check_wheels(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    problems = check_wheels(folder, args.python_version)
    count = len(list(folder.glob("*.whl")))
    size = sum(p.stat().st_size for p in folder.glob("*.whl")) / 1e6
    if problems:
        print(f"{folder}: {len(problems)} problem(s):")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"{folder}: {count} wheels, {size:.1f} MB; with the GPU image they cover every")
    print("dependency of " + ", ".join(f"{p}[{','.join(e)}]" if e else p for p, e in INSTALL))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="versions, the CUDA device, what imports")
    report.add_argument("--json", help="also write the report here")
    report.add_argument("--require-cuda", action="store_true", help="exit 1 without CUDA")
    sub.add_parser("pins", help="torch/triton/transformers==installed, one a line")
    sub.add_parser("site-dirs", help="this interpreter's site-packages folders")
    check = sub.add_parser("check-wheels", help="the wheels folder covers what run.sh installs")
    check.add_argument("folder")
    check.add_argument("--python-version", default="3.12")
    missing = sub.add_parser("missing-wheels", help="the wheels of what is not installed")
    missing.add_argument("folder")
    args = parser.parse_args()
    commands = {
        "report": cmd_report,
        "pins": cmd_pins,
        "site-dirs": cmd_site_dirs,
        "check-wheels": cmd_check_wheels,
        "missing-wheels": cmd_missing_wheels,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
