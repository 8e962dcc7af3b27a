"""tools/gpu/run.sh, the one command for a GPU machine, in its --dry-run mode on this CPU: every
step runs (the GPU tests skip, the benchmarks run tiny) and reports ok, the figures land in one
folder that the device tool can bring back; and the wheels-folder check of tools/gpu/environment.py
on stand-in wheels."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tools" / "gpu" / "run.sh"
STEPS = [
    "env",
    "install",
    "pytest-kernels",
    "pytest-runtime",
    "kernels-bench",
    "engine-graphs",
    "engine-eager",
    "tp-bench",
    "moe-bench",
]


@pytest.fixture(scope="module")
def dry_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One dry run into $OUT, as under the device tool (there the logs are packed)."""
    out = tmp_path_factory.mktemp("gpu-out")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(RUN), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    return out, done


def _summary(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def test_dry_run_runs_every_step_and_each_is_ok(
    dry_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, done = dry_run
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    steps = _summary(out)["steps"]
    assert [s["name"] for s in steps] == STEPS
    assert {s["name"]: s["status"] for s in steps} == dict.fromkeys(STEPS, "ok")
    assert _summary(out)["mode"] == "dry-run"


def test_the_summary_table_is_printed_and_written(
    dry_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, done = dry_run
    for name in STEPS:
        assert re.search(rf"^{re.escape(name)}\s+\d+\.\d\s+ok$", done.stdout, re.M), name
    text = (out / "summary.md").read_text()
    assert "| step | seconds | status | limit (s) | log |" in text
    for name in STEPS:
        assert f"| {name} | " in text


def test_the_figures_land_in_the_output_folder(
    dry_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = dry_run
    env = json.loads((out / "env.json").read_text())
    assert env["versions"]["torch"]
    kernels = json.loads((out / "kernels.json").read_text())
    assert {"decode", "extend", "store_kv", "rms_norm", "sample"} <= {r["op"] for r in kernels}
    assert "sdpa" in {r["impl"] for r in kernels}
    graphs = json.loads((out / "engine-graphs.json").read_text())
    assert {r["system"] for r in graphs} == {"radixlm", "transformers"}
    eager = json.loads((out / "engine-eager.json").read_text())
    assert [r["system"] for r in eager] == ["radixlm"]
    assert "graph_replays=0" in eager[0]["extra"]  # never on a CPU; the flag reached the engine
    tp = json.loads((out / "tp.json").read_text())
    assert [r["tp_size"] for r in tp["rows"]] == [1, 2]
    assert [r["rank"] for r in tp["rows"][1]["ranks"]] == [0, 1]
    summary = _summary(out)
    assert summary["tp"]["rows"] == tp["rows"]
    assert "## Tensor parallelism" in (out / "summary.md").read_text()
    assert set(summary["engine"]) == {"graphs", "eager"}
    assert set(summary["tests"]) == {"pytest-kernels", "pytest-runtime"}
    assert summary["tests"]["pytest-kernels"]["skipped"] > 0  # the GPU tests, on a CPU


def test_the_moe_figures_travel_in_the_archive(
    dry_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = dry_run
    assert not (out / "moe.json").exists()  # packed: the tool's 8 files are taken
    with tarfile.open(out / "logs.tar.gz") as archive:
        member = archive.extractfile("moe.json")
        assert member is not None
        moe = json.loads(member.read())
    assert [r["batch"] for r in moe["rows"]] == [1, 4]
    systems = {"fused", "loop", "transformers", "transformers-loop"}
    assert all(set(r["decode_tok_s"]) == systems for r in moe["rows"])
    assert moe["moe_blocks"] == 2  # the per-expert loop went into both layers' blocks
    assert moe["fused_equals_loop"] is True  # greedy float32: the same token ids


def test_what_comes_back_fits_the_device_tool(
    dry_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files  # the tool brings back at most 8 files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in files)
    assert all((out / name).is_file() for name in files)
    with tarfile.open(out / "logs.tar.gz") as archive:
        logs = set(archive.getnames())
    assert {f"{name}.log" for name in STEPS} <= logs


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(RUN), "--dry-run", "--steps", "env,benchmark", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "unknown step benchmark" in done.stderr
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ the wheels folder check


@pytest.fixture(scope="module")
def environment() -> Any:
    sys.path.insert(0, str(ROOT / "tools" / "gpu"))
    try:
        yield importlib.import_module("environment")
    finally:
        sys.path.remove(str(ROOT / "tools" / "gpu"))


def _wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any") -> Path:
    """A stand-in wheel: only its METADATA, without requirements."""
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        info = f"{name.replace('-', '_')}-{version}.dist-info"
        archive.writestr(f"{info}/METADATA", f"Name: {name}\nVersion: {version}\n\n")
    return path


def _pinned() -> list[tuple[str, str]]:
    text = (ROOT / "tools" / "gpu" / "requirements.txt").read_text()
    return re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)


def test_the_requirements_cover_what_radixlm_needs_beyond_the_gpu_image(
    environment: Any, tmp_path: Path
) -> None:
    for name, version in _pinned():
        _wheel(tmp_path, name, version)
    assert environment.check_wheels(tmp_path, "3.12") == []


def test_a_missing_dependency_is_named(environment: Any, tmp_path: Path) -> None:
    for name, version in _pinned():
        if name != "dill":
            _wheel(tmp_path, name, version)
    problems = environment.check_wheels(tmp_path, "3.12")
    assert len(problems) == 1
    assert "radixlm-sampling needs dill>=0.3.8" in problems[0]


def test_a_wheel_for_another_python_or_twice_is_refused(environment: Any, tmp_path: Path) -> None:
    for name, version in _pinned():
        _wheel(tmp_path, name, version)
    _wheel(tmp_path, "dill", "0.3.9")
    (tmp_path / "xgrammar-0.2.9-py3-none-any.whl").unlink()
    _wheel(tmp_path, "xgrammar", "0.2.9", "cp311-cp311-manylinux_2_28_x86_64")
    problems = environment.check_wheels(tmp_path, "3.12")
    assert any("dill is there twice" in p for p in problems)
    assert any(p.startswith("xgrammar-0.2.9-cp311") for p in problems)
