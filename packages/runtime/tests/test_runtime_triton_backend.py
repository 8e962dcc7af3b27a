"""The triton attention backend (Triton's interpreter on CPU) agrees with torch_native."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "runtime_triton_check.py"


@pytest.mark.timeout(300)
def test_triton_backend_agrees_with_torch_native_on_a_mixed_batch(tmp_path: Path) -> None:
    # A subprocess: TRITON_INTERPRET must be set before the kernels are defined.
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["triton_ran"]
    assert result["windows"] == [None, 5]
    assert result["scale"] > 0
    assert result["max_abs_diff"] <= 1e-4
