#!/usr/bin/env python3
"""HTTP serving benchmark: a load generator for any OpenAI-compatible or radixlm server.

Sends a synthetic workload (random prompts, or groups of prompts sharing a long prefix) at a
request rate (Poisson arrivals) or a fixed concurrency, streams every answer, and reports
request and token throughput, time to first token (TTFT), inter-token latency (ITL) and
end-to-end latency (mean, p50, p99).

    # against a running server
    .venv/bin/python tools/bench/serve_bench.py --base-url http://127.0.0.1:30000 --model NAME

    # self-test: an in-process server on the toy engine of the server's tests (no model needed)
    .venv/bin/python tools/bench/serve_bench.py --fake

    # side by side: `radixlm serve` and `transformers serve` on the same dummy-weight model,
    # one after the other, the same workload; prints the ratios
    .venv/bin/python tools/bench/serve_bench.py --compare --dummy-model tiny
    .venv/bin/python tools/bench/serve_bench.py --compare --dummy-model qwen2.5-0.5b --num-prompts 64

    # the engine on a thread of the server process vs in its own process (--engine-mode), the
    # same server and workload one after the other: 64 concurrent streams of short prompts
    .venv/bin/python tools/bench/serve_bench.py --compare-modes --dummy-model tiny \
        --dataset random --num-prompts 256 --max-concurrency 64 --input-len 16 --output-len 32

    # llama.cpp as a peer (built once into tools/bench/.cache/llamacpp/, see _llamacpp.py):
    # the same bf16 checkpoint converted to GGUF, one compute thread per server, the issue's
    # workloads (--workload sets the dataset, lengths in tokens, 16 requests at concurrency 8)
    .venv/bin/python tools/bench/serve_bench.py --compare --peers llamacpp --threads 1 \
        --dummy-model qwen2.5-0.5b-full --dummy-dtype bfloat16 --api completions --workload few-shot
    ... --peers llamacpp,transformers --llamacpp-quant Q8_0 --radixlm-args "--dtype float32"

With --compare each measured duration is also given as a share of the machine's limit for the
workload (limit_probe.py: the unique prompt tokens at the measured matmul rate plus the decode
steps at the measured batch rate, same threads and dtype); --no-limit skips the probe.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
FAKE_ENGINE = ROOT / "packages" / "server" / "tests" / "server_fake_engine.py"

# Model shapes for --dummy-model (random weights, saved with a small local tokenizer).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
    },
    "qwen2.5-0.5b": {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2,
    },
    # Qwen2.5-0.5B's vocabulary too (151,936), with the id tokenizer of _common.
    "qwen2.5-0.5b-full": {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    },
}  # fmt: skip

# --workload presets: the two serving workloads, lengths in tokens.
PRESETS: dict[str, dict[str, Any]] = {
    "few-shot": {"dataset": "shared-prefix", "num_groups": 1, "prefix_len": 1561,
                 "input_len": 20, "num_prompts": 16, "max_concurrency": 8},
    "no-sharing": {"dataset": "random", "input_len": 490, "num_prompts": 16,
                   "max_concurrency": 8},
}  # fmt: skip
PEERS = ("transformers", "llamacpp")


# Workloads.

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "pa", "de", "go", "zu", "ri", "en"]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count)
    )


@dataclass(frozen=True)
class Prompt:
    system: str
    user: str
    output_len: int


Count = Callable[[random.Random, int], str]


def _token_words(tokenizer: Any) -> Count:
    """Text of exactly `count` tokens of `tokenizer` (words, cut at a token boundary)."""

    def text(rng: random.Random, count: int) -> str:
        ids: list[int] = []
        while len(ids) < count:
            ids = tokenizer.encode(_words(rng, 2 * count + 8), add_special_tokens=False)
        return str(tokenizer.decode(ids[:count]))

    return text


def random_dataset(
    n: int, input_len: int, output_len: int, seed: int, words: Count = _words
) -> list[Prompt]:
    """Independent prompts of about `input_len` words (lengths vary ±25%); `words` makes the
    text (`_token_words`: lengths in a tokenizer's tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = max(1, int(input_len * rng.uniform(0.75, 1.25)))
        out.append(Prompt("", words(rng, length), output_len))
    return out


def shared_prefix_dataset(
    n: int,
    groups: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    words: Count = _words,
) -> list[Prompt]:
    """`groups` long system prompts, each shared by n/groups short questions (interleaved)."""
    rng = random.Random(seed)
    prefixes = [words(rng, prefix_len) for _ in range(groups)]
    return [Prompt(prefixes[i % groups], words(rng, question_len), output_len) for i in range(n)]


def prompt_text(api: str, prompt: Prompt, tokenizer: Any) -> str:
    """The text a server computes for `prompt` through `api` (the chat template rendered)."""
    if api != "chat":
        return f"{prompt.system}\n{prompt.user}".strip()
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    messages.append({"role": "user", "content": prompt.user})
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


# One request.


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""


def _body(
    api: str, model: str, prompt: Prompt, extra: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    if api == "chat":
        messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
        messages.append({"role": "user", "content": prompt.user})
        body: dict[str, Any] = {"model": model, "messages": messages}
        path = "/v1/chat/completions"
    elif api == "completions":
        body = {"model": model, "prompt": f"{prompt.system}\n{prompt.user}".strip()}
        path = "/v1/completions"
    else:
        text = f"{prompt.system}\n{prompt.user}".strip()
        params = {"max_new_tokens": prompt.output_len, "temperature": 0.0, **extra}
        return "/generate", {"text": text, "sampling_params": params, "stream": True}
    body.update(
        max_tokens=prompt.output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    return path, body


def _delta(api: str, data: dict[str, Any], text: str) -> str:
    """The output text so far, after one streamed event."""
    if api == "generate":
        return str(data.get("text", ""))  # cumulative
    choices = data.get("choices") or []
    if not choices:
        return text
    choice = choices[0]
    delta = choice.get("delta") or {}
    piece = choice.get("text") if api == "completions" else delta.get("content")
    return text + (piece or "")


async def one_request(
    client: httpx.AsyncClient,
    api: str,
    model: str,
    prompt: Prompt,
    extra: dict[str, Any],
    count_tokens: Callable[[str], int] | None = None,
) -> Result:
    path, body = _body(api, model, prompt, extra)
    result = Result()
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = str(data["error"])[:200]
                    return result
                usage = data.get("usage") or data.get("meta_info")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens", result.prompt_tokens))
                    result.output_tokens = int(usage.get("completion_tokens", result.output_tokens))
                text = _delta(api, data, result.text)
                grown = len(text) > len(result.text)
                result.text = text
                if grown:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    if not result.output_tokens:  # the server sent no usage: count the text's tokens
        result.output_tokens = count_tokens(result.text) if count_tokens else chunks
    result.ok = chunks > 0 or result.output_tokens == 0
    if not result.ok:
        result.error = (
            f"the stream ended without text ({result.output_tokens} completion tokens reported)"
        )
    return result


async def run_load(
    base_url: str,
    api: str,
    model: str,
    prompts: list[Prompt],
    rate: float,
    concurrency: int | None,
    extra: dict[str, Any],
    seed: int,
    headers: dict[str, str] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[list[Result], float]:
    """Send every prompt (Poisson arrivals at `rate`/s, at most `concurrency` open at once)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(prompts))
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=(concurrency or len(prompts)) + 8)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, headers=headers
    ) as client:

        async def limited(prompt: Prompt) -> Result:
            async with limit:
                return await one_request(client, api, model, prompt, extra, count_tokens)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# Report.


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    ttft = [r.ttft for r in done]
    itl = [x for r in done for x in r.itl]
    e2e = [r.latency for r in done]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_tok_s": sum(r.prompt_tokens for r in done) / duration,
        "output_tok_s": out_tokens / duration,
        "mean_ttft_ms": 1000 * statistics.fmean(ttft) if ttft else float("nan"),
        "p50_ttft_ms": 1000 * _pct(ttft, 50),
        "p99_ttft_ms": 1000 * _pct(ttft, 99),
        "mean_itl_ms": 1000 * statistics.fmean(itl) if itl else float("nan"),
        "p50_itl_ms": 1000 * _pct(itl, 50),
        "p99_itl_ms": 1000 * _pct(itl, 99),
        "mean_e2e_ms": 1000 * statistics.fmean(e2e) if e2e else float("nan"),
        "p50_e2e_ms": 1000 * _pct(e2e, 50),
        "p99_e2e_ms": 1000 * _pct(e2e, 99),
    }


# Lower is better for these; ratios are printed so that > 1 means the first column is better.
LOWER_IS_BETTER = ("ttft", "itl", "e2e", "duration", "failed")


def print_table(columns: dict[str, dict[str, float] | None]) -> None:
    """The figures side by side, with the first column's ratio over each other column."""
    names = list(columns)
    keys = next((list(c) for c in columns.values() if c), [])
    others = names[1:]
    header = f"{'metric':22s}" + "".join(f"{n:>18s}" for n in names)
    if len(names) == 2:
        header += f"{'ratio (1st/2nd)':>18s}"
    elif others:
        header += "".join(f"{'1st/' + n[:13]:>18s}" for n in others)
    print(header)
    print("-" * len(header))
    for key in keys:
        cells = []
        for name in names:
            value = (columns[name] or {}).get(key)
            cells.append(f"{value:18.2f}" if value is not None else f"{'n/a':>18s}")
        line = f"{key:22s}" + "".join(cells)
        a = (columns[names[0]] or {}).get(key) if names else None
        for other in others:
            b = (columns[other] or {}).get(key)
            if a and b and not (math.isnan(a) or math.isnan(b)):
                lower = any(word in key for word in LOWER_IS_BETTER)
                line += f"{(b / a if lower else a / b):17.2f}x"
            else:
                line += f"{'':18s}"
        print(line)
    if others:
        print("(ratio: > 1 means the first column is better — faster or higher throughput)")


def build_prompts(args: argparse.Namespace, tokenizer: Any = None) -> list[Prompt]:
    """The workload's prompts; lengths in `tokenizer`'s tokens with --length-unit tokens."""
    words: Count = _words
    if args.length_unit == "tokens":
        if tokenizer is None:
            raise SystemExit("--length-unit tokens (and --workload) needs --compare")
        words = _token_words(tokenizer)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(
            args.num_prompts, args.num_groups, args.prefix_len, args.input_len,
            args.output_len, args.seed, words,
        )  # fmt: skip
    return random_dataset(args.num_prompts, args.input_len, args.output_len, args.seed, words)


def bench(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    extra: dict[str, Any],
    count_tokens: Callable[[str], int] | None = None,
    prompts: list[Prompt] | None = None,
    prompt_counts: list[int] | None = None,
) -> dict[str, float]:
    """The workload (`prompts`, default from `args`) against one server; `prompt_counts`
    stand in for the prompt token counts of a server that reports no usage."""
    prompts = prompts if prompts is not None else build_prompts(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    if args.warmup:
        # Untimed: first requests pay for lazy initialisation (compilation, warm-up) in servers.
        warm = random_dataset(args.warmup, 8, 4, args.seed + 1)
        asyncio.run(run_load(base_url, args.api, model, warm, float("inf"), 1, extra, 0, headers))
    results, duration = asyncio.run(
        run_load(base_url, args.api, model, prompts, args.request_rate, args.max_concurrency,
                 extra, args.seed, headers, count_tokens)
    )  # fmt: skip
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"  {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    if prompt_counts and all(r.prompt_tokens == 0 for r in results):
        # The server reported no usage (llama.cpp's streams): the prompts as counted here.
        for result, count in zip(results, prompt_counts, strict=True):
            result.prompt_tokens = count
    return summarize(results, duration)


# Servers to bench.


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def _load_fake_engine() -> Any:
    """The toy engine module of the server's tests (loaded by path; it is not installed)."""
    name = "server_fake_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FAKE_ENGINE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def fake_server(token_delay: float) -> tuple[str, str, Any]:
    """An in-process uvicorn server on the tests' toy engine; returns (url, model, stop)."""
    import uvicorn

    from radixlm.server import ServerConfig, create_app

    fake = _load_fake_engine()
    tokenizer = fake.build_tokenizer(Path(tempfile.mkdtemp(prefix="serve-bench-tok-")))
    engine = fake.FakeEngine(tokenizer, token_delay=token_delay, max_context_length=1 << 16)
    app = create_app(engine, ServerConfig(served_model_name="fake", log_requests=False))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    if not _wait_healthy(url, None, 30):
        raise SystemExit("the fake server did not start")

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return url, "fake", stop


def build_dummy_model(shape: str, directory: Path, dtype: str = "float32") -> Path:
    """A random-weight (seed 0) Qwen2 model of `shape` saved in `dtype`, with the toy
    byte-level BPE tokenizer, or with _common's id tokenizer when the shape names its own
    vocabulary size. The same shape and dtype give the same files (so a GGUF made from them
    is reused)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = dict(SHAPES[shape])
    if "vocab_size" in dims:
        from _common import id_tokenizer

        tokenizer = id_tokenizer(directory, dims["vocab_size"])
    else:
        tokenizer = _load_fake_engine().build_tokenizer(directory)
        dims["vocab_size"] = len(tokenizer)
    config = Qwen2Config(
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        **dims,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(directory))
    return directory


def _device() -> str:
    """Where `radixlm serve` will run by default: CUDA when torch sees a GPU."""
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def launch(
    name: str, model: str, port: int, log: Path, peer_args: str, threads: int = 0
) -> subprocess.Popen[bytes]:
    """`radixlm serve` or `transformers serve` on `model`, with `peer_args` (a shell-quoted
    string) appended; `threads` > 0 caps torch's compute threads (OMP_NUM_THREADS)."""
    if name.startswith("radixlm"):
        cmd = [sys.executable, "-m", "radixlm.server", "--model-path", model, "--port", str(port),
               "--served-model-name", model, "--log-level", "warning",
               *shlex.split(peer_args)]  # fmt: skip
    else:
        exe = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
        cmd = [exe, "serve", model, "--port", str(port), *shlex.split(peer_args),
               "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads > 0 else None
    print(f"+ {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def compare(args: argparse.Namespace) -> dict[str, dict[str, float] | None]:
    """radixlm serve and each of --peers on the same model and prompts, one after the other;
    with the limit probe on, each column also gets its `share_of_limit`."""
    model = args.model_path
    if model is None:
        model = str(
            build_dummy_model(
                args.dummy_model, Path(tempfile.mkdtemp(prefix="dummy-")), args.dummy_dtype
            )
        )
        print(f"dummy {args.dummy_model} model ({args.dummy_dtype}) in {model}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    prompts = build_prompts(args, tokenizer)
    prompt_ids = [
        tokenizer.encode(prompt_text(args.api, p, tokenizer), add_special_tokens=False)
        for p in prompts
    ]
    columns: dict[str, dict[str, float] | None] = {}
    names = MODES if args.compare_modes else ("radixlm", *args.peers)
    for name in names:
        columns[name] = _bench_server(name, model, tokenizer, args, count_tokens, prompts,
                                      [len(ids) for ids in prompt_ids])  # fmt: skip
    if not args.no_limit and not args.compare_modes:
        add_limit(columns, Path(model), prompt_ids, args)
    return columns


#: --compare-modes: `radixlm serve --engine-mode process`, then `--engine-mode thread`.
MODES = ("radixlm-process", "radixlm-thread")


def _bench_server(
    name: str,
    model: str,
    tokenizer: Any,
    args: argparse.Namespace,
    count_tokens: Callable[[str], int],
    prompts: list[Prompt],
    prompt_counts: list[int],
) -> dict[str, float] | None:
    """One server started, benched on `prompts` and stopped; None if it did not start."""
    port = _free_port()
    log = Path(tempfile.mkdtemp(prefix=f"{name}-")) / "server.log"
    url = f"http://127.0.0.1:{port}"
    stop: Callable[[], None]
    if name == "llamacpp":
        import _llamacpp

        try:
            gguf = _llamacpp.prepare_gguf(Path(model), args.llamacpp_outtype, args.llamacpp_quant)
            options = _llamacpp.ServerOptions(
                threads=args.threads, n_ctx=args.llamacpp_ctx,
                extra=tuple(shlex.split(args.llamacpp_args)),
            )  # fmt: skip
            server = _llamacpp.start_server(gguf, port, log, model, options, args.startup_timeout)
        except RuntimeError as error:
            print(f"[llamacpp] {error}", file=sys.stderr)
            return None
        stop = server.stop
        # radixlm gets ignore_eos; llama.cpp the same by a ban on the end-of-text tokens.
        banned = {str(i): -1e9 for i in tokenizer.all_special_ids}
        extra: dict[str, Any] = {"logit_bias": banned}
    else:
        if name in MODES:
            mode = name.removeprefix("radixlm-")
            peer_args = f"{args.radixlm_args} --engine-mode {mode}"
        else:
            peer_args = args.radixlm_args if name == "radixlm" else args.transformers_args
        process = launch(name, model, port, log, peer_args, args.threads)

        def stop() -> None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

        if not _wait_healthy(url, process, args.startup_timeout):
            stop()
            tail = log.read_text(errors="replace")[-1500:]
            print(f"[{name}] did not start; its log ends with:\n{tail}", file=sys.stderr)
            return None
        extra = {"ignore_eos": True} if name.startswith("radixlm") else {}
    try:
        return bench(args, url, model, extra, count_tokens, prompts, prompt_counts)
    finally:
        stop()


def add_limit(
    columns: dict[str, dict[str, float] | None],
    model: Path,
    prompt_ids: list[list[int]],
    args: argparse.Namespace,
) -> None:
    """Probes this machine's limit for the workload (limit_probe.py, radixlm's compute dtype
    unless --limit-dtype, --threads threads) and gives each column's duration as a share of
    it (`limit_s`, `share_of_limit`); prints the probe and the shares."""
    import limit_probe

    dtype = args.limit_dtype or limit_probe.compute_dtype(model, _radixlm_dtype(args.radixlm_args))
    concurrency = args.max_concurrency or len(prompt_ids)
    demand = limit_probe.serve_demand(prompt_ids, args.output_len, concurrency)
    batches = sorted({b for b, _ in demand.decode_steps}) or [1]
    config = json.loads((model / "config.json").read_text())
    rates = limit_probe.probe(
        limit_probe.ModelShape.from_config(config), dtype, args.threads, batches
    )
    limit = rates.limit_seconds(demand)
    print(f"machine limit probe: {rates.describe()}")
    print(f"workload: {demand.describe()} -> limit {limit:.1f} s")
    for name, column in columns.items():
        if column:
            column["limit_s"] = limit
            column["share_of_limit"] = limit_probe.share(limit, column["duration_s"])
            print(f"  limit {limit:.1f} s, {name} {column['duration_s']:.1f} s = "
                  f"{column['share_of_limit']:.0%} of limit")  # fmt: skip


def _radixlm_dtype(radixlm_args: str) -> str:
    """The --dtype in radixlm's server arguments ("auto" without one)."""
    words = shlex.split(radixlm_args)
    for i, word in enumerate(words):
        if word == "--dtype" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--dtype="):
            return word.split("=", 1)[1]
    return "auto"


def parse_peers(text: str) -> tuple[str, ...]:
    """--peers 'llamacpp,transformers' -> ('llamacpp', 'transformers'); 'none' -> ()."""
    if text.strip() in ("", "none"):
        return ()
    peers = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if bad := sorted(set(peers) - set(PEERS)):
        raise ValueError(f"unknown peers {bad}; choose from {', '.join(PEERS)} or none")
    return peers


def apply_preset(args: argparse.Namespace) -> None:
    """--workload NAME: its dataset, lengths (in tokens), request count and concurrency."""
    if args.workload:
        for key, value in PRESETS[args.workload].items():
            setattr(args, key, value)
        args.length_unit = "tokens"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked, with --peers parsed into a tuple and --workload applied."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:30000")
    target.add_argument("--model", default="default", help="model name sent in requests")
    target.add_argument("--api-key")
    target.add_argument("--fake", action="store_true", help="self-test on the toy engine")
    target.add_argument("--fake-token-delay", type=float, default=0.002)
    target.add_argument("--compare", action="store_true",
                        help="radixlm serve vs --peers on the same model")  # fmt: skip
    target.add_argument(
        "--compare-modes",
        action="store_true",
        help="like --compare, but radixlm against itself: the engine in its own "
        "process (--engine-mode process) and on a thread (thread)",
    )
    target.add_argument("--peers", default="transformers", help="servers --compare runs after "
                        "radixlm: comma-separated from transformers, llamacpp")  # fmt: skip
    target.add_argument("--model-path", help="model for --compare (default: a dummy model)")
    target.add_argument("--dummy-model", choices=sorted(SHAPES), default="tiny")
    target.add_argument("--dummy-dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="the dummy checkpoint's dtype")  # fmt: skip
    target.add_argument("--threads", type=int, default=0, help="compute threads of each "
                        "server in --compare (0: each one's default)")  # fmt: skip
    target.add_argument("--radixlm-args", default="", help="extra arguments of `radixlm "
                        "serve` in --compare, e.g. '--dtype float32'")  # fmt: skip
    target.add_argument("--startup-timeout", type=float, default=600)
    target.add_argument(
        "--transformers-args",
        default=f"--continuous-batching --device {_device()}",
        help="extra arguments of `transformers serve` in --compare (default: on the GPU when "
        "there is one, like radixlm)",
    )
    llama = parser.add_argument_group("llama.cpp peer (--peers llamacpp)")
    llama.add_argument("--llamacpp-outtype", choices=["bf16", "f16", "f32"], default="bf16",
                       help="the GGUF the checkpoint is converted to")  # fmt: skip
    llama.add_argument("--llamacpp-quant", choices=["Q8_0", "Q4_K_M"], default=None,
                       help="serve that GGUF quantized to this type")  # fmt: skip
    llama.add_argument("--llamacpp-ctx", type=int, default=4096, help="its context size")
    llama.add_argument("--llamacpp-args", default="", help="more `llama_cpp.server` "
                       "arguments, e.g. '--flash_attn True'")  # fmt: skip
    limit = parser.add_argument_group("machine limit (limit_probe.py)")
    limit.add_argument("--no-limit", action="store_true", help="skip the limit probe")
    limit.add_argument("--limit-dtype", help="the probe's dtype (default: what radixlm "
                       "computes the checkpoint in)")  # fmt: skip
    load = parser.add_argument_group("load")
    load.add_argument("--api", choices=["chat", "completions", "generate"], default="chat")
    load.add_argument("--workload", choices=sorted(PRESETS), help="a preset: few-shot (one "
                      "1,561-token prefix, 20-token questions) or no-sharing (~490-token "
                      "prompts), 16 requests at concurrency 8, lengths in tokens; overrides "
                      "the options below")  # fmt: skip
    load.add_argument("--dataset", choices=["random", "shared-prefix"], default="shared-prefix")
    load.add_argument("--length-unit", choices=["words", "tokens"], default="words",
                      help="what --input-len and --prefix-len count (tokens: of the "
                      "model's tokenizer; --compare only)")  # fmt: skip
    load.add_argument("--num-prompts", type=int, default=200)
    load.add_argument("--input-len", type=int, default=64, help="words per prompt / question")
    load.add_argument("--output-len", type=int, default=32, help="max tokens per answer")
    load.add_argument("--prefix-len", type=int, default=512, help="words of each shared prefix")
    load.add_argument("--num-groups", type=int, default=8, help="shared prefixes")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=2, help="untimed requests sent first")
    load.add_argument("--extra-body", default="{}", help="JSON merged into every request")
    load.add_argument("--output-json", help="write the figures here")
    args = parser.parse_args(argv)
    try:
        args.peers = parse_peers(args.peers)
    except ValueError as error:
        parser.error(str(error))
    apply_preset(args)
    if not (args.compare or args.compare_modes or args.fake or args.base_url):
        parser.error("give --base-url, --fake, --compare or --compare-modes")
    return args


def main() -> int:
    args = parse_args()
    extra = json.loads(args.extra_body)
    print(
        f"workload: {args.dataset}, {args.num_prompts} prompts, api {args.api}, rate "
        f"{args.request_rate}/s, concurrency {args.max_concurrency or 'unbounded'}, "
        f"input {args.input_len} {args.length_unit}, output {args.output_len} tokens"
        + (f", {args.num_groups} prefixes of {args.prefix_len} {args.length_unit}" if args.dataset == "shared-prefix" else "")
    )  # fmt: skip
    columns: dict[str, dict[str, float] | None]
    if args.compare or args.compare_modes:
        columns = compare(args)
    elif args.fake:
        url, model, stop = fake_server(args.fake_token_delay)
        try:
            columns = {
                "radixlm (toy engine)": bench(args, url, model, {"ignore_eos": True, **extra})
            }
        finally:
            stop()
    else:
        columns = {args.base_url: bench(args, args.base_url.rstrip("/"), args.model, extra)}
    print_table(columns)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(columns, indent=2))
    return 0 if all(columns.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
