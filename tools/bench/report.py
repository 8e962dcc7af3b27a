#!/usr/bin/env python3
"""The benchmark report: run the paper's workloads, draw the plots, rewrite docs/benchmarks.md.

One command runs `engine_bench.py` (radixlm, radixlm without its cache, radixlm without
jump-forward, transformers `generate_batch`) and, with --with-serve, `serve_bench.py --compare`
(radixlm serve vs transformers serve over HTTP); it keeps the raw figures in a results folder,
draws PNG plots into docs/img/bench/ and rewrites the part of docs/benchmarks.md between
`<!-- report:start -->` and `<!-- report:end -->` (the rest of the page is kept).

    .venv/bin/python tools/bench/report.py --quick --workloads few_shot,json   # a smoke run
    .venv/bin/python tools/bench/report.py --with-serve                        # full size (long)
    .venv/bin/python tools/bench/report.py --from-json build/bench-report      # re-render only

On a machine with a GPU the same command measures larger shapes (Llama-3.1-8B, bfloat16, four
times the requests) and adds vLLM and SGLang as peers where they are installed; engine_bench.py
decides (--engine-args "--device cpu" or "--peers none" to override).

The results folder (default build/bench-report, git-ignored) holds engine.json, serve.json
(with --with-serve), the logs, and meta.json (the command, the shapes, the machine).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
START, END = "<!-- report:start -->", "<!-- report:end -->"
HTTP_START, HTTP_END = "<!-- report-http:start -->", "<!-- report-http:end -->"

SYSTEMS = {
    "radixlm": "radixlm",
    "radixlm-nocache": "radixlm, no cache",
    "radixlm-nojf": "radixlm, no jump-forward",
    "transformers": "transformers generate_batch",
    "vllm": "vLLM",
    "sglang": "SGLang",
    "radixlm-serve": "radixlm serve",
    "transformers-serve": "transformers serve",
}
COLORS = {
    "radixlm": "#1f77b4",
    "radixlm-nocache": "#9ecae1",
    "radixlm-nojf": "#6baed6",
    "transformers": "#ff7f0e",
    "vllm": "#2ca02c",
    "sglang": "#d62728",
    "radixlm-serve": "#1f77b4",
    "transformers-serve": "#ff7f0e",
}
PEERS = ("vllm", "sglang")
SHAPES = {
    "quick": "quick: the Qwen2 family with its 151,936-token vocabulary, 4 layers, hidden size "
    "256, 4 heads / 2 KV heads, 8 output tokens per call",
    "qwen2.5-0.5b": "Qwen2.5-0.5B: 24 layers, hidden size 896, 14 heads / 2 KV heads, vocabulary "
    "151,936, tied embeddings, 16 output tokens per call",
    "llama-3.1-8b": "Llama-3.1-8B: 32 layers, hidden size 4096, 32 heads / 8 KV heads, "
    "vocabulary 128,256, 16 output tokens per call",
}


def setup_of(engine: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Shape, dtype, device and scale of the run (older results only knew `quick`)."""
    first = engine[0] if engine else {}
    return {
        "shape": first.get("shape", "quick" if meta.get("quick") else "qwen2.5-0.5b"),
        "dtype": first.get("dtype", "float32"),
        "device": first.get("device", "cpu"),
        "scale": first.get("scale", 1),
    }


# serve_bench --compare: radixlm serve and transformers serve, one after the other.
SERVE_ARGS = {
    True: "--dummy-model tiny --num-prompts 32 --max-concurrency 8 --prefix-len 128 "
    "--input-len 16 --output-len 16",
    False: "--dummy-model qwen2.5-0.5b --num-prompts 64 --max-concurrency 16 --prefix-len 512 "
    "--input-len 32 --output-len 32",
}


# The paper's workloads over HTTP: radixlm serve and transformers serve, on the engine run's
# shapes and request counts (on a GPU: the engine run's scale).
HTTP_SCALE = {"cpu": 1.0, "cuda": 4.0}


# --------------------------------------------------------------------------------- running


def run_logged(cmd: list[str], log: Path) -> int:
    """Run `cmd`, echoing its output and keeping it in `log`; its exit status."""
    print(f"+ {shlex.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (
        log.open("w") as sink,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        ) as process,
    ):
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sink.write(line)
        return process.wait()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    info["cores"] = os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        info["usable_cores"] = len(os.sched_getaffinity(0))
    info["load_average"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    import torch

    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["gpus"] = [
        torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
    ] if torch.cuda.is_available() else []  # fmt: skip
    info["platform"] = platform.platform()
    info["python"] = platform.python_version()
    info["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    info["commit"] = git.stdout.strip() or None
    return info


def _shown(cmd: list[str]) -> str:
    """`cmd` as a reader would type it from the repository root."""
    shown = ["python"]
    for part in cmd[1:]:
        path = Path(part)
        shown.append(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else part)
    return shlex.join(shown)


def run_benchmarks(args: argparse.Namespace, results: Path) -> int:
    results.mkdir(parents=True, exist_ok=True)
    for stale in ("engine.json", "serve.json"):
        (results / stale).unlink(missing_ok=True)
    meta = {
        "command": shlex.join(["python", "tools/bench/report.py", *sys.argv[1:]]),
        "quick": args.quick,
        "workloads": args.workloads,
        "with_serve": args.with_serve,
        "machine": machine(),
    }
    engine = [sys.executable, str(HERE / "engine_bench.py"), "--json", str(results / "engine.json")]
    engine += ["--quick"] * args.quick + ["--workloads", args.workloads]
    engine += shlex.split(args.engine_args)
    started = dt.datetime.now()
    status = run_logged(engine, results / "engine.log")
    meta["engine_minutes"] = round((dt.datetime.now() - started).total_seconds() / 60, 1)
    meta["engine_command"] = _shown(engine)
    if status != 0:
        print(f"engine_bench failed (exit {status}); see {results / 'engine.log'}", file=sys.stderr)
        return status
    if args.with_serve:
        serve = [sys.executable, str(HERE / "serve_bench.py"), "--compare"]
        serve += ["--output-json", str(results / "serve.json")]
        serve += shlex.split(args.serve_args or SERVE_ARGS[args.quick])
        started = dt.datetime.now()
        status = run_logged(serve, results / "serve.log")
        meta["serve_minutes"] = round((dt.datetime.now() - started).total_seconds() / 60, 1)
        meta["serve_command"] = _shown(serve)
        if status != 0:
            print(f"serve_bench exited {status}: rendering what it measured", file=sys.stderr)
    (results / "meta.json").write_text(json.dumps(meta, indent=2))
    if args.with_serve:
        run_http(args, results)
    return 0


def run_http(args: argparse.Namespace, results: Path) -> int:
    """The paper's workloads through radixlm serve and transformers serve (engine_bench
    --http): http.json, with http_meta.json (command, machine, duration)."""
    results.mkdir(parents=True, exist_ok=True)
    (results / "http.json").unlink(missing_ok=True)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cmd = [sys.executable, str(HERE / "engine_bench.py"), "--json", str(results / "http.json")]
    cmd += ["--quick"] * args.quick + ["--workloads", args.workloads, "--skip-in-process"]
    cmd += ["--http", "radixlm,transformers", "--peers", "none"]
    cmd += ["--scale", str(HTTP_SCALE[device]), *shlex.split(args.engine_args)]
    meta = {
        "command": shlex.join(["python", "tools/bench/report.py", *sys.argv[1:]]),
        "machine": machine(),
    }
    started = dt.datetime.now()
    status = run_logged(cmd, results / "http.log")
    meta["minutes"] = round((dt.datetime.now() - started).total_seconds() / 60, 1)
    meta["http_command"] = _shown(cmd)
    (results / "http_meta.json").write_text(json.dumps(meta, indent=2))
    if status != 0:
        print(f"engine_bench --http exited {status}: rendering what it measured", file=sys.stderr)
    return status


# ----------------------------------------------------------------------------------- plots


def _rows(engine: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[Any, Any]]:
    workloads = list(dict.fromkeys(r["workload"] for r in engine))
    present = {r["system"] for r in engine}
    systems = [s for s in SYSTEMS if s in present]
    return workloads, systems, {(r["workload"], r["system"]): r for r in engine}


def _grouped(ax: Any, workloads: list[str], series: dict[str, list[float]], fmt: str) -> None:
    """Grouped bars: one group per workload, one bar per series, each bar labelled."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(workloads))]
        bars = ax.bar(xs, values, width, label=SYSTEMS.get(name, name), color=COLORS.get(name))
        ax.bar_label(bars, labels=[fmt.format(v) if v == v else "" for v in values], fontsize=7)
    ax.set_xticks(range(len(workloads)), [w.replace("_", " ") for w in workloads])
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def plot(engine: list[dict[str, Any]], serve: dict[str, Any] | None, img: Path) -> list[str]:
    """Draw the PNGs into `img`; their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    workloads, systems, by = _rows(engine)
    drawn: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(img / name, dpi=110)
        plt.close(fig)
        drawn.append(name)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    series = {s: [_get(by, w, s, "requests_per_s") for w in workloads] for s in systems}
    _grouped(ax, workloads, series, "{:.2f}")
    ax.set_ylabel("requests / s")
    ax.set_title("Throughput per workload")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(9, 4))
    hits = {
        "radixlm": [_get(by, w, "radixlm", "hit_rate") * 100 for w in workloads],
        **{p: [_get(by, w, p, "hit_rate") * 100 for w in workloads] for p in systems if p in PEERS},
        "optimal": [_get(by, w, "radixlm", "optimal_hit_rate") * 100 for w in workloads],
    }
    _grouped(ax, workloads, hits, "{:.0f}%")
    ax.set_ylim(0, 110)
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title("Prefix-cache hit rate against the optimal one")
    save(fig, "hit_rate.png")

    if "transformers" in systems:
        fig, ax = plt.subplots(figsize=(9, 4))
        ratios = {
            s: [_ratio(by, w, s, "transformers") for w in workloads]
            for s in systems
            if s != "transformers"
        }
        _grouped(ax, workloads, ratios, "{:.1f}x")
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_ylabel("requests / s ÷ transformers")
        ax.set_title("Speed-up over transformers generate_batch")
        save(fig, "ratio_vs_transformers.png")

    columns = {k: v for k, v in (serve or {}).items() if v}
    if columns:
        metrics = [
            ("request_throughput", "requests / s"),
            ("mean_ttft_ms", "mean TTFT (ms)"),
            ("p99_e2e_ms", "p99 latency (ms)"),
        ]
        fig, axes = plt.subplots(1, len(metrics), figsize=(10, 3.6))
        for ax, (key, label) in zip(axes, metrics, strict=True):
            names = list(columns)
            values = [_value(columns[n], key) for n in names]
            bars = ax.bar(names, values, color=["#1f77b4", "#ff7f0e"][: len(names)])
            shown = [f"{v:.0f}" if v >= 100 else f"{v:.2f}" for v in values]
            ax.bar_label(bars, labels=shown, fontsize=8)
            ax.set_title(label, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
        fig.suptitle("radixlm serve against transformers serve (HTTP, chat API)")
        save(fig, "serve.png")
    return drawn


def _get(by: dict[Any, Any], workload: str, system: str, key: str) -> float:
    row = by.get((workload, system))
    return float(row[key]) if row else math.nan


def _value(column: dict[str, Any], key: str) -> float:
    value = column.get(key)
    return math.nan if value is None else float(value)


def _ratio(by: dict[Any, Any], workload: str, system: str, peer: str) -> float:
    peer_value = _get(by, workload, peer, "requests_per_s")
    return _get(by, workload, system, "requests_per_s") / peer_value


# -------------------------------------------------------------------------------- markdown


def _num(value: float, fmt: str = "{:.2f}") -> str:
    return "–" if math.isnan(value) else fmt.format(value)


def _table_head(head: list[str]) -> list[str]:
    return ["| workload | " + " | ".join(head) + " |", "|---" + "|---:" * len(head) + "|"]


def _speeds(by: dict[Any, Any], workload: str, systems: list[str]) -> list[str]:
    """Each system's "requests/s (output tokens/s)" cell on `workload`."""
    return [
        f"{_num(_get(by, workload, s, 'requests_per_s'))} "
        f"({_num(_get(by, workload, s, 'output_tokens_per_s'), '{:.1f}')})"
        for s in systems
    ]


def _measured(m: dict[str, Any], command: str) -> list[str]:
    """When, at which commit and with which command the figures were measured."""
    return [
        f"Measured {m['date']} at commit `{m.get('commit') or '?'}` with:",
        "",
        "```bash",
        command,
        "```",
        "",
    ]


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"**Machine.** {m['cpu']}, {m['cores']} cores ({m.get('usable_cores', '?')} usable), "
        f"{m.get('memory_gb', '?')} GB memory, "
        + (f"GPUs: {', '.join(m['gpus'])}" if m["gpus"] else "no GPU")
        + f"; torch {m['torch']} with {m['torch_threads']} threads, Python {m['python']}, "
        f"{m['platform']}; load average {m.get('load_average')} at the start."
    )


def render(
    engine: list[dict[str, Any]],
    serve: dict[str, Any] | None,
    meta: dict[str, Any],
    plots: list[str],
) -> str:
    workloads, systems, by = _rows(engine)
    setup = setup_of(engine, meta)
    m = meta["machine"]
    lines = [
        *_measured(m, meta["command"]),
        f"**Model shapes.** {SHAPES.get(setup['shape'], setup['shape'])}; dummy (random) "
        f"weights in {setup['dtype']} on {setup['device']}, shared by radixlm and transformers; "
        "synthetic token ids from a fixed seed"
        + (f"; request counts × {setup['scale']}" if setup["scale"] != 1 else "")
        + ".",
        "",
        f"{machine_line(m)} The engine run took {meta.get('engine_minutes', '?')} min.",
        "",
        "### Engine throughput {#report-engine}",
        "",
        "Requests per second (output tokens per second in brackets); × columns: radixlm's "
        "requests per second over the other system's. Every workload but `json` asks for a "
        "fixed number of output tokens, so there the two ratios agree. On `json` requests per "
        "second is the measure: jump-forward appends forced text as it tokenizes (often fewer, "
        "longer tokens), so its outputs take fewer tokens, and the model, seeing other tokens, "
        "can continue differently"
        + (
            "; transformers cannot constrain `generate_batch` per request and decodes 48 "
            "unconstrained tokens."
            if "transformers" in systems
            else "."
        ),
        "",
    ]
    if meta.get("engine_note"):  # what a run found that the tables cannot say
        lines += [meta["engine_note"], ""]
    if any(s in PEERS for s in systems):
        lines += [
            "The peers (vLLM, SGLang) each run in their own process on their own dummy weights "
            "with their own defaults, prefix caching on; on `json` their constrained outputs "
            "follow their own random weights, so their lengths can differ from radixlm's.",
            "",
        ]
    head = [SYSTEMS[s] for s in systems] + [f"× {SYSTEMS[s]}" for s in systems[1:]]
    lines += _table_head(head)
    for w in workloads:
        cells = _speeds(by, w, systems)
        cells += [_num(_ratio(by, w, "radixlm", s), "{:.2f}×") for s in systems[1:]]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "### Cache hit rate against optimal {#report-hit-rate}",
        "",
        "Optimal: every reusable prefix computed once, with an unbounded cache.",
        "",
    ]
    peers = [s for s in systems if s in PEERS]
    head = ["radixlm hit rate", "optimal", "share of optimal"]
    head += [f"{SYSTEMS[p]} hit rate" for p in peers]
    lines += _table_head(head)
    for w in workloads:
        hit, best = _get(by, w, "radixlm", "hit_rate"), _get(by, w, "radixlm", "optimal_hit_rate")
        share = hit / best if best else math.nan
        cells = [_num(v * 100, "{:.1f} %") for v in (hit, best, share)]
        cells += [_num(_get(by, w, p, "hit_rate") * 100, "{:.1f} %") for p in peers]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in plots:
        if name != "serve.png":
            title = name.removesuffix(".png").replace("_", " ")
            lines += [f"![{title}](img/bench/{name})", ""]
    columns = serve or {}
    if columns:
        lines += ["### Server under load {#report-serve}", ""]
        if meta.get("serve_command"):
            lines += ["```bash", meta["serve_command"], "```", ""]
        if meta.get("serve_note"):  # e.g. a rerun of the serve comparison alone
            lines += [meta["serve_note"], ""]
        names = list(columns)
        lines += ["| | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
        rows = [
            ("completed", "completed requests", "{:.0f}"),
            ("failed", "failed requests", "{:.0f}"),
            ("request_throughput", "requests/s", "{:.2f}"),
            ("output_tok_s", "output tok/s", "{:.1f}"),
            ("mean_ttft_ms", "mean TTFT (ms)", "{:.0f}"),
            ("p99_ttft_ms", "p99 TTFT (ms)", "{:.0f}"),
            ("mean_itl_ms", "mean ITL (ms)", "{:.0f}"),
            ("p99_e2e_ms", "p99 end-to-end (ms)", "{:.0f}"),
        ]
        for key, label, fmt in rows:
            cells = [_num(_value(columns[n], key), fmt) if columns[n] else "failed" for n in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        if "serve.png" in plots:
            lines += ["![serve](img/bench/serve.png)", ""]
    return "\n".join(lines)


def rewrite(page: Path, body: str, start: str = START, end: str = END) -> None:
    """Replace the text between the `start` and `end` markers of `page` with `body`; a missing
    HTTP part goes right after the report, a missing report at the end of the page."""
    text = page.read_text()
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        text = before + block + after
    elif start == HTTP_START and END in text:
        before, after = text.split(END, 1)
        text = before + END + "\n\n" + block + after
    else:
        text = text.rstrip() + "\n\n## Report {#report}\n\n" + block + "\n"
    page.write_text(text)


def render_http(rows: list[dict[str, Any]], meta: dict[str, Any], plots: list[str]) -> str:
    """The HTTP part: the workloads through radixlm serve and transformers serve."""
    workloads, systems, by = _rows(rows)
    setup = setup_of(rows, {})
    m = meta["machine"]
    counts = "the engine run's request counts" + (
        f" × {setup['scale']}" if setup["scale"] != 1 else ""
    )
    lines = [
        "### The workloads over HTTP {#report-http}",
        "",
        *_measured(m, meta["command"]),
        "which runs:",
        "",
        "```bash",
        meta["http_command"],
        "```",
        "",
        "The same workloads sent to `radixlm serve` and `transformers serve --continuous-batching` "
        "over the OpenAI completions API, each stage's requests at once, one server after the "
        f"other on the same dummy weights ({SHAPES.get(setup['shape'], setup['shape'])}, "
        f"{setup['dtype']} on {setup['device']}), with {counts}. The model directory's tokenizer "
        "spells every token id as its own text, so both servers see the in-process token "
        "sequences. `transformers serve` takes neither `n` nor a JSON schema on completions: "
        "self-consistency sends its 8 samples as 8 requests to both servers, and on `json` "
        "transformers decodes 48 unconstrained tokens while radixlm follows the schema with "
        "jump-forward. radixlm's hit rate comes from the cached tokens its responses report. "
        "The in-process run forks self-consistency's n = 8 samples through the cache; here the "
        "8 identical requests arrive together, and the copies wait a step for the first, which "
        "computes its 30 question tokens past the cached prefix, and take them from the cache.",
        "",
        f"{machine_line(m)} This part took {meta.get('minutes', '?')} min.",
        "",
    ]
    head = [f"{SYSTEMS[s]} req/s (tok/s)" for s in systems]
    both = "radixlm-serve" in systems and "transformers-serve" in systems
    head += ["× transformers serve"] * both + ["radixlm serve hit rate", "optimal"]
    lines += _table_head(head)
    for w in workloads:
        cells = _speeds(by, w, systems)
        if both:
            cells.append(_num(_ratio(by, w, "radixlm-serve", "transformers-serve"), "{:.2f}×"))
        for key in ("hit_rate", "optimal_hit_rate"):
            cells.append(_num(_get(by, w, "radixlm-serve", key) * 100, "{:.1f} %"))
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines.append("")
    if "http.png" in plots:
        lines += ["![over HTTP](img/bench/http.png)", ""]
    return "\n".join(lines)


def plot_http(rows: list[dict[str, Any]], img: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    workloads, systems, by = _rows(rows)
    fig, ax = plt.subplots(figsize=(9, 4))
    series = {s: [_get(by, w, s, "requests_per_s") for w in workloads] for s in systems}
    _grouped(ax, workloads, series, "{:.2f}")
    ax.set_ylabel("requests / s")
    ax.set_title("The workloads over HTTP: radixlm serve and transformers serve")
    fig.tight_layout()
    fig.savefig(img / "http.png", dpi=110)
    plt.close(fig)
    return ["http.png"]


def render_http_part(results: Path, args: argparse.Namespace) -> int:
    """Draw http.png and rewrite the HTTP part of the page from `results` (if it was run)."""
    source = results / "http.json"
    if not source.exists():
        print(f"no {source}: the HTTP part of the page is left as it is", file=sys.stderr)
        return 1
    rows = json.loads(source.read_text())
    meta = json.loads((results / "http_meta.json").read_text())
    if not rows:
        print("neither server measured anything; the page is left as it is", file=sys.stderr)
        return 1
    plots = plot_http(rows, args.img)
    rewrite(args.page, render_http(rows, meta, plots), HTTP_START, HTTP_END)
    print(f"wrote {args.img / 'http.png'} and rewrote the HTTP part of {args.page}")
    return 0


# ------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small shapes (minutes, not hours)")
    parser.add_argument(
        "--workloads",
        default="few_shot,multi_turn,tree_of_thought,json,self_consistency",
        help="comma-separated, passed to engine_bench",
    )
    parser.add_argument("--with-serve", action="store_true", help="also the servers over HTTP: "
                        "the workloads (engine_bench --http) and serve_bench --compare")  # fmt: skip
    parser.add_argument("--http-only", action="store_true", help="only the workloads over HTTP; "
                        "rewrites only their part of the page")  # fmt: skip
    parser.add_argument("--engine-args", default="", help="more engine_bench arguments")
    parser.add_argument("--serve-args", default="", help="serve_bench arguments (replace ours)")
    parser.add_argument("--results", type=Path, default=ROOT / "build" / "bench-report")
    parser.add_argument("--from-json", type=Path, metavar="DIR", help="re-render DIR, run nothing")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img" / "bench")
    args = parser.parse_args()

    results = args.from_json or args.results
    if args.http_only:
        if args.from_json is None:
            run_http(args, results)
        return render_http_part(results, args)
    if args.from_json is None:
        status = run_benchmarks(args, results)
        if status != 0:
            return status
    engine = json.loads((results / "engine.json").read_text())
    serve_file = results / "serve.json"
    serve = json.loads(serve_file.read_text()) if serve_file.exists() else None
    meta = json.loads((results / "meta.json").read_text())
    for stale in args.img.glob("*.png") if args.img.exists() else []:
        if stale.name != "http.png":  # the HTTP part's plot goes with its own part
            stale.unlink()
    plots = plot(engine, serve, args.img)
    rewrite(args.page, render(engine, serve, meta, plots))
    print(f"wrote {', '.join(plots)} into {args.img} and rewrote {args.page}")
    if (results / "http.json").exists():
        return render_http_part(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
