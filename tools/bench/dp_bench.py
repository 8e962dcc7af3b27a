#!/usr/bin/env python3
"""Data parallelism: routing policies side by side on the same replicas, many tenants.

Two engine replicas (each in its own engine process, one CPU thread each on a CPU; dummy
weights of a real model's vocabulary with a small trunk by default) behind
`radixlm.router.DataParallelEngine`, driven through its engine interface with streamed
requests, a few in flight at once. Workloads with many distinct prefixes, as the SGLang
paper's, one tenant per prefix:

- few_shot: 8 tenants, each with its own 1,500-token few-shot prefix (the paper's length); 8
  questions per tenant, interleaved.
- multi_turn: 16 chat sessions of 4 turns (each turn's prompt is the history so far plus a new
  message); the sessions' turns interleave.

For each policy (`cache_aware`, `round_robin`, `power_of_two`): the aggregate cache hit rate
(cached / prompt tokens over all requests) beside the optimum (every prefix computed once, as
one unbounded cache would), requests/s and p99 time to first token. The replicas' caches are
flushed between policies.

    .venv/bin/python tools/bench/dp_bench.py                     # ~4 min on 2 cores
    .venv/bin/python tools/bench/dp_bench.py --quick             # a smoke run, seconds
    .venv/bin/python tools/bench/dp_bench.py --plot docs/img/dp_bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _common import QWEN25_05B_SHAPE, id_tokenizer, write_config

# Qwen2.5-0.5B's vocabulary over a smaller trunk (8 layers, hidden 512): prefill still costs
# what a cache hit saves, and three policies fit in minutes on two CPU cores.
SMALL = {
    **QWEN25_05B_SHAPE,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
POLICIES = ("cache_aware", "round_robin", "power_of_two")


class Workload:
    """Prompts as token ids, from a seeded generator (every policy gets the same ones); the
    multi-turn stages, which extend earlier outputs, are built in `run_workload`."""

    def __init__(self, vocab: int, quick: bool, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.quick = quick

    def ids(self, count: int) -> list[int]:
        return [self.rng.randrange(1000, self.vocab) for _ in range(count)]

    def few_shot(self) -> list[list[list[int]]]:
        tenants, per, prefix = (4, 4, 200) if self.quick else (8, 8, 1500)
        heads = [self.ids(prefix) for _ in range(tenants)]
        prompts = []
        for _ in range(per):
            order = list(range(tenants))
            self.rng.shuffle(order)
            prompts += [heads[t] + self.ids(20) for t in order]
        return [prompts]


async def _one(
    engine: Any, prompt: list[int], tokens: int, stats: list[dict[str, Any]]
) -> list[int]:
    from radixlm.sampling import GenerateRequest

    request = GenerateRequest(
        input_ids=prompt,
        stream=True,
        sampling_params={"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        rid=f"r{len(stats)}-{random.random()}",
    )
    start = time.perf_counter()
    first = None
    last = None
    async for chunk in engine.generate(request):
        if first is None:
            first = time.perf_counter() - start
        last = chunk
    assert last is not None
    stats.append({"ttft": first, "prompt": last.prompt_tokens, "cached": last.cached_tokens})
    return list(last.output_ids)


async def _stage(
    engine: Any, prompts: list[list[int]], tokens: int, inflight: int, stats: list[dict[str, Any]]
) -> list[list[int]]:
    """Every prompt, at most `inflight` at once, in order; their outputs."""
    gate = asyncio.Semaphore(inflight)

    async def run(prompt: list[int]) -> list[int]:
        async with gate:
            return await _one(engine, prompt, tokens, stats)

    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(run(prompt)))
        await asyncio.sleep(0)  # submitted in order
    return list(await asyncio.gather(*tasks))


def optimal_hit_rate(sequences: list[tuple[list[int], list[int]]]) -> float:
    """engine_bench's optimum (one unbounded cache reusing every computed prefix) over
    (prompt, output) pairs."""
    from engine_bench import Call
    from engine_bench import optimal_hit_rate as optimum

    return float(optimum([Call(ids, {}, [output]) for ids, output in sequences]))


async def run_workload(
    engine: Any, name: str, workload: Workload, inflight: int, quick: bool
) -> tuple[list[dict[str, Any]], float, list[tuple[list[int], list[int]]]]:
    stats: list[dict[str, Any]] = []
    done: list[tuple[list[int], list[int]]] = []
    start = time.perf_counter()
    if name == "few_shot":
        (prompts,) = workload.few_shot()
        outputs = await _stage(engine, prompts, 8, inflight, stats)
        done += list(zip(prompts, outputs, strict=True))
    else:
        sessions = [workload.ids(150 if quick else 300) for _ in range(8 if quick else 16)]
        for _turn in range(3 if quick else 4):
            prompts = [history + workload.ids(30) for history in sessions]
            order = list(range(len(prompts)))
            workload.rng.shuffle(order)
            outputs_by = await _stage(engine, [prompts[i] for i in order], 16, inflight, stats)
            outputs = [[] for _ in prompts]
            for i, out in zip(order, outputs_by, strict=True):
                outputs[i] = out
            done += list(zip(prompts, outputs, strict=True))
            sessions = [p + o for p, o in zip(prompts, outputs, strict=True)]
    return stats, time.perf_counter() - start, done


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workloads", default="few_shot,multi_turn")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--inflight", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--plot", help="write a bar chart of the figures (PNG) here")
    args = parser.parse_args()
    from report import machine

    from radixlm.router import DataParallelEngine
    from radixlm.runtime import Engine

    workdir = write_config(SMALL, "float32", "dp_bench_")
    id_tokenizer(workdir, SMALL["vocab_size"])
    info = machine()
    print(
        f"{args.replicas} replicas of a dummy Qwen2.5-0.5B-vocabulary model (8 layers, hidden "
        f"512), 1 CPU thread each; {info['cpu']}, {info.get('usable_cores')} usable cores",
        flush=True,
    )
    options = dict(
        load_format="dummy",
        device="cpu",
        show_progress=False,
        max_total_tokens=200_000,
        engine_process=True,
        cpu_threads=1,
    )
    replicas = [Engine(str(workdir), **options) for _ in range(args.replicas)]
    rows: list[dict[str, Any]] = []
    try:
        # Warm every replica up (oneDNN builds its kernels at the first shapes it sees), so
        # that the first policy measured pays nothing the others do not.
        warm = DataParallelEngine(replicas, "round_robin")
        asyncio.run(run_workload(warm, "few_shot", Workload(SMALL["vocab_size"], True, 9), 2, True))
        for name in args.workloads.split(","):
            for policy in args.policies.split(","):
                engine = DataParallelEngine(replicas, policy)
                asyncio.run(engine.flush_cache())
                workload = Workload(SMALL["vocab_size"], args.quick, seed=1)  # same prompts
                stats, wall, done = asyncio.run(
                    run_workload(engine, name, workload, args.inflight, args.quick)
                )
                prompt = sum(s["prompt"] for s in stats)
                cached = sum(s["cached"] for s in stats)
                row = {
                    "workload": name,
                    "policy": policy,
                    "requests": len(stats),
                    "hit_rate": cached / prompt,
                    "optimal_hit_rate": optimal_hit_rate(done),
                    "req_s": len(stats) / wall,
                    "p99_ttft_s": p99([s["ttft"] for s in stats]),
                }
                row["of_optimum"] = row["hit_rate"] / row["optimal_hit_rate"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for replica in replicas:
            replica.shutdown()

    print()
    print(
        f"{'workload':>10} {'policy':>13} | {'hit rate':>8} {'optimum':>8} {'of opt.':>7} | "
        f"{'req/s':>6} {'vs rr':>6} | {'p99 TTFT s':>10}"
    )
    for row in rows:
        rr = next(
            (r for r in rows if r["workload"] == row["workload"] and r["policy"] == "round_robin"),
            None,
        )
        vs = row["req_s"] / rr["req_s"] if rr else float("nan")
        print(
            f"{row['workload']:>10} {row['policy']:>13} | {row['hit_rate']:>8.3f} "
            f"{row['optimal_hit_rate']:>8.3f} {row['of_optimum']:>6.1%} | {row['req_s']:>6.2f} "
            f"{vs:>5.2f}x | {row['p99_ttft_s']:>10.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    if args.plot:
        plot(rows, Path(args.plot))
    sys.stdout.flush()


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(policies)
    for k, policy in enumerate(policies):
        mine = [
            next(r for r in rows if r["workload"] == w and r["policy"] == policy) for w in workloads
        ]
        xs = [i + k * width for i in range(len(workloads))]
        axes[0].bar(xs, [r["of_optimum"] * 100 for r in mine], width, label=policy)
        axes[1].bar(xs, [r["req_s"] for r in mine], width, label=policy)
    for axis, title in zip(axes, ("cache hit rate, % of the optimum", "requests / s"), strict=True):
        axis.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(workloads))])
        axis.set_xticklabels(workloads)
        axis.set_title(title)
    axes[0].legend(loc="lower center", fontsize=8, ncol=len(policies))
    fig.suptitle("2 replicas, many tenants: routing policies (tools/bench/dp_bench.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
