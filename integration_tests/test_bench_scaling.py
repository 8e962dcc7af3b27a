"""tools/bench/scaling.py and tools/bench/step_overhead.py in their quickest modes: the sweeps
against the server's toy engine, the step clock on the tiny model, the figures and plots they
write. The wiring only; the speeds are the benchmarks' business."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCH))


def test_prompt_lengths_double_from_256_up_to_what_the_context_holds(bench: Any) -> None:
    scaling = bench("scaling")
    assert scaling.prompt_lengths(4096, 32) == (256, 512, 1024, 2048, 4064)
    assert scaling.prompt_lengths(1024, 24) == (256, 512, 1000)
    assert scaling.prompt_lengths(200, 8) == ()


def test_prompts_have_exactly_the_asked_number_of_tokens(bench: Any, tmp_path: Path) -> None:
    scaling = bench("scaling")
    from _common import id_tokenizer

    tokenizer = id_tokenizer(tmp_path, 3000)
    point = scaling.Point("prompt_len", 2, 300, 3)
    prompts = scaling.prompts_for(point, tokenizer, 3000, 8, seed=1)
    assert len(prompts) == 3 and len({p.user for p in prompts}) == 3
    # serve_bench strips a completions prompt before sending it; the count must survive that.
    for prompt in prompts:
        sent = f"{prompt.system}\n{prompt.user}".strip()
        assert len(tokenizer.encode(sent, add_special_tokens=False)) == 300


def test_scaling_sweeps_the_toy_server_and_writes_figures_and_plots(
    bench: Any, tmp_path: Path
) -> None:
    scaling = bench("scaling")
    out, img = tmp_path / "out", tmp_path / "img"
    argv = ["--fake", "--quick", "--context", "1024", "--concurrency", "1,4"]
    assert scaling.main([*argv, "--out", str(out), "--img", str(img)]) == 0
    saved = json.loads((out / "scaling.json").read_text())
    rows = saved["rows"]
    assert [(r["sweep"], r["concurrency"], r["prompt_len"], r["requests"]) for r in rows] == [
        ("concurrency", 1, 256, 2),
        ("concurrency", 4, 256, 4),
        ("prompt_len", 2, 256, 2),
        ("prompt_len", 2, 512, 2),
        ("prompt_len", 2, 1016, 2),
    ]
    for row in rows:
        assert row["failed"] == 0 and row["completed"] == row["requests"] and row["repeats"] == 1
        assert row["request_throughput"] > 0 and row["output_tok_s"] > 0
        assert 0 < row["p50_ttft_ms"] <= row["p99_ttft_ms"]
        assert row["p50_itl_ms"] <= row["p99_itl_ms"]
    assert saved["meta"]["plan"]["output_len"] == 8 and saved["meta"]["machine"]["cores"]
    for folder in (out, img):
        names = sorted(p.name for p in folder.glob("*.png"))
        assert names == ["scaling_concurrency.png", "scaling_prompt_len.png"]
        assert all((folder / n).stat().st_size > 5000 for n in names)


def test_repeats_are_summed_as_medians_with_their_spread(bench: Any) -> None:
    scaling = bench("scaling")
    base = {"sweep": "concurrency", "concurrency": 4, "prompt_len": 256, "requests": 4,
            "failed": 0, "completed": 4, "first_error": ""}  # fmt: skip
    runs = [
        {**base, "server": "transformers", "repeat": 0, "request_throughput": 1.0},
        {**base, "server": "radixlm", "repeat": 0, "request_throughput": 3.0},
        {**base, "server": "radixlm", "repeat": 1, "request_throughput": 5.0, "failed": 1,
         "completed": 3, "first_error": "HTTP 500"},
        {**base, "server": "radixlm", "repeat": 2, "request_throughput": 4.5},
    ]  # fmt: skip
    first, second = scaling.aggregate(runs)
    assert first["server"] == "transformers" and first["repeats"] == 1
    assert second["request_throughput"] == 4.5 and second["repeats"] == 3
    assert (second["request_throughput_min"], second["request_throughput_max"]) == (3.0, 5.0)
    assert (second["completed"], second["failed"]) == (11, 1)
    assert second["first_error"] == "HTTP 500" and "repeat" not in second


def test_scaling_redraws_plots_from_saved_figures(bench: Any, tmp_path: Path) -> None:
    scaling = bench("scaling")
    row = {"server": "radixlm", "sweep": "concurrency", "prompt_len": 256, "requests": 4,
           "failed": 0, "completed": 4}  # fmt: skip
    rows = []
    for c, speed in ((1, 1.0), (4, 3.0), (16, 5.0)):
        metrics = dict.fromkeys(scaling.METRICS, speed)
        rows.append({**row, "concurrency": c, **metrics})
    saved = tmp_path / "scaling.json"
    meta = {"shape_name": "tiny", "shape_text": "Qwen2"}
    saved.write_text(json.dumps({"meta": meta, "rows": rows}))
    assert scaling.main(["--from-json", str(saved), "--out", str(tmp_path / "plots")]) == 0
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["scaling_concurrency.png"]


def test_step_overhead_times_full_decode_steps_around_the_forward(
    bench: Any, tmp_path: Path
) -> None:
    step_overhead = bench("step_overhead")
    figures = tmp_path / "steps.json"
    argv = ["--quick", "--batch-sizes", "1,4", "--new-tokens", "6", "--json", str(figures)]
    assert step_overhead.main(argv) == 0
    saved = json.loads(figures.read_text())
    rows = saved["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        (mode, batch) for mode in step_overhead.MODES for batch in (1, 4)
    ]
    for row in rows:
        assert row["decode_steps"] == 5  # 6 tokens: the first comes from the prefill step
        assert row["step_us"] > row["forward_us"] > 0
        assert row["outside_forward_us"] > row["sample_us"] > 0
        assert row["outside_forward_per_request_us"] == pytest.approx(
            row["outside_forward_us"] / row["batch"]
        )
    # Two batch sizes give each mode a line: a cost per step and one per running request.
    assert [f["mode"] for f in saved["fits"]] == list(step_overhead.MODES)
