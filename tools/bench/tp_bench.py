#!/usr/bin/env python3
"""Tensor parallelism: the engine at TP=1 and TP=2 side by side, dummy weights of a real shape.

On CPU (gloo): Qwen2.5-0.5B's shapes (float32: this benchmark measures splitting, not the
dtype), every rank computing with one thread (`OMP_NUM_THREADS=1`, so TP=2 uses two cores
where TP=1 uses one). On a GPU (NCCL): Llama-3.1-8B's shapes in bfloat16, TP=2 only where two
GPUs are visible. For each TP size and batch size: decode tok/s of B greedy requests (the
time of --tokens tokens each less that of one, over the tokens decoded in between), the share of rank
0's step time spent in the forward's collectives (all-reduce and logits all-gather, measured
on rank 0; on a GPU in an eager pass with the device synchronized around each collective), and
each rank's memory: weight bytes, KV pool bytes, resident set size.

    .venv/bin/python tools/bench/tp_bench.py                 # CPU: ~5 min on 2 cores
    .venv/bin/python tools/bench/tp_bench.py --quick         # a tiny shape, seconds
    python3 tools/bench/tp_bench.py                          # a GPU machine: Llama-3.1-8B shapes
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from _common import LLAMA31_8B_SHAPE, QWEN25_05B_SHAPE, id_tokenizer, write_config

QUICK_SHAPE: dict[str, Any] = {
    **QWEN25_05B_SHAPE,
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def model_dir(shape: dict[str, Any], dtype: str) -> Path:
    workdir = write_config({**shape, "bos_token_id": 0, "eos_token_id": 0}, dtype, "tp_bench_")
    id_tokenizer(workdir, shape["vocab_size"])
    return workdir


def decode_rate(engine: Any, batch: int, prompt_len: int, tokens: int) -> float:
    """Decode tok/s of `batch` greedy requests: the time of `tokens` tokens each less that of
    one token each (the prefill), over the tokens decoded in between. Without streaming, so
    that the front process (which shares the cores with the ranks) has little to do."""
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(300, 2000, (batch, prompt_len), generator=generator).tolist()

    def timed(new_tokens: int) -> float:
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.flush_cache().result(60)  # every run prefills its prompts in full
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - start

    prefill = timed(1)
    return batch * (tokens - 1) / (timed(tokens) - prefill)


def run_side(workdir: Path, tp_size: int, args: argparse.Namespace, eager: bool) -> dict[str, Any]:
    from radixlm.runtime import Engine

    options: dict[str, Any] = dict(
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        show_progress=False,
        max_total_tokens=max(args.batch_sizes) * (args.prompt_len + args.tokens) + 256,
        max_running_requests=max(args.batch_sizes),
        engine_process=True,
        dist_timeout=600,
    )
    if eager:
        options["disable_cuda_graph"] = True
    if tp_size > 1:
        options["tp_size"] = tp_size
    row: dict[str, Any] = {"tp_size": tp_size, "cuda_graphs": not eager}
    with Engine(str(workdir), **options) as engine:
        decode_rate(engine, 1, args.prompt_len, 4)  # warm-up (oneDNN / CUDA kernels)
        for batch in args.batch_sizes:
            rates = []
            shares = []
            for _ in range(args.repeats):
                before = engine.server_info(fresh=True)["tp_collective_seconds"]
                start = time.perf_counter()
                rates.append(decode_rate(engine, batch, args.prompt_len, args.tokens))
                wall = time.perf_counter() - start
                spent = engine.server_info(fresh=True)["tp_collective_seconds"] - before
                shares.append(spent / wall)
            row[f"decode_tok_s_b{batch}"] = max(rates)
            row[f"collective_share_b{batch}"] = min(shares)
        row["ranks"] = engine.server_info()["tp_ranks"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present"
    )
    parser.add_argument("--tp-sizes", default="1,2")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24, help="tokens generated per stream")
    parser.add_argument("--repeats", type=int, default=2, help="runs per figure (best kept)")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bf16 on GPU")
    parser.add_argument("--quick", action="store_true", help="a tiny shape (a smoke run)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank (the ranks inherit it)
        shape, name = QWEN25_05B_SHAPE, "Qwen2.5-0.5B"
        args.dtype = args.dtype or "float32"
    else:
        shape, name = LLAMA31_8B_SHAPE, "Llama-3.1-8B"
        args.dtype = args.dtype or "bfloat16"
    if args.quick:
        shape, name = QUICK_SHAPE, "tiny"
        args.repeats = 1
    skipped = [t for t in tp_sizes if args.device == "cuda" and t > gpus]
    for size in skipped:
        print(f"TP={size} skipped: it needs {size} GPUs, this machine has {gpus}", flush=True)
    tp_sizes = [t for t in tp_sizes if t not in skipped]
    from report import machine

    info = machine()
    print(
        f"{name} shapes, dummy {args.dtype} weights, {args.device}"
        + (" (1 thread per rank)" if args.device == "cpu" else f" ({gpus} GPUs)")
        + f"; {info['cpu']}, {info.get('usable_cores')} usable cores",
        flush=True,
    )
    workdir = model_dir(shape, args.dtype)
    rows = []
    for size in tp_sizes:
        row = run_side(workdir, size, args, eager=False)
        if args.device == "cuda" and size > 1:
            # The collectives' share, timed on the device: an eager pass with synchronization.
            os.environ["RADIXLM_TP_SYNC_TIMING"] = "1"
            eager = run_side(workdir, size, args, eager=True)
            del os.environ["RADIXLM_TP_SYNC_TIMING"]
            for batch in args.batch_sizes:
                row[f"collective_share_b{batch}"] = eager[f"collective_share_b{batch}"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    print()
    base = rows[0] if rows and rows[0]["tp_size"] == 1 else None
    header = f"{'TP':>3} | " + " | ".join(
        f"{'decode tok/s b' + str(b):>18} {'vs TP=1':>7} {'comm %':>6}" for b in args.batch_sizes
    )
    print(header)
    for row in rows:
        cells = []
        for batch in args.batch_sizes:
            rate = row[f"decode_tok_s_b{batch}"]
            ratio = rate / base[f"decode_tok_s_b{batch}"] if base else float("nan")
            share = 100 * row[f"collective_share_b{batch}"]
            cells.append(f"{rate:>18.1f} {ratio:>6.2f}x {share:>5.1f}%")
        print(f"{row['tp_size']:>3} | " + " | ".join(cells))
    print()
    print(f"{'TP':>3} {'rank':>4} | {'weights MB':>10} {'KV pool MB':>10} {'resident MB':>11}")
    for row in rows:
        for rank in row["ranks"]:
            print(
                f"{row['tp_size']:>3} {rank['rank']:>4} | {rank['weight_bytes'] / 2**20:>10.1f} "
                f"{rank['kv_pool_bytes'] / 2**20:>10.1f} {rank['resident_bytes'] / 2**20:>11.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
