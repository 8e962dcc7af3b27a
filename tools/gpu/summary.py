#!/usr/bin/env python3
"""The summary of a tools/gpu/run.sh folder: its steps and figures as summary.md and
summary.json beside them, and the steps table printed.

    python tools/gpu/summary.py DIR --steps STEPS.tsv [--dry-run 0|1] [--total S] [--packed 0|1]

STEPS.tsv has one line per step run: name, seconds, status, exit code, time limit. The figures
are read from what the steps left in DIR: env.json, pytest-*.xml, kernels.json,
engine-graphs.json, engine-eager.json, tp.json and moe.json. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Collection
from pathlib import Path
from typing import Any

ENGINE_RUNS = {"graphs": "engine-graphs.json", "eager": "engine-eager.json"}


def read_steps(path: Path) -> list[dict[str, Any]]:
    steps = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, seconds, status, code, limit = line.split("\t")
        steps.append(
            {
                "name": name,
                "seconds": float(seconds),
                "status": status,
                "exit_code": None if code == "-" else int(code),
                "limit_s": int(limit),
                "log": f"{name}.log",
            }
        )
    return steps


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_junit(path: Path) -> dict[str, Any] | None:
    """pytest's counts from a JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, **counts, "seconds": float(suite.get("time", 0))}


def table(
    head: list[str], rows: list[list[str]], right: Collection[int] | None = None
) -> list[str]:
    """A Markdown table; the columns in `right` (default: all but the first) right-aligned."""
    right = range(1, len(head)) if right is None else right
    align = ["---:" if i in right else "---" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def kernel_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One line per (op, shape): the Triton kernel's time beside the reference's and SDPA's."""
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        by.setdefault((row["op"], row["shape"]), {})[row["impl"]] = row
    lines = []
    for (op, shape), impls in by.items():
        triton, ref, sdpa = (
            impls.get(k, {}).get("time_us") for k in ("triton", "reference", "sdpa")
        )
        gbytes, tflops = impls["triton"]["gbytes"], impls["triton"]["tflops"]
        lines.append(
            [
                op,
                shape,
                fmt(triton),
                fmt(ref),
                fmt(sdpa) if "sdpa" in impls else "",
                f"{ref / triton:.2f}x" if triton and ref else "-",
                f"{sdpa / triton:.2f}x" if triton and sdpa else "-",
                fmt(gbytes / (triton * 1e-6), 0) if triton else "-",
                fmt(tflops / (triton * 1e-6), 1) if triton and tflops else "",
            ]
        )
    return lines


def engine_lines(engine: dict[str, list[dict[str, Any]]]) -> list[str]:
    rows = []
    for run, found in engine.items():
        for r in found:
            replays = re.search(r"graph_replays=(\d+)", r.get("extra", ""))
            cuda_graphs = "off"
            if run == "graphs" and replays:
                cuda_graphs = f"on ({replays.group(1)} replays)"
            rows.append(
                [
                    r["workload"],
                    r["system"],
                    cuda_graphs,
                    fmt(r["requests_per_s"], 2),
                    fmt(r["output_tokens_per_s"], 0),
                    "-" if r["hit_rate"] != r["hit_rate"] else f"{r['hit_rate']:.0%}",
                    fmt(r["seconds"], 1),
                ]
            )
    head = ["workload", "system", "CUDA graphs", "requests/s", "output tok/s", "hit", "seconds"]
    lines = table(head, rows, right=range(3, len(head)))
    ratios = []
    graphs = {(r["workload"], r["system"]): r for r in engine.get("graphs", [])}
    eager = {(r["workload"], r["system"]): r for r in engine.get("eager", [])}
    for workload in dict.fromkeys(w for w, _ in [*graphs, *eager]):
        radix, peer = graphs.get((workload, "radixlm")), graphs.get((workload, "transformers"))
        nocache, plain = graphs.get((workload, "radixlm-nocache")), eager.get((workload, "radixlm"))

        def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
            return f"{a['requests_per_s'] / b['requests_per_s']:.2f}x" if a and b else "-"

        ratios.append([workload, ratio(radix, peer), ratio(radix, nocache), ratio(radix, plain)])
    head = ["workload", "radixlm / transformers", "cache on / off", "CUDA graphs on / off"]
    return [*lines, "", *table(head, ratios)]


def build(folder: Path, steps: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    env = read_json(folder / "env.json") or {}
    tests = {p.stem: read_junit(p) for p in sorted(folder.glob("pytest-*.xml"))}
    engine = {run: read_json(folder / name) for run, name in ENGINE_RUNS.items()}
    return {
        "mode": "dry-run" if args.dry_run else "gpu",
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "total_seconds": args.total,
        "logs": "logs.tar.gz" if args.packed else "beside this file",
        "steps": steps,
        "environment": env,
        "tests": {k: v for k, v in tests.items() if v},
        "kernels": read_json(folder / "kernels.json") or [],
        "engine": {k: v for k, v in engine.items() if v},
        "tp": read_json(folder / "tp.json") or {},
        "moe": read_json(folder / "moe.json") or {},
    }


def tp_lines(tp: dict[str, Any]) -> list[str]:
    """tp_bench's decode rates beside TP=1, the collectives' share, each rank's memory."""
    rows = tp.get("rows") or []
    if not rows:
        return []
    base = rows[0] if rows[0]["tp_size"] == 1 else None
    batches = sorted(
        int(k.removeprefix("decode_tok_s_b")) for k in rows[0] if k.startswith("decode_tok_s_b")
    )
    head = ["TP"] + [h for b in batches for h in (f"decode tok/s b{b}", "vs TP=1", "comm %")]
    body = []
    for row in rows:
        cells = [str(row["tp_size"])]
        for b in batches:
            rate = row[f"decode_tok_s_b{b}"]
            ratio = rate / base[f"decode_tok_s_b{b}"] if base else None
            cells += [fmt(rate), fmt(ratio, 2), fmt(100 * row[f"collective_share_b{b}"])]
        body.append(cells)
    memory = [
        [str(row["tp_size"]), str(r["rank"]), fmt(r["weight_bytes"] / 2**20),
         fmt(r["kv_pool_bytes"] / 2**20), fmt(r["resident_bytes"] / 2**20)]
        for row in rows
        for r in row["ranks"]
    ]  # fmt: skip
    lines = table(head, body, right=range(1, len(head)))
    return [
        *lines,
        "",
        *table(["TP", "rank", "weights MiB", "KV pool MiB", "resident MiB"], memory),
    ]


def moe_lines(moe: dict[str, Any]) -> list[str]:
    """moe_bench's decode rates per batch: the fused path beside the per-expert loop."""
    rows = moe.get("rows") or []
    if not rows:
        return []
    systems = list(rows[0]["decode_tok_s"])
    head = ["batch", *(f"{name} tok/s" for name in systems), "fused / loop"]
    body = []
    for row in rows:
        rates = row["decode_tok_s"]
        ratio = rates["fused"] / rates["loop"] if rates.get("loop") else None
        body.append([str(row["batch"]), *(fmt(rates[n]) for n in systems), fmt(ratio, 2)])
    return table(head, body, right=range(1, len(head)))


def markdown(summary: dict[str, Any]) -> str:
    env = summary["environment"]
    cuda = env.get("cuda", {})
    device = cuda.get("device_name") or "no CUDA device"
    title = "dry run on a CPU" if summary["mode"] == "dry-run" else device
    out = [f"# radixlm GPU run: {title}", ""]
    out.append(
        f"Finished {summary['finished']}; {summary['total_seconds']} s in all. "
        f"Logs: {summary['logs']}."
    )
    out += ["", "## Steps", ""]
    rows = [
        [s["name"], fmt(s["seconds"]), s["status"], str(s["limit_s"]), s["log"]]
        for s in summary["steps"]
    ]
    out += table(["step", "seconds", "status", "limit (s)", "log"], rows, right=(1, 3))
    if env:
        versions = env.get("versions", {})
        out += ["", "## Environment", ""]
        out.append(
            f"- Python {env.get('python')} ({env.get('executable')}), {env.get('cpus')} CPUs"
        )
        out.append("- " + ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items()))
        if cuda.get("available"):
            out.append(
                f"- {device}: capability {cuda['capability']}, {cuda['memory_gib']} GiB, "
                f"{cuda['multiprocessors']} SMs, CUDA {cuda['torch_cuda']}"
            )
    if summary["tests"]:
        out += ["", "## Tests (pytest -m gpu)", ""]
        head = ["suite", "passed", "failed", "errors", "skipped", "seconds"]
        rows = [
            [name.removeprefix("pytest-"), *(str(c[k]) for k in head[1:5]), fmt(c["seconds"])]
            for name, c in summary["tests"].items()
            for c in [{**c, "failed": c["failures"]}]
        ]
        out += table(head, rows)
    if summary["kernels"]:
        out += ["", "## Kernels (median µs; speed-ups of the Triton kernel)", ""]
        head = ["op", "shape", "triton µs", "reference µs", "SDPA µs", "vs reference"]
        head += ["vs SDPA", "triton GB/s", "triton TFLOP/s"]
        out += table(head, kernel_rows(summary["kernels"]), right=range(2, len(head)))
    if summary["engine"]:
        first = next(iter(summary["engine"].values()))[0]
        out += ["", f"## Engine ({first['shape']}, {first['dtype']} on {first['device']}, "]
        out[-1] += f"scale {first['scale']})"
        out += ["", *engine_lines(summary["engine"])]
    if summary.get("tp"):
        out += ["", "## Tensor parallelism (tp_bench)", "", *tp_lines(summary["tp"])]
    if summary.get("moe"):
        out += ["", "## Mixture of experts (moe_bench)", "", *moe_lines(summary["moe"])]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--steps", type=Path, required=True)
    parser.add_argument("--dry-run", type=int, default=0)
    parser.add_argument("--total", type=int, default=0, help="seconds the run took")
    parser.add_argument("--packed", type=int, default=0, help="logs go into logs.tar.gz")
    args = parser.parse_args()
    steps = read_steps(args.steps)
    summary = build(args.folder, steps, args)
    (args.folder / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.folder / "summary.md").write_text(markdown(summary))
    width = max([len(s["name"]) for s in steps] + [4])
    print(f"{'step':{width}s} {'seconds':>8s}  status")
    for s in steps:
        print(f"{s['name']:{width}s} {s['seconds']:8.1f}  {s['status']}")
    print(f"{'all':{width}s} {args.total:8d}  (summary.md, summary.json in {args.folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
