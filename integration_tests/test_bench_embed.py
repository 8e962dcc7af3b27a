"""tools/bench/embed_bench.py runs: its --quick mode (a tiny BERT, a few inputs) times radixlm
and sentence-transformers side by side and prints both and their ratio (not its figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench" / "embed_bench.py"


def test_quick_run_prints_both_systems_and_their_ratio() -> None:
    # A process of its own: the tool sets torch's thread count.
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--cross-encoder"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    assert "radixlm/s" in header and "ST/s" in header and "ratio" in header
    result = json.loads(lines[-1])
    assert [row["workload"] for row in result["rows"]] == ["short", "long", "rerank"]
    for row in result["rows"]:
        assert row["radixlm_per_s"] > 0 and row["st_per_s"] > 0
        assert row["ratio"] == row["radixlm_per_s"] / row["st_per_s"]
        # The two systems computed the same vectors (scores), so the timings compare.
        assert row["max_abs_diff"] < 1e-4
    assert result["cpu"]  # the CPU model and whether it has AVX-512
