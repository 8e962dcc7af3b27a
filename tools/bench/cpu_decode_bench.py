#!/usr/bin/env python3
"""The CPU decode path (`radixlm.runtime.cpu_decode`: every decoder layer of a decode step in
one C call) against the model's own per-layer forward, on the real SmolLM2-135M-Instruct, one
thread: milliseconds per decode step (the model's forward and LM head, not the scheduler) at
batch sizes B and context lengths L, side by side on the same runner and KV pool.

Each case gives B requests L cached tokens (random K/V written into the pool: a context's
cost does not depend on its values), then times `--steps` decode steps
through each path in turn (the best of --repeats). Formats: the GGUF file's own Q4_1 blocks
(int4), `--quantization int8` of its dequantized weights, and fp32 (`--quantization none`:
the file dequantized). For fp32 the per-layer figure comes from a second runner built on two
threads, whose layers keep their oneDNN-packed weights (the C path's runner multiplies the
plain ones), run on one thread: the per-layer forward as it runs without the path.

    .venv/bin/python tools/bench/cpu_decode_bench.py                  # ~2 min on one core
    .venv/bin/python tools/bench/cpu_decode_bench.py --batches 1,8 --contexts 128,2048

`--shared-prefix`: the batch's requests share their first L tokens' slots (as the radix
cache shares a cached prefix; the C path's attention then reads its keys once for all of
them), each with OWN_TOKENS of its own after them (a few-shot prompt's question):

    .venv/bin/python tools/bench/cpu_decode_bench.py --formats fp32 --batches 8,32 \
        --contexts 1520 --shared-prefix
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


def build_runner(
    quantization: str | None, max_tokens: int, max_batch: int, threads: int = 1
) -> Any:
    import torch

    from radixlm.runtime import (
        MemoryConfig,
        ModelConfig,
        ModelRunner,
        RunnerConfig,
        smollm2_gguf_path,
    )

    # float32 said: every format compares float32 activations (on AVX512-BF16 CPUs "auto"
    # would keep the dequantized fp32 pairing's weights in bfloat16).
    fields: dict[str, Any] = {"dtype": "float32"}
    if quantization:
        fields["quantization"] = quantization
    torch.set_num_threads(threads)
    try:
        return ModelRunner(
            RunnerConfig(
                model=ModelConfig(str(smollm2_gguf_path()), show_progress=False, **fields),
                memory=MemoryConfig(max_total_tokens=max_tokens, max_running_requests=max_batch),
            )
        )
    finally:
        torch.set_num_threads(1)


#: Tokens of its own each request has after a shared prefix (`--shared-prefix`).
OWN_TOKENS = 20


def tokens_needed(batch: int, context: int, steps: int, shared: bool) -> int:
    """KV slots a case takes: each request's context and steps, or with `shared` the prefix
    once and each request's OWN_TOKENS and steps."""
    if shared:
        return context + batch * (OWN_TOKENS + steps)
    return batch * (context + steps)


def measure(runner: Any, batch: int, context: int, steps: int, repeats: int,
            baseline: Any = None, shared: bool = False) -> dict[str, float]:  # fmt: skip
    """ms per decode step through each path, for `batch` requests at `context` tokens (the
    per-layer one on `baseline` when given, a runner of the same model without the path);
    `shared`: the requests share those tokens' slots, and have OWN_TOKENS each after them."""
    if baseline is not None:
        fast = _measure(runner, batch, context, steps, repeats, shared)
        plain = _measure(baseline, batch, context, steps, repeats, shared)
        return {"c_path": fast["c_path"], "per_layer": plain["per_layer"]}
    return _measure(runner, batch, context, steps, repeats, shared)


def _measure(runner: Any, batch: int, context: int, steps: int, repeats: int,
             shared: bool = False) -> dict[str, float]:  # fmt: skip
    import torch

    from radixlm.runtime import BatchEntry, ForwardBatch

    rng = random.Random(batch * 100_003 + context)
    vocab = runner.vocab_size
    table = runner.req_to_token_pool.req_to_token
    pool = runner.kv_pool
    rows, slots, owned = [], [], []
    prefix = pool.alloc(context) if shared else []
    assert prefix is not None
    own = OWN_TOKENS if shared else context
    for index in range(batch):
        row = runner.req_to_token_pool.alloc()
        mine = pool.alloc(own + steps)
        assert row is not None and mine is not None
        given = list(prefix) + list(mine)
        rows.append(row)
        slots.append(given)
        owned.append(mine)
        # A context's cost does not depend on its values: random K/V stand for a prefill
        # (the shared prefix's written once).
        table[row, : len(prefix) + own] = torch.tensor(given[: len(prefix) + own]).to(table.dtype)
        fresh = torch.tensor(given[: len(prefix) + own] if index == 0 else mine[:own])
        for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True):
            k[fresh] = torch.randn(len(fresh), *k.shape[1:], dtype=k.dtype)
            v[fresh] = torch.randn(len(fresh), *v.shape[1:], dtype=v.dtype)
    context = len(prefix) + own
    path = runner.cpu_decode
    batches = [
        ForwardBatch.build(
            [BatchEntry(row, [rng.randrange(3, vocab)], context + i, s[context + i : context + i + 1])
             for row, s in zip(rows, slots, strict=True)],
            table,
        )
        for i in range(steps)
    ]  # fmt: skip
    out: dict[str, float] = {}
    for name, active in (("c_path", path), ("per_layer", None)):
        if name == "c_path" and path is None:
            continue
        runner.cpu_decode = active
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for forward_batch in batches:
                runner.forward(forward_batch)
            best = min(best, (time.perf_counter() - start) / steps)
        out[name] = best * 1e3
    runner.cpu_decode = path
    for row, mine in zip(rows, owned, strict=True):
        runner.kv_pool.free(mine)
        runner.req_to_token_pool.free(row)
    if prefix:
        runner.kv_pool.free(prefix)
    torch.set_num_threads(1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,16", help="decode batch sizes")
    parser.add_argument("--contexts", default="128,2048", help="tokens in each request's context")
    parser.add_argument(
        "--formats", default="int4,int8,fp32", help="int4 (the Q4_1 file), int8, fp32"
    )
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--shared-prefix",
        action="store_true",
        help=f"the requests share their first L tokens, {OWN_TOKENS} of their own after them",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.formats = [f for f in args.formats.split(",") if f]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    for fmt in args.formats:
        most = (max(args.batches), max(args.contexts), args.steps, args.shared_prefix)
        need = tokens_needed(*most) + 64
        quantization = {"int4": None, "fp32": "none"}.get(fmt, fmt)
        runner = build_runner(quantization, need, max(args.batches))
        baseline = (
            build_runner(quantization, need, max(args.batches), threads=2)
            if fmt == "fp32"
            else None
        )
        if runner.cpu_decode is None:
            print(f"{fmt}: the CPU decode path is off here (see the log); nothing to compare")
            continue
        for context in args.contexts:
            for batch in args.batches:
                fits = tokens_needed(batch, context, args.steps, args.shared_prefix)
                if fits > runner.kv_pool.available:
                    print(f"  {fmt} B={batch} L={context}: more tokens than the KV pool holds "
                          f"({runner.kv_pool.available}); skipped")  # fmt: skip
                    continue
                times = measure(runner, batch, context, args.steps, args.repeats, baseline,
                                args.shared_prefix)  # fmt: skip
                row = {"format": fmt, "batch": batch, "context": context, **times,
                       "speedup": times["per_layer"] / times["c_path"]}  # fmt: skip
                rows.append(row)
                print(f"  {fmt} B={batch:<3d} L={context:<5d} C path {times['c_path']:7.2f} ms  "
                      f"per layer {times['per_layer']:7.2f} ms  {row['speedup']:.2f}x",
                      flush=True)  # fmt: skip
    print()
    shared = f"; L tokens shared, {OWN_TOKENS} each of their own" if args.shared_prefix else ""
    print(f"SmolLM2-135M-Instruct decode step, one thread{shared}; CPU: {cpu_flags()}")
    head = f"{'format':7s} {'B':>3s} {'L':>5s} {'C path ms':>10s} {'per-layer ms':>13s} {'x':>6s}"
    print(head)
    print("-" * len(head))
    for row in rows:
        print(f"{row['format']:7s} {row['batch']:3d} {row['context']:5d} {row['c_path']:10.2f} "
              f"{row['per_layer']:13.2f} {row['speedup']:5.2f}x")  # fmt: skip
    if args.json:
        figures = {"cpu": cpu_flags(), "shared_prefix": args.shared_prefix, "rows": rows}
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
