"""The shm transfer backend's files: named for the process that wrote them, removed by the
decode side once mapped, and swept at start-up when their process is gone (a prefill engine
killed mid-transfer leaves them behind)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixlm.runtime.disaggregation import ShmBackend


def _dead_pid() -> int:
    """The pid of a process that has exited (and been waited for)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_files_of_a_dead_process_are_swept_at_start_up(tmp_path: Path) -> None:
    dead = tmp_path / f"radixlm-kv-{_dead_pid()}-7-0"
    live = tmp_path / f"radixlm-kv-{os.getpid()}-8-0"
    other = tmp_path / "radixlm-kv-notes.txt"  # not a K/V file: never touched
    for path in (dead, live, other):
        path.write_bytes(b"kv")
    ShmBackend(tmp_path)
    assert not dead.exists()
    assert live.exists() and other.exists()


def test_a_prefill_process_killed_mid_transfer_leaves_a_file_the_next_start_removes(
    tmp_path: Path,
) -> None:
    stage_and_die = (
        "import os, signal, sys\n"
        "from radixlm.runtime.disaggregation import ShmBackend\n"
        "ShmBackend(sys.argv[1]).stage(room=5, nbytes=64)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", stage_and_die, str(tmp_path)], check=False)
    assert child.returncode == -9
    (left,) = tmp_path.iterdir()
    assert left.name.startswith("radixlm-kv-") and "-5-" in left.name
    ShmBackend(tmp_path)
    assert not left.exists()


def test_a_staged_file_is_named_for_its_process_and_removed_once_mapped(tmp_path: Path) -> None:
    prefill, decode = ShmBackend(tmp_path), ShmBackend(tmp_path)
    staged = prefill.stage(room=42, nbytes=16)
    assert staged.location is not None
    assert Path(staged.location).name.startswith(f"radixlm-kv-{os.getpid()}-42-")
    staged.data[:] = 7
    data = decode.open(staged.location, [], 16)
    assert not Path(staged.location).exists()  # nothing left should the prefill side die now
    assert data.tolist() == [7] * 16  # the mapping outlives the file
    prefill.discard(staged)  # (already gone: no error)


def test_the_decode_side_opens_only_k_v_files_of_its_directory(tmp_path: Path) -> None:
    backend = ShmBackend(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    elsewhere = tmp_path / f"radixlm-kv-{os.getpid()}-1-0"
    elsewhere.write_bytes(bytes(4))
    foreign = tmp_path / "shm" / "notes.txt"
    foreign.write_bytes(bytes(4))
    for path in (elsewhere, foreign):
        with pytest.raises(ValueError, match="is not a K/V file"):
            backend.open(str(path), [], 4)
        assert path.exists()
