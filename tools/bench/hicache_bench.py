#!/usr/bin/env python3
"""The hierarchical cache on many tenants whose prefixes outgrow the KV pool: hit rate,
time to first token and throughput with the pool alone (L1), with a host pool (L1+L2), and
with file storage under a small host pool (L1+L2+L3), on the real SmolLM2-135M-Instruct (its
Q4_1 GGUF), one CPU thread.

`--tenants` tenants (32) each have a `--prefix-tokens` prefix (2,000: a long system prompt
or document, real text from this repository's docs) and ask short questions after it; the
KV pool holds `--pool-tenants` prefixes (4). A warm-up round asks each tenant once (every
prefix computed, most evicted); the measured round asks each tenant again in a shuffled
order, one request at a time (TTFT: the first streamed token), then all of them at once
with `--new-tokens` each (throughput: output tokens per second over the round, prefill
included). The L3 setup's host pool holds `--l3-host-tenants` prefixes (4), so most hits
come from storage; `l3-restart` is a fresh engine on the storage the L3 run wrote (its host
pool empty: every hit is a storage read). Recompute TTFT is L1's miss TTFT.

    .venv/bin/python tools/bench/hicache_bench.py              # ~15 min on one core
    .venv/bin/python tools/bench/hicache_bench.py --tenants 8 --prefix-tokens 500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from quant_quality import cpu_flags

ROOT = Path(__file__).resolve().parents[2]


def tenant_prefixes(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` prefixes of `length` tokens: the docs' text, each tenant from its own offset
    with its own first line (so no two share a page)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    out = []
    for tenant in range(count):
        head = tokenizer.encode(f"You are the assistant of tenant {tenant}. Use this text:\n")
        start = (tenant * 997) % max(1, len(ids) - length)
        body = ids[start : start + length - len(head)]
        out.append(head + body)
    return out


def question(tokenizer: Any, rng: random.Random) -> list[int]:
    words = ["cache", "pages", "host", "tokens", "kernel", "router", "grammar", "sampling"]
    return tokenizer.encode(f"\nQuestion: what does it say about {rng.choice(words)}? Answer:")


def run_setup(
    name: str, path: str, kwargs: dict[str, Any], prefixes: list[list[int]], args: Any,
    warm: bool = True,
) -> dict[str, Any]:  # fmt: skip
    from radixlm.runtime import Engine

    rng = random.Random(0)
    one = {"temperature": 0.0, "max_new_tokens": 1}
    with Engine(path, cpu_threads=1, show_progress=False, **kwargs) as engine:
        tokenizer = engine.tokenizer
        if warm:
            for prefix in prefixes:
                engine.generate(input_ids=[prefix + question(tokenizer, rng)], sampling_params=one)
        before = engine.get_server_info()
        order = list(range(len(prefixes)))
        rng.shuffle(order)
        ttfts: list[float] = []
        for tenant in order:
            ids = prefixes[tenant] + question(tokenizer, rng)
            start = time.perf_counter()
            for _chunk in engine.generate(input_ids=ids, sampling_params=one, stream=True):
                ttfts.append(time.perf_counter() - start)
                break
        mid = engine.get_server_info()
        rng.shuffle(order)
        batch = [prefixes[t] + question(tokenizer, rng) for t in order]
        params = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        start = time.perf_counter()
        outs = engine.generate(input_ids=batch, sampling_params=params)
        seconds = time.perf_counter() - start
        after = engine.get_server_info()
    prompt = mid["prompt_tokens"] - before["prompt_tokens"]
    cached = mid["cached_tokens"] - before["cached_tokens"]
    tokens = sum(len(o["output_ids"]) for o in outs)
    row = {
        "setup": name,
        "hit_rate": cached / prompt if prompt else 0.0,
        "host_tokens": mid.get("host_cached_tokens", 0) - before.get("host_cached_tokens", 0),
        "storage_tokens": mid.get("storage_cached_tokens", 0)
        - before.get("storage_cached_tokens", 0),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "throughput_tok_s": tokens / seconds,
        "round_hit_rate": (after["cached_tokens"] - mid["cached_tokens"])
        / max(1, after["prompt_tokens"] - mid["prompt_tokens"]),
    }
    print(
        f"{name:11} {row['hit_rate']:>8.1%} {row['host_tokens']:>8} {row['storage_tokens']:>8} "
        f"{row['ttft_median_s'] * 1e3:>10.0f} {row['ttft_mean_s'] * 1e3:>9.0f} "
        f"{row['throughput_tok_s']:>9.1f} {row['round_hit_rate']:>8.1%}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--pool-tenants", type=int, default=4)
    parser.add_argument("--l3-host-tenants", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--storage-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from radixlm.runtime import Engine, smollm2_gguf_path

    path = smollm2_gguf_path()
    with Engine(path, cpu_threads=1, show_progress=False, max_total_tokens=4096) as probe:
        tokenizer = probe.tokenizer
    prefixes = tenant_prefixes(tokenizer, args.tenants, args.prefix_tokens)
    # Room for `pool_tenants` prefixes and the questions beside them.
    pool = args.pool_tenants * (args.prefix_tokens + 64) + 256
    per_tenant = args.prefix_tokens + 64
    host_all = (args.tenants + 2) * per_tenant / pool
    host_few = args.l3_host_tenants * per_tenant / pool
    storage = args.storage_dir or Path(tempfile.mkdtemp(prefix="radixlm-hicache-"))
    common = {"max_total_tokens": pool, "max_running_requests": 8}
    tiers = {"enable_hierarchical_cache": True, "hicache_page_size": args.page_size}
    l3 = {
        **tiers,
        "hicache_ratio": host_few,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(storage),
    }
    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF), one thread, {cpu_flags()}")
    print(f"{args.tenants} tenants x {args.prefix_tokens}-token prefixes; KV pool {pool} tokens "
          f"({args.pool_tenants} prefixes); storage {storage}")  # fmt: skip
    print(f"{'setup':11} {'hit rate':>8} {'host':>8} {'storage':>8} {'TTFT med ms':>10} "
          f"{'mean ms':>9} {'tok/s':>9} {'round hit':>8}")  # fmt: skip
    rows = [
        run_setup("L1", path, common, prefixes, args),
        run_setup("L1+L2", path, {**common, **tiers, "hicache_ratio": host_all}, prefixes, args),
        run_setup("L1+L2+L3", path, {**common, **l3}, prefixes, args),
        run_setup("l3-restart", path, {**common, **l3}, prefixes, args, warm=False),
    ]
    base = rows[0]
    for row in rows[1:]:
        print(f"{row['setup']}: TTFT {row['ttft_median_s'] / base['ttft_median_s']:.0%} of L1's "
              f"(recompute), throughput {row['throughput_tok_s'] / base['throughput_tok_s']:.2f}x "
              "L1's")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_flags(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
