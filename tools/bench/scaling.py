#!/usr/bin/env python3
"""How cost grows: HTTP servers' throughput and latency as concurrency and prompt length grow.

Two sweeps on the same dummy-weight model: concurrency (1, 4, 16, 64 streams open at once,
256-token prompts) and prompt length (256, 512, 1024, ... up to the model's context limit, 4
streams at once). Each point sends max(--min-requests, --rounds x concurrency) streamed
completions, at most `concurrency` open at a time; the prompts are random word tokens that the
id tokenizer spells one to one, so every server sees exactly the prompt length asked for, and
all servers get the same prompts. The servers run side by side and take turns point by point
(alternating which goes first), so a spell of load from elsewhere on a shared machine falls on
all of them alike; --repeats measures every point more than once (the figures are medians).
Each point records requests/s, output tokens/s, TTFT p50/p99 and inter-token latency p50/p99.
Writes scaling.json and one PNG per sweep (matplotlib, Agg) into --out (and --img).

    .venv/bin/python tools/bench/scaling.py --quick                      # tiny model, under a minute idle
    .venv/bin/python tools/bench/scaling.py --fake --quick               # toy engine, no model
    # docs/benchmarks.md's figures: the small shape, one compute thread per server, ~12 min
    .venv/bin/python tools/bench/scaling.py --peers radixlm,transformers,llamacpp --threads 1 \
        --img docs/img/bench
    .venv/bin/python tools/bench/scaling.py --from-json build/bench-scaling/scaling.json

Servers are started with serve_bench.py's launcher (`radixlm serve`, `transformers serve
--continuous-batching`) or its llama.cpp peer (tools/bench/_llamacpp.py, built once) and
driven by its load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import serve_bench
from _common import ID_TOKENS_FROM, QWEN25_05B_SHAPE, id_tokenizer, random_hf_model, write_config

ROOT = Path(__file__).resolve().parents[2]

#: Random-weight Qwen2 models; `max_position_embeddings` is the context limit of the sweep.
SHAPES: dict[str, dict[str, Any]] = {
    # A 2-layer model with a 2,048-token vocabulary: only the wiring and the engine's overhead.
    "tiny": {
        **QWEN25_05B_SHAPE, "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
    # Qwen2.5's family and full 151,936-token vocabulary with a small trunk (engine_bench's
    # --quick shape) and a 4,096-token context: the real sweep that fits ~20 min on 2 cores.
    "small": {
        **QWEN25_05B_SHAPE, "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
}  # fmt: skip

PEERS = ("radixlm", "transformers", "llamacpp")
METRICS = (
    "request_throughput", "output_tok_s", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms",
    "p99_itl_ms",
)  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One measurement: `requests` prompts of `prompt_len` tokens, `concurrency` at a time."""

    sweep: str  # "concurrency" or "prompt_len"
    concurrency: int
    prompt_len: int
    requests: int


@dataclass(frozen=True)
class Plan:
    """Both sweeps of one run."""

    concurrency: tuple[int, ...]
    concurrency_prompt_len: int
    prompt_lens: tuple[int, ...]
    prompt_concurrency: int
    output_len: int
    rounds: int
    min_requests: int

    def points(self) -> list[Point]:
        def count(concurrency: int) -> int:
            return max(self.min_requests, self.rounds * concurrency)

        out = [
            Point("concurrency", c, self.concurrency_prompt_len, count(c)) for c in self.concurrency
        ]
        c = self.prompt_concurrency
        out += [Point("prompt_len", c, p, count(c)) for p in self.prompt_lens]
        return out


def prompt_lengths(context: int, output_len: int, start: int = 256) -> tuple[int, ...]:
    """256, 512, 1024, ... while prompt and output fit, then the longest prompt that fits."""
    limit = context - output_len
    lengths = []
    length = start
    while length < limit:
        lengths.append(length)
        length *= 2
    if limit >= start:
        lengths.append(limit)
    return tuple(lengths)


def make_plan(args: argparse.Namespace, context: int) -> Plan:
    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x)

    lens = ints(args.prompt_lens) if args.prompt_lens else prompt_lengths(context, args.output_len)
    too_long = [p for p in lens if p + args.output_len > context]
    if too_long:
        raise SystemExit(
            f"--prompt-lens {too_long} plus --output-len {args.output_len} exceed the context "
            f"limit of {context} tokens; use shorter prompts or a longer --context"
        )
    return Plan(
        concurrency=ints(args.concurrency),
        concurrency_prompt_len=args.concurrency_prompt_len,
        prompt_lens=lens,
        prompt_concurrency=args.prompt_concurrency,
        output_len=args.output_len,
        rounds=args.rounds,
        min_requests=args.min_requests,
    )


def prompts_for(point: Point, tokenizer: Any, vocab: int, output_len: int, seed: int) -> list[Any]:
    """`point.requests` prompts of exactly `point.prompt_len` random word tokens (as text)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(point.requests):
        # The load generator strips the prompt, so it starts with a letter (a byte token) rather
        # than a word's leading space, which would be lost and the word split into bytes.
        ids = [1 + ord("x")]
        ids += [rng.randrange(ID_TOKENS_FROM, vocab) for _ in range(point.prompt_len - 1)]
        out.append(serve_bench.Prompt("", tokenizer.decode(ids), output_len))
    return out


# --------------------------------------------------------------------------------- servers


@dataclass(frozen=True)
class Server:
    """A server to measure: its label, base URL, the model name requests carry, extra body."""

    name: str
    url: str
    model: str
    extra: dict[str, Any]
    alive: Callable[[], bool] = lambda: True
    log: Path | None = None


def build_model(shape: str, context: int | None) -> tuple[Path, Any, int]:
    """Random weights (seed 0) of `shape` saved with the id tokenizer into a new temporary
    directory; (directory, tokenizer, context limit)."""
    config = dict(SHAPES[shape])
    if context is not None:
        config["max_position_embeddings"] = context
    config.update(bos_token_id=0, eos_token_id=0)
    directory = write_config(config, "float32", "scaling_")
    tokenizer = id_tokenizer(directory, config["vocab_size"])
    model = random_hf_model(directory, "float32")
    model.save_pretrained(str(directory))
    del model
    gc.collect()
    return directory, tokenizer, int(config["max_position_embeddings"])


def llamacpp_module() -> Any:
    """serve_bench's llama.cpp peer (tools/bench/_llamacpp.py), its build in place; exits with
    what to do when either is missing."""
    try:
        import _llamacpp
    except ImportError:
        raise SystemExit(
            "--peers llamacpp needs serve_bench's llama.cpp peer (tools/bench/_llamacpp.py), "
            "which this checkout does not have; leave llamacpp out of --peers"
        ) from None
    if not _llamacpp.is_installed():
        raise SystemExit(
            "--peers llamacpp: llama-cpp-python is not built yet; run "
            "`.venv/bin/python tools/bench/_llamacpp.py install` once (8-10 min on 2 cores)"
        )
    return _llamacpp


@contextmanager
def started(
    name: str, model_dir: Path, context: int, tokenizer: Any, args: argparse.Namespace
) -> Iterator[Server | None]:
    """`name`'s server on `model_dir` while the block runs (None, with its log printed, when it
    does not start)."""
    import subprocess

    port = serve_bench._free_port()
    log = Path(tempfile.mkdtemp(prefix=f"scaling-{name}-")) / "server.log"
    url = f"http://127.0.0.1:{port}"
    begun = time.perf_counter()
    stop: Callable[[], None]
    if name == "llamacpp":
        llamacpp = llamacpp_module()
        try:
            # The float32 checkpoint as a float32 GGUF, --threads (0: all cores), the context.
            gguf = llamacpp.prepare_gguf(model_dir, "f32")
            options = llamacpp.ServerOptions(threads=args.threads, n_ctx=context)
            running = llamacpp.start_server(
                gguf, port, log, str(model_dir), options, args.startup_timeout
            )
        except RuntimeError as error:
            print(f"[llamacpp] {error}", file=sys.stderr)
            yield None
            return
        stop = running.stop
        process = running.process
        # radixlm's ignore_eos, the llama.cpp way: the end-of-text tokens banned.
        extra: dict[str, Any] = {"logit_bias": {str(i): -1e9 for i in tokenizer.all_special_ids}}
    else:
        peer_args = args.transformers_args if name == "transformers" else ""
        process = serve_bench.launch(name, str(model_dir), port, log, peer_args, args.threads)

        def stop() -> None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

        if not serve_bench._wait_healthy(url, process, args.startup_timeout):
            stop()
            tail = log.read_text(errors="replace")[-1500:]
            print(f"[{name}] did not start; its log ends with:\n{tail}", file=sys.stderr)
            yield None
            return
        # radixlm takes ignore_eos, so every answer has the asked length; transformers serve
        # cannot and stops only on the EOS, which a random-weight model almost never picks.
        extra = {"ignore_eos": True} if name == "radixlm" else {}
    print(f"[{name}] up after {time.perf_counter() - begun:.1f} s", flush=True)
    try:
        yield Server(name, url, str(model_dir), extra, lambda: process.poll() is None, log)
    finally:
        stop()


@contextmanager
def fake_started(token_delay: float) -> Iterator[Server]:
    url, model, stop = serve_bench.fake_server(token_delay)
    try:
        yield Server("radixlm (toy engine)", url, model, {"ignore_eos": True})
    finally:
        stop()


# ------------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Workload:
    """What every server is sent: the plan's points as prompts of the id tokenizer."""

    plan: Plan
    tokenizer: Any
    vocab: int
    count_tokens: Callable[[str], int] | None  # for servers that report no usage
    seed: int

    def prompts(self, point: Point, seed: int) -> list[Any]:
        return prompts_for(point, self.tokenizer, self.vocab, self.plan.output_len, seed)


def warm_up(server: Server, work: Workload) -> None:
    """Four requests like the first point's, four at once, untimed: first prefills and first
    batched decodes pay for lazy set-up (allocations, warm-up) in every server."""
    point = Point("warmup", 4, work.plan.concurrency_prompt_len, 4)
    prompts = work.prompts(point, work.seed - 1)
    asyncio.run(
        serve_bench.run_load(server.url, "completions", server.model, prompts, math.inf, 4,
                             server.extra, 0)
    )  # fmt: skip


def measure_point(
    server: Server, point: Point, prompts: list[Any], work: Workload
) -> dict[str, Any]:
    """One point on one server: its figures (serve_bench's summary) as a row."""
    start = time.perf_counter()
    results, duration = asyncio.run(
        serve_bench.run_load(server.url, "completions", server.model, prompts, math.inf,
                             point.concurrency, server.extra, work.seed, None, work.count_tokens)
    )  # fmt: skip
    summary = serve_bench.summarize(results, duration)
    errors = [r.error for r in results if not r.ok]
    done = [r for r in results if r.ok]
    row = {"server": server.name, **asdict(point), **summary}
    # What the server counted (0 where it reports no usage): the prompts' exact length.
    row["prompt_tokens_mean"] = sum(r.prompt_tokens for r in done) / max(1, len(done))
    row["first_error"] = errors[0] if errors else ""
    print(
        f"  {server.name:14s} {point.sweep:11s} c={point.concurrency:<3d} "
        f"prompt={point.prompt_len:<5d} n={point.requests:<4d} "
        f"{summary['request_throughput']:7.2f} req/s {summary['output_tok_s']:8.1f} tok/s "
        f"TTFT p50 {summary['p50_ttft_ms']:8.0f} p99 {summary['p99_ttft_ms']:8.0f} ms  "
        f"ITL p50 {summary['p50_itl_ms']:6.1f} p99 {summary['p99_itl_ms']:6.1f} ms"
        + (f"  {len(errors)} failed: {errors[0][:80]}" if errors else "")
        + f"  ({time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    return row


def run_sweeps(servers: list[Server], work: Workload, repeats: int) -> list[dict[str, Any]]:
    """Every point `repeats` times on every server, the servers taking turns point by point
    (in alternating order), so a spell of load from elsewhere on the machine falls on all of
    them alike; each server gets the same prompts. One row per point, server and repeat."""
    for server in servers:
        warm_up(server, work)
    rows = []
    gone: set[str] = set()
    for k, point in enumerate(work.plan.points()):
        for repeat in range(repeats):
            prompts = work.prompts(point, work.seed + 1000 * k + repeat)
            order = servers if (k + repeat) % 2 == 0 else servers[::-1]
            for server in order:
                if server.name in gone:
                    continue
                if not server.alive():
                    gone.add(server.name)
                    print(f"[{server.name}] is no longer running (its log: {server.log}); its "
                          "remaining points are left out", file=sys.stderr, flush=True)  # fmt: skip
                    continue
                rows.append({**measure_point(server, point, prompts, work), "repeat": repeat})
    return rows


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per server and point: the median of each figure over its repeats, with the
    lowest and highest requests/s; completed and failed requests summed over the repeats."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        point = (run["server"], run["sweep"], run["concurrency"], run["prompt_len"])
        groups.setdefault(point, []).append(run)
    rows = []
    for same in groups.values():
        row = dict(same[0])
        del row["repeat"]
        for name in [k for k, v in row.items() if isinstance(v, float)]:
            finite = [r[name] for r in same if not math.isnan(r[name])]
            row[name] = statistics.median(finite) if finite else math.nan
        row["completed"] = sum(r["completed"] for r in same)
        row["failed"] = sum(r["failed"] for r in same)
        row["repeats"] = len(same)
        speeds = [r["request_throughput"] for r in same]
        row["request_throughput_min"], row["request_throughput_max"] = min(speeds), max(speeds)
        row["first_error"] = next((r["first_error"] for r in same if r["first_error"]), "")
        rows.append(row)
    servers = list(dict.fromkeys(r["server"] for r in runs))
    return sorted(rows, key=lambda r: servers.index(r["server"]))  # stable: points in order


# -------------------------------------------------------------------------------- plotting

COLORS = {"radixlm": "#1f77b4", "transformers": "#ff7f0e", "llamacpp": "#2ca02c"}
PANELS = (
    ("requests / s", ("request_throughput",)),
    ("output tokens / s", ("output_tok_s",)),
    ("TTFT (ms), p50 — and p99 --", ("p50_ttft_ms", "p99_ttft_ms")),
    ("inter-token latency (ms), p50 — and p99 --", ("p50_itl_ms", "p99_itl_ms")),
)
SWEEPS = {"concurrency": "concurrent streams", "prompt_len": "prompt length (tokens)"}


def plot(rows: list[dict[str, Any]], folder: Path, title: str) -> list[Path]:
    """One 2x2 PNG per sweep in `folder` (log-scaled axes); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    drawn = []
    servers = list(dict.fromkeys(r["server"] for r in rows))
    for sweep, xlabel in SWEEPS.items():
        picked = [r for r in rows if r["sweep"] == sweep and r["completed"]]
        if not picked:
            continue
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        for ax, (label, keys) in zip(axes.flat, PANELS, strict=True):
            for server in servers:
                mine = sorted((r for r in picked if r["server"] == server), key=lambda r: r[sweep])
                xs = [r[sweep] for r in mine]
                color = COLORS.get(server.split()[0])
                for key, style in zip(keys, ("-o", "--s"), strict=False):
                    ys = [r[key] for r in mine]
                    shown = server if key == keys[0] else None
                    ax.plot(xs, ys, style, color=color, label=shown, markersize=4)
            ax.set_xscale("log", base=2)
            if "ms" in label:  # latencies span decades; throughputs read better from zero
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_xticks(sorted({r[sweep] for r in picked}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.minorticks_off()
            ax.set_xlabel(xlabel)
            ax.set_title(label, fontsize=10)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        fixed = (
            f"prompts of {picked[0]['prompt_len']} tokens"
            if sweep == "concurrency"
            else f"{picked[0]['concurrency']} concurrent streams"
        )
        fig.suptitle(f"{title}: {fixed}", fontsize=11)
        fig.tight_layout()
        path = folder / f"scaling_{sweep}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        drawn.append(path)
    return drawn


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a markdown table."""
    head = (
        "| server | sweep | concurrency | prompt tokens | requests | failed | req/s | out tok/s "
        "| TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speed = f"{r['request_throughput']:.2f}"
        if r.get("repeats", 1) > 1:
            speed += f" ({r['request_throughput_min']:.2f}–{r['request_throughput_max']:.2f})"
        lines.append(
            f"| {r['server']} | {r['sweep']} | {r['concurrency']} | {r['prompt_len']} "
            f"| {r['requests']} | {r['failed']} | {speed} "
            f"| {r['output_tok_s']:.1f} | {r['p50_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
            f"| {r['p50_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--peers", default="radixlm,transformers",
                        help=f"servers to measure, some of {','.join(PEERS)}")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and few requests: about a minute on 2 cores")  # fmt: skip
    parser.add_argument("--fake", action="store_true",
                        help="only the server's toy engine, in process (no model; a self-test)")  # fmt: skip
    parser.add_argument("--fake-token-delay", type=float, default=0.001)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: tiny with --quick, "
                        "else small")  # fmt: skip
    parser.add_argument("--context", type=int, help="the model's context limit (default: the "
                        "shape's)")  # fmt: skip
    parser.add_argument("--concurrency", help="concurrency sweep (default 1,4,16,64; 1,4,16 quick)")
    parser.add_argument("--concurrency-prompt-len", type=int,
                        help="prompt tokens in the concurrency sweep (default 256)")  # fmt: skip
    parser.add_argument("--prompt-lens", help="prompt-length sweep (default 256, 512, ... up to "
                        "the context limit)")  # fmt: skip
    parser.add_argument("--prompt-concurrency", type=int,
                        help="streams at once in the prompt-length sweep (default 4; 2 quick)")  # fmt: skip
    parser.add_argument("--output-len", type=int, help="tokens per answer (default 32; 8 quick)")
    parser.add_argument("--rounds", type=int, help="requests per point = rounds x concurrency "
                        "(default 2; 1 quick)")  # fmt: skip
    parser.add_argument("--min-requests", type=int, help="fewest requests per point "
                        "(default 8; 2 quick)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="measure every point this many "
                        "times (servers taking turns); the figures are the medians")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="compute threads of each server "
                        "(0: each one's default, all cores)")  # fmt: skip
    parser.add_argument("--startup-timeout", type=float, default=600)
    # --cb-max-batch-tokens: radixlm's default prefill budget per step (chunked_prefill_size
    # 2048). With transformers' own default (8192) its prefill computes the logits of every
    # prompt token, and 64 streams of 256 tokens took it past 13 GB (killed for memory).
    parser.add_argument("--transformers-args",
                        default=f"--continuous-batching --device {serve_bench._device()} "
                        "--dtype float32 --cb-max-batch-tokens 2048",
                        help="extra arguments of `transformers serve`")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench-scaling",
                        help="folder for scaling.json and the plots")  # fmt: skip
    parser.add_argument("--img", type=Path, help="also save the plots here (e.g. docs/img/bench)")
    parser.add_argument("--from-json", type=Path, help="only redraw the plots of a scaling.json")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "shape": "tiny" if quick else "small",
        "concurrency": "1,4,16" if quick else "1,4,16,64",
        "concurrency_prompt_len": 256,
        "prompt_concurrency": 2 if quick else 4,
        "output_len": 8 if quick else 32,
        "rounds": 1 if quick else 2,
        "min_requests": 2 if quick else 8,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def title_of(meta: dict[str, Any]) -> str:
    return f"{meta['shape_name']} ({meta['shape_text']})"


def shape_text(config: dict[str, Any]) -> str:
    return (
        f"Qwen2, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"vocab {config['vocab_size']:,}, context {config['max_position_embeddings']:,}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for folder in {args.out, args.img} - {None}:
            for path in plot(saved["rows"], folder, title_of(saved["meta"])):
                print(f"plot: {path}")
        return 0
    peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; choose among {','.join(PEERS)}")
    if "llamacpp" in peers:
        llamacpp_module()  # fail before building anything
    began = time.perf_counter()
    from report import machine

    meta: dict[str, Any] = {
        "command": " ".join(["python", "tools/bench/scaling.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
    }
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if args.fake:
            context = args.context or 4096
            tokenizer = id_tokenizer(Path(tempfile.mkdtemp(prefix="scaling-tok-")), 2048)
            plan = make_plan(args, context)
            meta.update(shape_name="toy engine", shape_text=f"no model, context {context}")
            work = Workload(plan, tokenizer, 2048, None, args.seed)
            servers = [stack.enter_context(fake_started(args.fake_token_delay))]
        else:
            model_dir, tokenizer, context = build_model(args.shape, args.context)
            config = json.loads((model_dir / "config.json").read_text())
            plan = make_plan(args, context)
            meta.update(shape_name=args.shape, shape_text=shape_text(config), config=config)
            print(f"{args.shape} model in {model_dir}: {shape_text(config)}", flush=True)

            def count_tokens(text: str) -> int:
                return len(tokenizer.encode(text, add_special_tokens=False))

            work = Workload(plan, tokenizer, config["vocab_size"], count_tokens, args.seed)
            started_ones = [
                stack.enter_context(started(name, model_dir, context, tokenizer, args))
                for name in peers
            ]
            servers = [server for server in started_ones if server is not None]
        runs = run_sweeps(servers, work, args.repeats)
    rows = aggregate(runs)
    meta.update(plan=asdict(plan), minutes=round((time.perf_counter() - began) / 60, 1))
    meta["load_average_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {"meta": meta, "rows": rows, "runs": runs}
    (args.out / "scaling.json").write_text(json.dumps(figures, indent=2))
    print(table(rows))
    for folder in {args.out, args.img} - {None}:
        for path in plot(rows, folder, title_of(meta)):
            print(f"plot: {path}")
    print(f"figures: {args.out / 'scaling.json'} ({meta['minutes']} min)")
    missing = [] if args.fake else [p for p in peers if p not in {r["server"] for r in rows}]
    if missing:
        print(f"not measured (did not start): {', '.join(missing)}", file=sys.stderr)
    return 1 if missing or not rows else 0


if __name__ == "__main__":
    # A terminated run still stops the server it started (the `finally` of `started`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
