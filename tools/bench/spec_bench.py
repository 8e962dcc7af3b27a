#!/usr/bin/env python3
"""Speculative decoding on the real SmolLM2-135M-Instruct: decode tok/s and acceptance length
side by side with no speculation, at batch 1, 4 and 16, greedy, one CPU thread, on workloads
whose answers repeat their prompts: code edits (rewrite a function of this repository with a
name changed) and summaries that quote the text.

- `ngram`: `--speculative-algorithm NGRAM` on the built-in model (the package's Q4_1 GGUF,
  int4 weights), against the same model without drafts.
- `standalone`: `--speculative-algorithm STANDALONE` on the float32 model (the GGUF
  dequantized), its int4 copy (the GGUF's own 4-bit weights) as the draft, against the
  float32 model without drafts.

Each pair of engines is loaded at once and their runs alternate (the best of `--repeats`).
Each case runs at least `--prompts` prompts (4), B requests at once, one group after
another, each group on a flushed cache (so NGRAM's drafts come from the requests' own
tokens, never from an earlier run's answers), first with max_new_tokens 1 (the prefill
alone) and then with the full budget; decode tok/s is the tokens after the first over the
sum of the differences of the two times (one prompt's answer alone would make batch 1 a
matter of what that one answer happens to repeat). The greedy outputs of the two engines are
compared token by token (they must be equal). `--deterministic` runs both engines with
`enable_deterministic_inference`, where equal is guaranteed; without it a verify step's rows
attend in another order than a decode's row (on AVX-512), and the int4 model's int8
activations can turn that last-bit difference into a tipped near tie.

    .venv/bin/python tools/bench/spec_bench.py                         # ~35 min on one core
    .venv/bin/python tools/bench/spec_bench.py --batches 1 --new-tokens 64 --workloads code
    .venv/bin/python tools/bench/spec_bench.py --algorithms standalone
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from quant_quality import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "packages").glob("*/src/radixlm/*/*.py"))
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _functions(count: int) -> list[str]:
    """Short top-level functions of this repository's own source (12-40 lines)."""
    import ast

    found: list[str] = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if 12 <= size <= 40 and node.args.args:
                    found.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            if len(found) == count:
                return found
    return found


def _passages(count: int) -> list[str]:
    """Paragraphs of the documentation (300-900 characters)."""
    found: list[str] = []
    for path in DOCS:
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            block = block.strip()
            if 300 <= len(block) <= 900 and not block.startswith(("|", "```", "#", "<")):
                found.append(block)
                if len(found) == count:
                    return found
    return found


def prompts(workload: str, count: int, tokenizer: Any) -> list[str]:
    if workload == "code":
        asks = [
            f"Rewrite this Python function with its first argument renamed to `item`. "
            f"Reply with the whole function only.\n\n```python\n{code}\n```"
            for code in _functions(count)
        ]
    else:
        asks = [
            "Summarise the text below in three sentences, quoting its most important "
            f"sentence word for word.\n\n{text}"
            for text in _passages(count)
        ]
    if len(asks) < count:
        raise SystemExit(f"only {len(asks)} {workload} prompts found; need {count}")
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
        )
        for ask in asks
    ]


def run_case(engine: Any, texts: list[str], batch: int, new_tokens: int) -> dict[str, Any]:
    """`texts` in groups of `batch` requests at once, one group after another: decode tok/s
    over all of them (each group's prefill timed alone first and left out)."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens}
    before = engine.get_server_info()
    outputs: list[list[int]] = []
    decode = 0.0
    for at in range(0, len(texts), batch):
        group = texts[at : at + batch]
        engine.flush_cache()
        start = time.perf_counter()
        engine.generate(group, {**params, "max_new_tokens": 1})
        prefill = time.perf_counter() - start
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(group, params)
        decode += max(time.perf_counter() - start - prefill, 1e-9)
        outputs += [o["output_ids"] for o in outs]
    after = engine.get_server_info()
    tokens = sum(len(o) for o in outputs)
    steps = after["spec_verify_steps"] - before["spec_verify_steps"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {
        "outputs": outputs,
        "tokens": tokens,
        "decode_tok_s": (tokens - len(texts)) / decode,
        "accept_length": (accepted + steps) / steps if steps else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--workloads", default="code,summary")
    parser.add_argument("--algorithms", default="ngram,standalone")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--prompts",
        type=int,
        default=4,
        help="at least this many prompts per case, in groups of the batch",
    )
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2, help="alternated runs, best kept")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="both engines with enable_deterministic_inference (outputs equal by construction)",
    )
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    workloads = args.workloads.split(",")

    from radixlm.runtime import Engine, smollm2_gguf_path

    path = smollm2_gguf_path()
    common: dict[str, Any] = {"cpu_threads": 1, "show_progress": False}
    if args.deterministic:
        common["enable_deterministic_inference"] = True
    spec: dict[str, Any] = {"speculative_num_draft_tokens": args.num_draft_tokens}
    if args.disable_by_batch_size is not None:
        spec["speculative_disable_by_batch_size"] = args.disable_by_batch_size
    fp32 = {"quantization": "none", "dtype": "float32"}
    setups = {
        "ngram": ({}, {"speculative_algorithm": "NGRAM"}),
        "standalone": (
            fp32,
            {
                **fp32,
                "speculative_algorithm": "STANDALONE",
                "speculative_draft_model_path": path,
                "speculative_draft_model_quantization": "gguf",
            },
        ),
    }
    print(f"SmolLM2-135M-Instruct, one thread, {cpu_flags()}; greedy, {args.new_tokens} new "
          f"tokens per request, {args.num_draft_tokens} tokens per verify step"
          f"{', deterministic' if args.deterministic else ''}")  # fmt: skip
    print("ngram: int4 (Q4_1 GGUF) with and without NGRAM drafts; standalone: float32 with "
          "and without drafts of its int4 copy")  # fmt: skip
    print(f"{'algorithm':10} {'workload':9} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} "
          f"{'ratio':>6} {'accept len':>10} {'same output':>11}")  # fmt: skip
    rows = []
    for algorithm in args.algorithms.split(","):
        plain_kwargs, spec_kwargs = setups[algorithm]
        results: dict[str, dict[tuple[str, int], dict[str, Any]]] = {"plain": {}, "spec": {}}
        # Both engines at once, their runs alternated (--repeats times, the best kept): a
        # shared machine's load then falls on both alike.
        with (
            Engine(path, **common, **plain_kwargs) as plain,
            Engine(path, **common, **spec, **spec_kwargs) as fast,
        ):
            engines = {"plain": plain, "spec": fast}
            for workload in workloads:
                for batch in batches:
                    key = (workload, batch)
                    count = -(-max(batch, args.prompts) // batch) * batch
                    texts = prompts(workload, count, plain.tokenizer)
                    for engine in engines.values():
                        run_case(engine, texts[:1], 1, 4)  # warm-up
                    for _ in range(args.repeats):
                        for name, engine in engines.items():
                            got = run_case(engine, texts, batch, args.new_tokens)
                            best = results[name].get(key)
                            if best is None or got["decode_tok_s"] > best["decode_tok_s"]:
                                results[name][key] = got
        for (workload, batch), base in results["plain"].items():
            quick = results["spec"][(workload, batch)]
            same = base["outputs"] == quick["outputs"]
            ratio = quick["decode_tok_s"] / base["decode_tok_s"]
            length = quick["accept_length"]
            print(f"{algorithm:10} {workload:9} {batch:>5} {base['decode_tok_s']:>12.1f} "
                  f"{quick['decode_tok_s']:>11.1f} {ratio:>5.2f}x "
                  f"{length if length is not None else float('nan'):>10.2f} "
                  f"{'yes' if same else 'NO':>11}", flush=True)  # fmt: skip
            rows.append(
                {
                    "algorithm": algorithm,
                    "workload": workload,
                    "batch": batch,
                    "plain_tok_s": base["decode_tok_s"],
                    "spec_tok_s": quick["decode_tok_s"],
                    "ratio": ratio,
                    "accept_length": length,
                    "same_output": same,
                }
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_flags(), "rows": rows}, indent=2))
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
