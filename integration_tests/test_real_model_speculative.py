"""Speculative decoding on the real SmolLM2-135M-Instruct: greedy outputs equal to decoding
without it, alone and batched, with and without a grammar — NGRAM drafts on the int4 model,
and STANDALONE drafts of the int4 copy on the float32 model; and the spec bench runs.

The engines run in deterministic mode, where equal is guaranteed: a verify step's rows get
the bits a decode's row gets. Without it, they attend in another order (on AVX-512 the C
kernels take several rows' query vectors across the lanes), and the int4 model's int8
activations turn such a last-bit difference into logits up to ~0.2 nats apart, which tips
SmolLM2's near ties one way or the other, by machine (a CI machine tipped one)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine, smollm2_gguf_path

pytestmark = pytest.mark.real_model
ASKS = (
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "Rewrite `def add(a, b): return a + b` with `a` renamed to `x`.",
    "What is the capital of France?",
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}


def _outputs(engine: Engine, texts: list[str], params: dict[str, Any]) -> list[list[int]]:
    """The first text alone, then all of them batched."""
    alone = engine.generate(texts[0], params)["output_ids"]
    batched = [out["output_ids"] for out in engine.generate(texts, params)]
    return [alone, *batched]


FP32 = {"quantization": "none", "dtype": "float32"}
SETUPS = {
    "ngram": ({}, {"speculative_algorithm": "NGRAM"}),
    "standalone": (
        FP32,
        {
            **FP32,
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": "smollm2",
            "speculative_draft_model_quantization": "gguf",
        },
    ),
}


@pytest.mark.parametrize("algorithm", list(SETUPS))
def test_greedy_outputs_are_unchanged_by_drafts(algorithm: str) -> None:
    tokens = 48 if algorithm == "ngram" else 16  # the float32 model decodes slower
    cases = [
        {"temperature": 0.0, "max_new_tokens": tokens},
        {"temperature": 0.0, "max_new_tokens": tokens, "json_schema": json.dumps(SCHEMA)},
    ]
    results = {}
    for spec, extra in enumerate(SETUPS[algorithm]):
        with Engine(
            smollm2_gguf_path(),
            cpu_threads=1,
            show_progress=False,
            enable_deterministic_inference=True,
            **extra,
        ) as engine:
            texts = [
                engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
                )
                for ask in ASKS
            ]
            results[spec] = [_outputs(engine, texts, case) for case in cases]
            if spec:
                info = engine.get_server_info()
                assert info["speculative_algorithm"] == algorithm.upper()
                assert info["spec_accepted_tokens"] > 0
                assert info["avg_spec_accept_length"] > 1.0
                engine.check_invariants()
    assert results[1] == results[0]


def test_spec_bench_runs(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools" / "bench"))
    bench = importlib.import_module("spec_bench")
    out = tmp_path / "spec.json"
    # One algorithm: the two share the bench's code (and four engines would take a minute).
    args = ["--algorithms", "ngram", "--batches", "2", "--workloads", "code",
            "--new-tokens", "8", "--repeats", "1", "--prompts", "2", "--deterministic",
            "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0  # 0: the outputs with and without drafts are the same
    rows = json.loads(out.read_text())["rows"]
    assert [(r["algorithm"], r["batch"]) for r in rows] == [("ngram", 2)]
    assert all(r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 for r in rows)
