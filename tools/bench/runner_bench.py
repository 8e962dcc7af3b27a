#!/usr/bin/env python3
"""Model-runner throughput on CPU: radixlm-runtime beside transformers, same weights.

A dummy-weight model with Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14 heads / 2 KV heads,
vocab 151936, tied embeddings). For each batch size: prefill tok/s (B prompts of --prompt-len
tokens in one forward) and decode tok/s (--decode-steps greedy steps of B tokens), for radixlm
(ModelRunner, torch_native attention, greedy sampler) and transformers (the same weights, a
forward with logits_to_keep=1 then a KV-cached greedy loop). Prints the ratios and the decode
bandwidth roofline: weight bytes read per step / measured memory read bandwidth.

    .venv/bin/python tools/bench/runner_bench.py                      # the default (~3 min)
    .venv/bin/python tools/bench/runner_bench.py --batch-sizes 1,8 --decode-steps 8 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _common import QWEN25_05B_SHAPE, random_hf_model, read_bandwidth_gbs, write_config

QWEN25_05B: dict[str, Any] = {
    **QWEN25_05B_SHAPE,
    "sliding_window": 32768,
    "max_window_layers": 21,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class RadixSide:
    name = "radixlm"

    def __init__(self, model_dir: Path, dtype: str, hf_model: Any, max_tokens: int) -> None:
        from radixlm.runtime import (
            AttentionConfig,
            MemoryConfig,
            ModelConfig,
            ModelRunner,
            RunnerConfig,
        )
        from radixlm.runtime.loader import build_model, read_model_info

        config = RunnerConfig(
            model=ModelConfig(
                str(model_dir), dtype=dtype, load_format="dummy", show_progress=False
            ),
            memory=MemoryConfig(max_total_tokens=max_tokens, max_running_requests=64),
            attention=AttentionConfig(backend="torch_native"),
        )
        info = read_model_info(config.model)
        # Skip the dummy init: the weights come from the transformers model right after.
        self.runner = ModelRunner(config, model=build_model(info), info=info)
        self.runner.load_weights(hf_model.state_dict().items())

    def run(self, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
        from radixlm.runtime import BatchEntry, ForwardBatch, SamplingBatch, SamplingRequest
        from radixlm.sampling import SamplingParams

        runner = self.runner
        table = runner.req_to_token_pool.req_to_token
        rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        slots = [runner.kv_pool.alloc(len(p) + steps) for p in prompts]
        assert all(r is not None for r in rows) and all(s is not None for s in slots)
        greedy = SamplingParams(temperature=0.0)
        sampling = SamplingBatch.build(
            [SamplingRequest(greedy) for _ in prompts], runner.vocab_size
        )
        outputs: list[list[int]] = [[] for _ in prompts]

        def prefill() -> None:
            entries = [
                BatchEntry(row, p, 0, s[: len(p)])  # type: ignore[arg-type,index]
                for row, p, s in zip(rows, prompts, slots, strict=True)
            ]
            out = runner.forward(ForwardBatch.build(entries, table))
            for o, t in zip(
                outputs, runner.sample(out.next_token_logits, sampling).token_ids, strict=True
            ):
                o.append(t)

        def decode() -> None:
            for step in range(steps - 1):
                entries = [
                    BatchEntry(row, o[-1:], len(p) + step, [s[len(p) + step]])  # type: ignore[index]
                    for row, p, s, o in zip(rows, prompts, slots, outputs, strict=True)
                ]
                out = runner.forward(ForwardBatch.build(entries, table))
                tokens = runner.sample(out.next_token_logits, sampling).token_ids
                for o, t in zip(outputs, tokens, strict=True):
                    o.append(t)

        prefill_s = timed(prefill)
        decode_s = timed(decode)
        for row, s in zip(rows, slots, strict=True):
            runner.kv_pool.free(s)  # type: ignore[arg-type]
            runner.req_to_token_pool.free(row)  # type: ignore[arg-type]
        return prefill_s, decode_s, outputs


class TransformersSide:
    name = "transformers"

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
        ids = torch.tensor(prompts)
        state: dict[str, Any] = {}

        def prefill() -> None:
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            state["cache"] = out.past_key_values
            state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
            state["tokens"] = [state["next"]]

        def decode() -> None:
            for _ in range(steps - 1):
                out = self.model(
                    input_ids=state["next"], past_key_values=state["cache"], use_cache=True
                )
                state["cache"] = out.past_key_values
                state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
                state["tokens"].append(state["next"])

        prefill_s = timed(prefill)
        decode_s = timed(decode)
        tokens = torch.cat(state["tokens"], dim=1).tolist()
        return prefill_s, decode_s, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per figure (the best is kept)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtype = getattr(torch, args.dtype)

    workdir = write_config(QWEN25_05B, args.dtype, "runner_bench_")
    print(f"building a dummy Qwen2.5-0.5B-shaped model ({args.dtype}) ...", flush=True)
    hf_model = random_hf_model(workdir, args.dtype)
    params = sum(p.numel() for p in hf_model.parameters())
    max_tokens = max(batch_sizes) * (args.prompt_len + args.decode_steps) + 64
    sides: list[Any] = [RadixSide(workdir, args.dtype, hf_model, max_tokens)]
    if not args.skip_transformers:
        sides.append(TransformersSide(hf_model))

    bandwidth = read_bandwidth_gbs()
    weight_bytes = params * dtype.itemsize  # tied: the embedding matrix is read once, as lm_head
    step_floor = weight_bytes / (bandwidth * 1e9)
    print(
        f"params {params / 1e6:.0f}M, weights {weight_bytes / 1e9:.2f} GB, read bandwidth "
        f"{bandwidth:.1f} GB/s -> decode step floor {step_floor * 1e3:.0f} ms, "
        f"threads {torch.get_num_threads()}",
        flush=True,
    )
    generator = torch.Generator().manual_seed(1)
    results: list[dict[str, Any]] = []
    for batch in batch_sizes:
        prompts = torch.randint(
            0, QWEN25_05B["vocab_size"], (batch, args.prompt_len), generator=generator
        ).tolist()
        row: dict[str, Any] = {"batch": batch}
        outputs: dict[str, list[list[int]]] = {}
        prefill: dict[str, list[float]] = {side.name: [] for side in sides}
        decode: dict[str, list[float]] = {side.name: [] for side in sides}
        for side in sides:
            side.run(prompts, 3)  # warm-up at the measured shapes (oneDNN builds its kernels)
        # Alternate the sides and keep each one's best run: the machine's load moves.
        for _ in range(args.repeats):
            for side in sides:
                p_s, d_s, outputs[side.name] = side.run(prompts, args.decode_steps)
                prefill[side.name].append(p_s)
                decode[side.name].append(d_s)
        for side in sides:
            row[f"{side.name}_prefill_tok_s"] = batch * args.prompt_len / min(prefill[side.name])
            row[f"{side.name}_decode_tok_s"] = (
                batch * (args.decode_steps - 1) / min(decode[side.name])
            )
        row["roofline_decode_tok_s"] = batch / step_floor
        if len(outputs) == 2:
            row["same_tokens"] = outputs["radixlm"] == outputs["transformers"]
        results.append(row)
        print(json.dumps(row), flush=True)

    print()
    header = (
        f"{'batch':>5} | {'prefill tok/s':>27} | {'decode tok/s':>27} | {'decode roofline':>15}"
    )
    print(header)
    print(
        f"{'':>5} | {'radixlm':>8} {'hf':>8} {'ratio':>8} | {'radixlm':>8} {'hf':>8} {'ratio':>8} | {'tok/s':>7} {'ours %':>7}"
    )
    for row in results:
        ours_p, ours_d = row["radixlm_prefill_tok_s"], row["radixlm_decode_tok_s"]
        hf_p = row.get("transformers_prefill_tok_s", float("nan"))
        hf_d = row.get("transformers_decode_tok_s", float("nan"))
        print(
            f"{row['batch']:>5} | {ours_p:>8.1f} {hf_p:>8.1f} {ours_p / hf_p:>7.2f}x | "
            f"{ours_d:>8.1f} {hf_d:>8.1f} {ours_d / hf_d:>7.2f}x | "
            f"{row['roofline_decode_tok_s']:>7.1f} {100 * ours_d / row['roofline_decode_tok_s']:>6.0f}%"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
