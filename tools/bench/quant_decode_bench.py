#!/usr/bin/env python3
"""Decode speed of radixlm's weight-only formats beside llama.cpp's own server on the same
formats: output tokens/s at batch 1 and 8 (8 concurrent streams) on SmolLM2-135M-Instruct,
one compute thread each, side by side.

Pairs (each server on its own, one after the other):
  int8  `radixlm serve --quantization int8` (the model's weights quantized per channel at load)
        against `llama-server` on a Q8_0 GGUF of the same weights (llama.cpp's quantizer, from
        an F32 GGUF of the model's dequantized weights, as quant_quality.py makes it)
  int4  `radixlm serve` on the GGUF's own Q4_1 blocks (its default for that file: the int4
        kernels) against `llama-server` on that very file

The decode rate of a batch of N streams: every stream generates SHORT and then LONG tokens
(greedy, `ignore_eos`, the prompts already in both servers' prompt caches), and
rate = N x (LONG - SHORT) / (time of LONG - time of SHORT), which cancels prefill and HTTP
time; the best of --repeats runs of each.

    .venv/bin/python tools/bench/quant_decode_bench.py [--threads 1] [--batches 1,8]

llama-server is built once by _llamacpp.py (`install`, then `install-server`; about 20
minutes on 2 cores in all).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import _llamacpp
import serve_bench
from quant_quality import cpu_flags, float32_directory

PROMPT = "Write a long story about a lighthouse keeper and the ship she saw, part"
#: The pairs: (label, radixlm's arguments, which GGUF llama-server serves).
PAIRS = (
    ("int8 vs Q8_0", "--quantization int8", "Q8_0"),
    ("int4: Q4_1 blocks", "", "Q4_1"),
)


def complete_all(url: str, model: str, prompts: list[str], tokens: int) -> float:
    """Seconds for every prompt's completion of exactly `tokens` tokens, all sent at once."""
    import httpx

    def one(client: httpx.Client, prompt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = client.post("/v1/completions", json=body)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    limits = httpx.Limits(max_connections=len(prompts) + 2)
    with (
        httpx.Client(base_url=url, timeout=600, limits=limits) as client,
        ThreadPoolExecutor(max_workers=len(prompts)) as pool,
    ):
        start = time.perf_counter()
        counts = list(pool.map(lambda p: one(client, p), prompts))
        seconds = time.perf_counter() - start
    if counts != [tokens] * len(prompts):
        raise RuntimeError(f"asked {tokens} tokens per stream, got {counts}")
    return seconds


def decode_rate(url: str, model: str, batch: int, args: argparse.Namespace) -> float:
    """Output tokens/s of `batch` streams decoding together (see the module's docstring)."""
    prompts = [f"{PROMPT} {i + 1}:" for i in range(batch)]
    complete_all(url, model, prompts, args.short)  # untimed: fills the prompt caches
    short = min(complete_all(url, model, prompts, args.short) for _ in range(args.repeats))
    long = min(complete_all(url, model, prompts, args.long) for _ in range(args.repeats))
    return batch * (args.long - args.short) / (long - short)


@contextmanager
def radixlm_server(gguf: Path, radixlm_args: str, args: argparse.Namespace) -> Iterator[str]:
    """`radixlm serve` on `gguf` with `radixlm_args` and --threads threads; yields its URL."""
    port = serve_bench._free_port()
    log = Path(tempfile.mkdtemp(prefix="quant-decode-radixlm-")) / "server.log"
    process = serve_bench.launch("radixlm", str(gguf), port, log, radixlm_args, args.threads)
    url = f"http://127.0.0.1:{port}"
    try:
        if not serve_bench._wait_healthy(url, process, args.startup_timeout):
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"radixlm serve did not start; its log ends with:\n{tail}")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def llama_server(gguf: Path, args: argparse.Namespace) -> Iterator[str]:
    """`llama-server` on `gguf` with a slot per stream of the largest batch; yields its URL."""
    log = Path(tempfile.mkdtemp(prefix="quant-decode-llama-server-")) / "server.log"
    options = _llamacpp.LlamaServerOptions(
        threads=args.threads, parallel=max(args.batches), slot_ctx=1024
    )
    server = _llamacpp.start_llama_server(
        gguf, serve_bench._free_port(), log, str(gguf), options, args.startup_timeout
    )
    try:
        yield server.url
    finally:
        server.stop()


def measure(
    name: str, server: AbstractContextManager[str], model: str, args: argparse.Namespace
) -> dict[int, float]:
    """Decode tokens/s at each of --batches on one server (started on entering `server`,
    which yields its URL, and stopped after)."""
    rates = {}
    with server as url:
        for batch in args.batches:
            rates[batch] = decode_rate(url, model, batch, args)
            print(f"  {name:42s} batch {batch}: {rates[batch]:7.1f} tok/s", flush=True)
    return rates


def gguf_files(args: argparse.Namespace) -> dict[str, Path]:
    """The model's GGUF files by type: its own Q4_1 file and a Q8_0 one made from it."""
    from radixlm.runtime import smollm2_gguf_path

    q4_1 = Path(smollm2_gguf_path())
    _llamacpp.ensure_installed()
    hf_dir = float32_directory(q4_1, args.work_dir / "smollm2-f32")
    q8_0 = _llamacpp.quantize(_llamacpp.convert(hf_dir, outtype="f32"), qtype="Q8_0")
    return {"Q4_1": q4_1, "Q8_0": q8_0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    parser.add_argument("--batches", default="1,8", help="concurrent streams, comma-separated")
    parser.add_argument("--short", type=int, default=16, help="tokens of the short run")
    parser.add_argument("--long", type=int, default=144, help="tokens of the long run")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each length")
    parser.add_argument("--radixlm-args", default="", help="more `radixlm serve` arguments")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--work-dir", type=Path, default=Path(__file__).parent / ".cache" / "quant_quality"
    )
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.long <= args.short or min(args.batches, default=0) < 1:
        parser.error("--long must exceed --short, and every batch be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _llamacpp.ensure_llama_server()
    files = gguf_files(args)
    rows: list[dict[str, Any]] = []
    for label, radixlm_args, qtype in PAIRS:
        gguf = files[qtype]
        extra = " ".join(filter(None, [radixlm_args, args.radixlm_args]))
        ours = measure(f"radixlm {shlex.join(shlex.split(extra)) or '(the file as is)'}",
                       radixlm_server(files["Q4_1"], extra, args), str(files["Q4_1"]),
                       args)  # fmt: skip
        theirs = measure(f"llama-server {qtype}", llama_server(gguf, args), str(gguf), args)
        for batch in args.batches:
            rows.append({"pair": label, "batch": batch, "radixlm_tok_s": ours[batch],
                         "llama_server_tok_s": theirs[batch],
                         "ratio": ours[batch] / theirs[batch]})  # fmt: skip
    print()
    print(f"SmolLM2-135M-Instruct decode, {args.threads} thread(s) each; CPU: {cpu_flags()}")
    head = f"{'pair':20s} {'batch':>5s} {'radixlm':>10s} {'llama-server':>12s} {'ratio':>7s}"
    print(head)
    print("-" * len(head))
    for row in rows:
        print(f"{row['pair']:20s} {row['batch']:5d} {row['radixlm_tok_s']:10.1f} "
              f"{row['llama_server_tok_s']:12.1f} {row['ratio']:6.2f}x")  # fmt: skip
    print("tok/s of output; ratio: radixlm's over llama-server's")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_flags(), "threads": args.threads,
                                         "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
