#!/usr/bin/env python3
"""What deterministic (batch-invariant) inference costs: throughput of the real
SmolLM2-135M-Instruct with and without `enable_deterministic_inference`, side by side, on a
batch of sampled requests (prompts of 60-400 tokens from this repository's docs, a fixed
number of new tokens each, all sent at once), for the built-in int4 model (the package's
Q4_1 GGUF) and its float32 form. Both engines of a format are loaded at once and their runs
alternate (the best of `--repeats`); each run starts on a flushed cache. Also checks that the
deterministic engine gives one request the same tokens and logprobs alone and in the batch.

    .venv/bin/python tools/bench/deterministic_bench.py                 # ~6 min on one core
    .venv/bin/python tools/bench/deterministic_bench.py --formats int4 --requests 8
    .venv/bin/python tools/bench/deterministic_bench.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from quant_quality import cpu_flags

ROOT = Path(__file__).resolve().parents[2]

FORMATS: dict[str, dict[str, Any]] = {
    "int4": {},  # the built-in model: the GGUF's 4-bit weights, float32 compute
    "fp32": {"quantization": "none", "dtype": "float32"},
}


def prompts(count: int, tokenizer: Any, seed: int = 0) -> list[list[int]]:
    """`count` token prompts of 60-400 tokens cut from the docs' text."""
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        length = rng.randrange(60, 400)
        start = rng.randrange(0, len(ids) - length)
        found.append(ids[start : start + length])
    return found


def run(engine: Any, batch: list[list[int]], new_tokens: int) -> tuple[float, list[Any]]:
    params = {"temperature": 0.8, "max_new_tokens": new_tokens, "ignore_eos": True, "seed": 7}
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True)
    return time.perf_counter() - start, outs


def _result(out: dict[str, Any]) -> tuple[Any, Any]:
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int4,fp32")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from radixlm.runtime import Engine, smollm2_gguf_path

    path = smollm2_gguf_path()
    common: dict[str, Any] = {"cpu_threads": args.threads, "show_progress": False}
    print(f"SmolLM2-135M-Instruct, {args.threads} thread(s), {cpu_flags()}; {args.requests} "
          f"requests at once, prompts of 60-400 tokens, {args.new_tokens} sampled tokens each")  # fmt: skip
    print(f"{'format':6} {'default s':>10} {'deterministic s':>16} {'default tok/s':>14} "
          f"{'determ. tok/s':>14} {'cost':>6} {'invariant':>9}")  # fmt: skip
    rows = []
    for name in args.formats.split(","):
        kwargs = FORMATS[name]
        with (
            Engine(path, **common, **kwargs) as default,
            Engine(path, **common, **kwargs, enable_deterministic_inference=True) as determ,
        ):
            batch = prompts(args.requests, default.tokenizer)
            best = {"default": float("inf"), "deterministic": float("inf")}
            outs: list[Any] = []
            for _ in range(args.repeats):
                for label, engine in (("default", default), ("deterministic", determ)):
                    seconds, got = run(engine, batch, args.new_tokens)
                    best[label] = min(best[label], seconds)
                    if label == "deterministic":
                        outs = got
            # One request alone on the deterministic engine: the same bits as in the batch.
            _, alone = run(determ, batch[:1], args.new_tokens)
            invariant = _result(alone[0]) == _result(outs[0])
        tokens = args.requests * args.new_tokens
        row = {
            "format": name,
            "threads": args.threads,
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "default_s": best["default"],
            "deterministic_s": best["deterministic"],
            "default_tok_s": tokens / best["default"],
            "deterministic_tok_s": tokens / best["deterministic"],
            "cost": 1 - best["default"] / best["deterministic"],
            "invariant": invariant,
        }
        rows.append(row)
        print(f"{name:6} {row['default_s']:10.2f} {row['deterministic_s']:16.2f} "
              f"{row['default_tok_s']:14.1f} {row['deterministic_tok_s']:14.1f} "
              f"{row['cost']:6.1%} {'yes' if invariant else 'NO':>9}")  # fmt: skip
    print("cost: 1 - deterministic throughput / default throughput (goal <= 20 %)")
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_flags(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
