#!/usr/bin/env python3
"""Engine throughput on the SGLang paper's workloads: radixlm, radixlm without its cache,
radixlm without jump-forward, and transformers' continuous batching (`generate_batch`), on the
same dummy weights, on CPU.

Workloads (synthetic token ids, generated from a seed):
  few_shot          a shared ~1,500-token few-shot prefix, then 64 different questions
  multi_turn        chat sessions; each turn's prompt is the whole history so far
  tree_of_thought   branch-solve-merge trees: branch prompts, solve each branch, merge them
  json              JSON decoding under a JSON schema (radixlm: jump-forward on)
  self_consistency  a shared prefix + a question, sampled n = 8 times

For each: requests/s, output tokens/s, radixlm's prefix-cache hit rate beside the optimal one
(every reusable prefix computed once, with an unbounded cache), and the ratios.

    .venv/bin/python tools/bench/engine_bench.py --quick        # small shapes, a few minutes
    .venv/bin/python tools/bench/engine_bench.py                # Qwen2.5-0.5B shapes (long)
    .venv/bin/python tools/bench/engine_bench.py --workloads few_shot --skip-transformers
    .venv/bin/python tools/bench/engine_bench.py --quick --json results/engine.json

Systems: radixlm, radixlm-nocache (--skip-no-cache), radixlm-nojf: radixlm with jump-forward
off (--skip-no-jump-forward; it differs from radixlm only on `json`), transformers
(--skip-transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from _common import QWEN25_05B_SHAPE, random_hf_model, write_config

QWEN25_05B: dict[str, Any] = {**QWEN25_05B_SHAPE, "bos_token_id": 0, "eos_token_id": 0}
# --quick: the same family and vocabulary, a small trunk.
QUICK = {**QWEN25_05B, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}
QUICK.update(num_attention_heads=4, num_key_value_heads=2)

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"enum": ["France", "England", "Germany", "Spain"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "capital"],
    "additionalProperties": False,
}


@dataclass
class Call:
    """One request of a workload stage: prompt ids and sampling parameters."""

    prompt: list[int]
    params: dict[str, Any]
    outputs: list[list[int]] = field(default_factory=list)  # one per n, filled by a system


Generate = Callable[[list[Call]], None]


# ------------------------------------------------------------------------------- workloads


class Workloads:
    """The paper's workloads as stages of calls; a stage may depend on earlier outputs."""

    def __init__(self, vocab: int, quick: bool, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.quick = quick
        self.out = 8 if quick else 16  # output tokens per call

    def ids(self, count: int) -> list[int]:
        return [self.rng.randrange(1000, self.vocab) for _ in range(count)]

    def greedy(self, tokens: int | None = None) -> dict[str, Any]:
        return {"temperature": 0, "max_new_tokens": tokens or self.out, "ignore_eos": True}

    def few_shot(self, run: Generate) -> list[Call]:
        prefix = self.ids(1500)
        calls = [Call(prefix + self.ids(20), self.greedy()) for _ in range(64)]
        run(calls)
        return calls

    def multi_turn(self, run: Generate) -> list[Call]:
        sessions = [self.ids(200) for _ in range(8 if self.quick else 16)]
        done: list[Call] = []
        for _turn in range(4):
            calls = [Call(history + self.ids(40), self.greedy(24)) for history in sessions]
            run(calls)
            sessions = [c.prompt + c.outputs[0] for c in calls]
            done += calls
        return done

    def tree_of_thought(self, run: Generate) -> list[Call]:
        roots = [self.ids(400) for _ in range(4 if self.quick else 8)]
        branch = [Call(root + self.ids(12), self.greedy()) for root in roots for _ in range(4)]
        run(branch)
        solve = [Call(c.prompt + c.outputs[0] + self.ids(10), self.greedy()) for c in branch]
        run(solve)
        merge = []
        for k, root in enumerate(roots):
            parts = solve[4 * k : 4 * k + 4]
            merged = [t for part in parts for t in part.outputs[0]]
            merge.append(Call(root + merged, self.greedy()))
        run(merge)
        return branch + solve + merge

    def json(self, run: Generate) -> list[Call]:
        instruction = self.ids(300)
        params = {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(CITY_SCHEMA)}
        calls = [Call(instruction + self.ids(30), dict(params)) for _ in range(32)]
        run(calls)
        return calls

    def self_consistency(self, run: Generate) -> list[Call]:
        prefix = self.ids(600)
        params = {"temperature": 0.7, "max_new_tokens": self.out, "n": 8, "ignore_eos": True}
        calls = [Call(prefix + self.ids(30), {**params, "seed": i}) for i in range(8)]
        run(calls)
        return calls


WORKLOADS = ("few_shot", "multi_turn", "tree_of_thought", "json", "self_consistency")


def optimal_hit_rate(calls: Sequence[Call]) -> float:
    """Hit rate with an unbounded cache where every computed prefix is reused: each sequence
    matches what earlier sequences computed (never its last prompt token)."""
    from radixlm.cache import RadixCache

    trie = RadixCache()
    prompt = hit = 0
    for call in calls:
        for output in call.outputs:
            prompt += len(call.prompt)
            hit += trie.match_prompt(call.prompt).length
            seq = call.prompt + output[:-1]
            trie.insert(seq, list(range(len(seq))))
    return hit / prompt if prompt else 0.0


# --------------------------------------------------------------------------------- systems


class RadixSystem:
    def __init__(
        self,
        name: str,
        runner: Any,
        tokenizer: Any,
        cache: bool,
        args: Any,
        jump_forward: bool = True,
    ) -> None:
        from radixlm.runtime import Engine

        runner.reset()
        self.name = name
        self.forwards = runner.stats.forward_calls
        self.engine = Engine(
            runner=runner,
            tokenizer=tokenizer,
            show_progress=False,
            disable_radix_cache=not cache,
            disable_jump_forward=not jump_forward,
            max_running_requests=runner.req_to_token_pool.max_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_policy=args.schedule_policy,
        )

    def generate(self, calls: list[Call]) -> None:
        outs = self.engine.generate(
            input_ids=[c.prompt for c in calls], sampling_params=[c.params for c in calls]
        )
        k = 0
        for call in calls:
            n = call.params.get("n", 1)
            call.outputs = [o["output_ids"] for o in outs[k : k + n]]
            k += n

    def hit_rate(self) -> float:
        return float(self.engine.server_info()["cache_hit_rate"])

    def extra(self) -> str:
        info = self.engine.server_info()
        forwards = info["forward_passes"] - self.forwards
        return f"forwards={forwards} jump_forward_tokens={info['jump_forward_tokens']}"

    def close(self) -> None:
        self.engine.shutdown()


class TransformersSystem:
    name = "transformers"

    def __init__(self, model: Any, args: Any) -> None:
        self.model = model
        self.args = args

    def generate(self, calls: list[Call]) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        groups: dict[str, list[Call]] = {}
        for call in calls:
            key = json.dumps({k: v for k, v in call.params.items() if k != "seed"})
            groups.setdefault(key, []).append(call)
        for group in groups.values():
            params = group[0].params
            sample = params.get("temperature", 1.0) > 0
            config = GenerationConfig(  # type: ignore[no-untyped-call]
                max_new_tokens=params["max_new_tokens"],
                do_sample=sample,
                temperature=params["temperature"] if sample else None,
                num_return_sequences=params.get("n", 1),
                eos_token_id=None,
                pad_token_id=0,
            )
            # generate_batch cannot apply a grammar per request: JSON runs unconstrained for
            # the same number of output tokens.
            cb = ContinuousBatchingConfig(
                max_batch_tokens=self.args.chunked_prefill_size, use_cuda_graph=False
            )
            results = self.model.generate_batch(
                [c.prompt for c in group],
                generation_config=config,
                continuous_batching_config=cb,
                warmup=False,
                progress_bar=False,
            )
            ordered = [results[k] for k in sorted(results, key=_request_order)]
            n = params.get("n", 1)
            for i, call in enumerate(group):
                call.outputs = [list(r.generated_tokens) for r in ordered[i * n : (i + 1) * n]]

    def hit_rate(self) -> float:
        return float("nan")

    def extra(self) -> str:
        return ""

    def close(self) -> None:
        pass


def _request_order(request_id: str) -> tuple[int, ...]:
    digits = "".join(c if c.isdigit() else " " for c in request_id).split()
    return tuple(int(d) for d in digits)


# ------------------------------------------------------------------------------------ main


def build(args: Any) -> tuple[Any, Any, Any, Path]:
    """The transformers model with random weights, and a radixlm runner holding the same."""

    from radixlm.runtime import (
        AttentionConfig,
        MemoryConfig,
        ModelConfig,
        ModelRunner,
        RunnerConfig,
    )
    from radixlm.runtime.fixtures import build_tiny_tokenizer
    from radixlm.runtime.loader import build_model, read_model_info

    shape = QUICK if args.quick else QWEN25_05B
    workdir = write_config(shape, args.dtype, "engine_bench_")
    tokenizer = build_tiny_tokenizer(workdir)
    hf_model = random_hf_model(workdir, args.dtype)
    config = RunnerConfig(
        model=ModelConfig(str(workdir), dtype=args.dtype, load_format="dummy", show_progress=False),
        memory=MemoryConfig(max_total_tokens=args.max_total_tokens, max_running_requests=128),
        attention=AttentionConfig(backend="torch_native"),
    )
    info = read_model_info(config.model)
    runner = ModelRunner(config, model=build_model(info), info=info)
    runner.load_weights(hf_model.state_dict().items())
    return hf_model, runner, tokenizer, workdir


def measure(system: Any, workload: str, args: Any) -> dict[str, Any]:
    source = Workloads(QUICK["vocab_size"], args.quick, seed=args.seed)
    start = time.perf_counter()
    calls = getattr(source, workload)(system.generate)
    seconds = time.perf_counter() - start
    sequences = sum(len(c.outputs) for c in calls)
    tokens = sum(len(o) for c in calls for o in c.outputs)
    return {
        "workload": workload,
        "system": system.name,
        "seconds": seconds,
        "requests_per_s": sequences / seconds,
        "output_tokens_per_s": tokens / seconds,
        "hit_rate": system.hit_rate(),
        "optimal_hit_rate": optimal_hit_rate(calls),
        "extra": system.extra(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small shapes (a few minutes)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-total-tokens", type=int, default=40000)
    parser.add_argument("--chunked-prefill-size", type=int, default=2048)
    parser.add_argument("--schedule-policy", default="lpm")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-no-cache", action="store_true")
    parser.add_argument("--skip-no-jump-forward", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = [w for w in args.workloads.split(",") if w]
    print(f"building a dummy {'small' if args.quick else 'Qwen2.5-0.5B'}-shaped model ...")
    hf_model, runner, tokenizer, _ = build(args)
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        systems: list[Callable[[], Any]] = [
            lambda: RadixSystem("radixlm", runner, tokenizer, True, args)
        ]
        if not args.skip_no_cache:
            systems.append(lambda: RadixSystem("radixlm-nocache", runner, tokenizer, False, args))
        if not args.skip_no_jump_forward:
            systems.append(
                lambda: RadixSystem("radixlm-nojf", runner, tokenizer, True, args, False)
            )
        if not args.skip_transformers:
            systems.append(lambda: TransformersSystem(hf_model, args))
        for make in systems:
            system = make()
            try:
                row = measure(system, workload, args)
            finally:
                system.close()
            rows.append(row)
            print(
                f"  {workload:17s} {row['system']:16s} {row['seconds']:8.1f} s "
                f"{row['requests_per_s']:8.2f} req/s {row['output_tokens_per_s']:9.1f} tok/s "
                f"{row['extra']}",
                flush=True,
            )
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def report(rows: list[dict[str, Any]]) -> None:
    print()
    header = (
        f"{'workload':17s} {'req/s radix':>11s} {'nocache':>8s} {'no-jf':>8s} {'transf.':>8s} "
        f"{'tok/s radix':>11s} {'x nocache':>9s} {'x no-jf':>9s} {'x transf.':>9s} {'hit':>6s} "
        f"{'optimal':>7s} {'hit/opt':>7s}"
    )
    print(header)
    print("-" * len(header))
    by = {(r["workload"], r["system"]): r for r in rows}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        radix = by[(workload, "radixlm")]
        nocache = by.get((workload, "radixlm-nocache"))
        nojf = by.get((workload, "radixlm-nojf"))
        hf = by.get((workload, "transformers"))

        def rate(row: dict[str, Any] | None) -> str:
            return f"{row['requests_per_s']:.2f}" if row else "-"

        def ratio(row: dict[str, Any] | None, radix: dict[str, Any] = radix) -> str:
            if not row:
                return "-"
            return f"{radix['output_tokens_per_s'] / row['output_tokens_per_s']:.2f}x"

        optimal = radix["optimal_hit_rate"]
        share = radix["hit_rate"] / optimal if optimal else float("nan")
        print(
            f"{workload:17s} {rate(radix):>11s} {rate(nocache):>8s} {rate(nojf):>8s} "
            f"{rate(hf):>8s} {radix['output_tokens_per_s']:11.1f} {ratio(nocache):>9s} "
            f"{ratio(nojf):>9s} {ratio(hf):>9s} "
            f"{radix['hit_rate']:6.1%} {optimal:7.1%} {share:7.1%}"
        )


if __name__ == "__main__":
    main()
