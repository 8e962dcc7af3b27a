"""The corpus part of grammar_bench.py: raw xgrammar, llguidance and outlines-core beside
radixlm's `auto` backend over corpora of JSON schemas, each corpus reported apart.

Per system, corpus and vocabulary: how many schemas compile (a compilation past the time limit
counts as not compiled), how many random walks over the compiled grammar that finish give
output valid against the schema (`jsonschema` for the schema's draft, format checks on),
compile time and time per output token (fill the bitmask + accept the token); for `auto` also
which backend served each schema, validation and rollback, and jump-forward. The systems and
their walks are in grammar_corpus_systems.py; this module loads the corpora, judges the
outputs and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy
from grammar_bench import ROOT, table
from grammar_corpus_systems import LOGS, RAW, SYSTEMS, InProcess, Job, Limits, Worker

DATA = ROOT / "packages" / "constrained" / "tests" / "data"
CORPORA = {
    "real": DATA / "real_schemas",
    "keyword": DATA / "keyword_schemas.json",
    "schemas": DATA / "schemas.json",
    "vendor": ROOT / "tools" / "bench" / "data" / "check_jsonschema_vendor",
}


# ------------------------------------------------------------------------------------ corpora


def load_corpus(path: Path) -> tuple[list[tuple[str, Any]], list[str]]:
    """(name, schema) pairs from a folder of schema files or a JSON list of {name, schema},
    and notes on what was skipped. A corpus that is not there yet is empty."""
    notes: list[str] = []
    schemas: list[tuple[str, Any]] = []
    if path.is_dir():
        for file in sorted(path.glob("*.json")):
            if file.name == "MANIFEST.json":
                continue
            try:
                schemas.append((file.stem, json.loads(file.read_text(encoding="utf-8"))))
            except (ValueError, UnicodeDecodeError) as error:
                notes.append(f"{file.name}: not JSON ({error})")
    elif path.is_file():
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            return [], [f"{path.name}: not JSON ({error})"]
        for i, entry in enumerate(entries):
            if isinstance(entry, dict) and "schema" in entry:
                schemas.append((str(entry.get("name", i)), entry["schema"]))
            else:
                notes.append(f"{path.name}[{i}]: no schema")
    else:
        notes.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: absent")
    return schemas, notes


def quick_pick(schemas: list[tuple[str, Any]], count: int) -> list[tuple[str, Any]]:
    """`count` schemas spread over sizes, below 100 kB (for a smoke run)."""
    small = sorted((s for s in schemas if len(json.dumps(s[1])) < 100_000), key=_size)
    if len(small) <= count:
        return small
    return [small[round(i * (len(small) - 1) / (count - 1))] for i in range(count)]


def _size(entry: tuple[str, Any]) -> int:
    return len(json.dumps(entry[1]))


# ------------------------------------------------------------------------------------ judging


class Judge:
    """Validates finished outputs against one schema (its own draft, format checks on)."""

    def __init__(self, schema: Any) -> None:
        import jsonschema

        try:
            cls = jsonschema.validators.validator_for(schema)
            self._validator: Any = cls(schema, format_checker=cls.FORMAT_CHECKER)
            self._problem = ""
        except Exception as error:  # a schema jsonschema cannot even load
            self._validator, self._problem = None, f"{type(error).__name__}: {error}"

    def __call__(self, data: bytes) -> tuple[str, str]:
        """("valid" | "invalid" | "unverifiable", why)."""
        import jsonschema

        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            return "invalid", f"not UTF-8: {error}"
        try:
            value = json.loads(text)
        except ValueError as error:
            return "invalid", f"not JSON: {error}"
        if self._validator is None:
            return "unverifiable", self._problem
        try:
            found = jsonschema.exceptions.best_match(self._validator.iter_errors(value))
        except Exception as problem:  # unresolvable $ref, a pattern Python's re rejects, ...
            return "unverifiable", f"{type(problem).__name__}: {str(problem)[:200]}"
        if found is None:
            return "valid", ""
        where = "/".join(map(str, found.absolute_path))
        return "invalid", f"{found.validator} at /{where}: {found.message[:200]}"


# ------------------------------------------------------------------------------------ running


def run_corpora(
    corpora: dict[str, list[tuple[str, Any]]],
    vocabs: list[int],
    limits: Limits,
    systems: tuple[str, ...] = SYSTEMS,
    isolate: bool = True,
    log: Any = print,
) -> list[dict[str, Any]]:
    """One record per (corpus, schema, vocabulary, system). Per schema the systems run in turn,
    so that load on a shared machine lands on all of them alike."""
    records: list[dict[str, Any]] = []
    timed_out: set[tuple[str, str, str]] = set()  # (corpus, schema, system), not retried
    judges: dict[tuple[str, int], Judge] = {}
    for number, vocab in enumerate(vocabs):
        runners = {s: (Worker if isolate else InProcess)(s, vocab) for s in systems}
        walks = limits.walks if number == 0 else limits.later_walks
        try:
            for corpus, schemas in corpora.items():
                started = time.perf_counter()
                for index, (name, schema) in enumerate(schemas):
                    text = json.dumps(schema)
                    job = Job(text, dataclasses.replace(limits, walks=walks), jump_walk=number == 0)
                    for system, runner in runners.items():
                        base = {"corpus": corpus, "schema": name, "vocab": vocab, "system": system}
                        if (corpus, name, system) in timed_out:
                            result = {"compiled": False, "timeout": True, "carried": True,
                                      "error": "timed out at a smaller vocabulary"}  # fmt: skip
                        else:
                            began = time.perf_counter()
                            result = {**runner.run(job), "wall_s": time.perf_counter() - began}
                        if result.get("timeout"):
                            timed_out.add((corpus, name, system))
                        if (corpus, index) not in judges:
                            judges[(corpus, index)] = Judge(schema)
                        records.append({**base, **_judged(result, judges[(corpus, index)])})
                log(f"  {corpus}: {len(schemas)} schemas at vocab {vocab} in "
                    f"{time.perf_counter() - started:.0f} s")  # fmt: skip
        finally:
            for runner in runners.values():
                runner.close()
    return records


def _judged(result: dict[str, Any], judge: Judge) -> dict[str, Any]:
    out = {k: v for k, v in result.items() if k != "walks"}
    walks = []
    for w in result.get("walks", []):
        verdict, why = judge(w["text"]) if w["outcome"] == "finished" else ("", "")
        walks.append({**w, "text": w["text"].decode("utf-8", "replace"), "verdict": verdict,
                      "why": why})  # fmt: skip
    out["walks"] = walks
    return out


# ------------------------------------------------------------------------------------ figures


def _percentiles(values: list[float], scale: float) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = numpy.percentile(values, [50, 99])
    return scale * float(p50), scale * float(p99)


def summarize(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The tables' rows: per (corpus, vocab, system), auto's choices, the goals, examples."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["corpus"], r["vocab"], r["system"]), []).append(r)
    rows, auto_rows = [], []
    for (corpus, vocab, system), group in groups.items():
        if all(r.get("unavailable") for r in group):
            rows.append({"corpus": corpus, "vocab": vocab, "system": system,
                         "note": f"unavailable: {group[0]['error'][:80]}"})  # fmt: skip
            continue
        compiled = [r for r in group if r["compiled"]]
        walks = [w for r in compiled for w in r["walks"]]
        finished = [w for w in walks if w["outcome"] == "finished"]
        verdicts = Counter(w["verdict"] for w in finished)
        judged = verdicts["valid"] + verdicts["invalid"]
        compile_p50, compile_p99 = _percentiles([r["compile_s"] for r in compiled], 1e3)
        step_p50, step_p99 = _percentiles([s for w in walks for s in w["step_s"]], 1e6)
        unfinished = Counter(w["outcome"] for w in walks if w["outcome"] != "finished")
        rows.append({
            "corpus": corpus, "vocab": vocab, "system": system, "schemas": len(group),
            "compiled": len(compiled), "compiled_pct": len(compiled) / len(group),
            "timeouts": sum(bool(r.get("timeout")) for r in group),
            "walks": len(walks), "finished": len(finished),
            "valid": verdicts["valid"], "invalid": verdicts["invalid"],
            "unverifiable": verdicts["unverifiable"],
            "valid_pct": verdicts["valid"] / judged if judged else None,
            "unfinished": dict(unfinished),
            "compile_p50_ms": compile_p50, "compile_p99_ms": compile_p99,
            "step_p50_us": step_p50, "step_p99_us": step_p99,
        })  # fmt: skip
        if system == "auto":
            served = Counter(r.get("served_by", "?") for r in compiled)
            jumps = [r["jump"] for r in compiled if r.get("jump")]
            auto_rows.append({
                "corpus": corpus, "vocab": vocab,
                **{f"served_{name}": served.get(name, 0) for name in RAW},
                "validated": sum(bool(r.get("validated")) for r in compiled),
                "validated_keywords": dict(Counter(k for r in compiled for k in r.get("validated", []))),
                "rollbacks_per_walk": statistics.mean(w["rollbacks"] for w in walks) if walks else None,
                "max_rollbacks": max((w["rollbacks"] for w in walks), default=None),
                "fatal": unfinished.get("fatal", 0),
                "jump_per_token": sum(j[1] for j in jumps) / max(sum(j[0] for j in jumps), 1) if jumps else None,
            })  # fmt: skip
    return {
        "systems": rows,
        "auto": auto_rows,
        "goals": goals(records, rows),
        "examples": examples(records),
    }


def _median_step(record: dict[str, Any]) -> float | None:
    steps = [s for w in record.get("walks", []) for s in w["step_s"]]
    return statistics.median(steps) if steps else None


def goals(records: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (corpus, vocab): auto's coverage and validity beside the best raw system's, and
    auto's time per token over the fastest raw system that compiles the schema."""
    by_key = {(r["corpus"], r["vocab"], r["system"]): r for r in rows if "compiled" in r}
    times: dict[tuple[str, int, str], dict[str, float]] = {}  # median s/token by system
    served: dict[tuple[str, int, str], str] = {}
    for r in records:
        key = (r["corpus"], r["vocab"], r["schema"])
        step = _median_step(r) if r["compiled"] else None
        if step is not None:
            times.setdefault(key, {})[r["system"]] = step
        if r["system"] == "auto" and r["compiled"]:
            served[key] = r.get("served_by", "")
    out = []
    for corpus, vocab in dict.fromkeys((r["corpus"], r["vocab"]) for r in rows):
        auto = by_key.get((corpus, vocab, "auto"))
        raws = [by_key[(corpus, vocab, s)] for s in RAW if (corpus, vocab, s) in by_key]
        if auto is None or not raws:
            continue
        best_cover = max(raws, key=lambda r: r["compiled"])
        valid = [r for r in raws if r["valid_pct"] is not None]
        best_valid = max(valid, key=lambda r: r["valid_pct"]) if valid else None
        fastest, chosen = [], []
        for key, by_system in times.items():
            ours = by_system.get("auto")
            if key[:2] != (corpus, vocab) or ours is None:
                continue
            raw_times = [by_system[s] for s in RAW if s in by_system]
            if raw_times:
                fastest.append(ours / min(raw_times) - 1)
            own = by_system.get(served.get(key, ""))
            if own:
                chosen.append(ours / own - 1)
        out.append({
            "corpus": corpus, "vocab": vocab,
            "auto_compiled_pct": auto["compiled_pct"],
            "best_raw_compiled_pct": best_cover["compiled_pct"], "best_raw_cover": best_cover["system"],
            "coverage_met": auto["compiled_pct"] > best_cover["compiled_pct"] or auto["compiled_pct"] == 1,
            "auto_valid_pct": auto["valid_pct"],
            "best_raw_valid_pct": best_valid["valid_pct"] if best_valid else None,
            "best_raw_valid": best_valid["system"] if best_valid else "",
            "validity_met": auto["invalid"] == 0,
            "overhead_vs_fastest": statistics.median(fastest) if fastest else None,
            "overhead_vs_chosen": statistics.median(chosen) if chosen else None,
            "overhead_schemas": len(fastest),
            "overhead_met": bool(fastest) and statistics.median(fastest) <= 0.10,
        })  # fmt: skip
    return out


def examples(records: list[dict[str, Any]], per_group: int = 2) -> list[dict[str, Any]]:
    """The first few invalid outputs per (system, corpus), each schema once."""
    found: list[dict[str, Any]] = []
    counts: Counter[tuple[str, str]] = Counter()
    seen: set[tuple[str, str, str]] = set()
    for r in records:
        for w in r.get("walks", []):
            key = (r["system"], r["corpus"])
            if w["verdict"] != "invalid" or counts[key] >= per_group:
                continue
            if (r["system"], r["corpus"], r["schema"]) in seen:
                continue
            seen.add((r["system"], r["corpus"], r["schema"]))
            counts[key] += 1
            found.append({"system": r["system"], "corpus": r["corpus"], "schema": r["schema"],
                          "vocab": r["vocab"], "output": _visible(w["text"][:240]), "why": w["why"]})  # fmt: skip
    return found


def _visible(text: str) -> str:
    """Control characters spelled out (raw ones in a JSON string are what makes it invalid)."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


# ------------------------------------------------------------------------------------ output


def _fraction(count: int, total: int) -> str:
    return f"{count}/{total} ({count / total:.0%})" if total else "–"


def print_tables(summary: dict[str, list[dict[str, Any]]], limits: Limits) -> None:
    rows = []
    for r in summary["systems"]:
        if "note" in r:
            rows.append({**r, "compiled_text": r["note"]})
            continue
        unfinished = ", ".join(f"{n} {k}" for k, n in sorted(r["unfinished"].items()))
        rows.append({
            **r,
            "compiled_text": _fraction(r["compiled"], r["schemas"]),
            "finished_text": _fraction(r["finished"], r["walks"]),
            "unfinished_text": unfinished,
        })  # fmt: skip
    table(
        f"corpora: schemas compiled (a timeout, {limits.compile_s:g} s, counts as not compiled), "
        f"random walks ({limits.walks} per schema at the first vocabulary, {limits.later_walks} "
        f"at the others, up to {limits.max_tokens} tokens) valid among those that finished, "
        "compile time, time per output token (fill bitmask + accept)",
        rows,
        [
            ("corpus", "corpus", "s"),
            ("vocab", "vocab", "d"),
            ("system", "system", "s"),
            ("compiled", "compiled_text", "s"),
            ("timeouts", "timeouts", "d"),
            ("walks finished", "finished_text", "s"),
            ("valid", "valid_pct", ".1%"),
            ("invalid", "invalid", "d"),
            ("unverifiable", "unverifiable", "d"),
            ("not finished", "unfinished_text", "s"),
            ("compile p50 ms", "compile_p50_ms", ".1f"),
            ("p99 ms", "compile_p99_ms", ".0f"),
            ("µs/token p50", "step_p50_us", ".1f"),
            ("p99", "step_p99_us", ".0f"),
        ],
    )
    auto_rows = []
    for r in summary["auto"]:
        keywords = sorted(r["validated_keywords"].items(), key=lambda kv: (-kv[1], kv[0]))
        auto_rows.append({**r, "keywords": ", ".join(f"{k} {n}" for k, n in keywords[:6]) or "–"})
    table(
        "auto: the backend that served each compiled schema, schemas served with validation "
        "and rollback (and the keywords validated), rollbacks per walk, jump-forward",
        auto_rows,
        [
            ("corpus", "corpus", "s"),
            ("vocab", "vocab", "d"),
            ("xgrammar", "served_xgrammar", "d"),
            ("llguidance", "served_llguidance", "d"),
            ("outlines", "served_outlines", "d"),
            ("with validation", "validated", "d"),
            ("keywords validated (schemas)", "keywords", "s"),
            ("rollbacks per walk", "rollbacks_per_walk", ".2f"),
            ("max", "max_rollbacks", "d"),
            ("fatal", "fatal", "d"),
            ("jump-forward tokens per output token (first vocab)", "jump_per_token", ".2f"),
        ],
    )
    goal_rows = []
    for g in summary["goals"]:
        best_valid = g["best_raw_valid_pct"]
        goal_rows.append({
            **g,
            "coverage": f"{g['auto_compiled_pct']:.0%} vs {g['best_raw_compiled_pct']:.0%} "
                        f"({g['best_raw_cover']}) {'✓' if g['coverage_met'] else '✗'}",
            "validity": ("–" if g["auto_valid_pct"] is None else f"{g['auto_valid_pct']:.1%}")
                        + (f" vs {best_valid:.1%} ({g['best_raw_valid']})" if best_valid is not None else "")
                        + (" ✓" if g["validity_met"] else " ✗"),
            "overhead": "–" if g["overhead_vs_fastest"] is None else
                        f"{g['overhead_vs_fastest']:+.1%} {'✓' if g['overhead_met'] else '✗'}",
        })  # fmt: skip
    table(
        "goals for auto: coverage above every raw system; 100% of finished walks valid; per "
        "token within 10% of the fastest raw system that compiles the schema (median over the "
        "schemas both compile)",
        goal_rows,
        [
            ("corpus", "corpus", "s"),
            ("vocab", "vocab", "d"),
            ("compiled: auto vs best raw", "coverage", "s"),
            ("valid: auto vs best raw", "validity", "s"),
            ("per token vs fastest raw", "overhead", "s"),
            ("vs the raw backend auto chose", "overhead_vs_chosen", "+.1%"),
            ("schemas compared", "overhead_schemas", "d"),
        ],
    )
    if summary["examples"]:
        print("\n## invalid outputs let through (first per system and corpus)\n")
        for e in summary["examples"]:
            print(f"- {e['system']}, {e['corpus']}/{e['schema']} (vocab {e['vocab']}): "
                  f"`{e['output']}` — {e['why']}")  # fmt: skip


def corpus_part(
    names: list[str],
    vocabs: list[int],
    limits: Limits,
    quick: int = 0,
    systems: tuple[str, ...] = SYSTEMS,
    isolate: bool = True,
) -> dict[str, Any]:
    """Load the corpora named, run every system over them, print the tables; the figures."""
    corpora: dict[str, list[tuple[str, Any]]] = {}
    for name in names:
        schemas, notes = load_corpus(CORPORA[name])
        for note in notes:
            print(f"  {name}: skipped {note}")
        if schemas:
            corpora[name] = quick_pick(schemas, quick) if quick else schemas
    print(
        f"  corpora: {', '.join(f'{k} ({len(v)})' for k, v in corpora.items()) or 'none present'}"
    )
    records = run_corpora(corpora, vocabs, limits, systems, isolate)
    summary = summarize(records)
    print_tables(summary, limits)
    if isolate:
        print(f"\n(the libraries' own messages, such as xgrammar's warnings, are in {LOGS})")
    for r in records:  # per-token times and valid outputs stay out of the saved figures
        step = _median_step(r)
        r["step_p50_us"] = None if step is None else 1e6 * step
        for w in r["walks"]:
            w["step_s"] = len(w["step_s"])
            if w["verdict"] != "invalid":
                w["text"] = ""
    return {"limits": dataclasses.asdict(limits), "summary": summary, "records": records}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This part's flags, on grammar_bench.py's command line."""
    limits = Limits()
    parser.add_argument("--corpus", nargs="+", choices=list(CORPORA), default=list(CORPORA))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--walks", type=int, default=limits.walks, help="walks per schema")
    parser.add_argument("--later-walks", type=int, default=limits.later_walks,
                        help="walks per schema at the vocabularies after the first")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=limits.max_tokens, help="per walk")
    parser.add_argument("--compile-limit", type=float, default=limits.compile_s, metavar="S",
                        help="seconds; a compilation past it counts as not compiled")  # fmt: skip
    parser.add_argument("--quick-schemas", type=int, default=4, help="per corpus, with --quick")


def corpus_part_from_args(args: argparse.Namespace) -> dict[str, Any]:
    limits = Limits(walks=args.walks, later_walks=args.later_walks,
                    max_tokens=args.max_tokens, compile_s=args.compile_limit)  # fmt: skip
    quick = args.quick_schemas if args.quick else 0
    return corpus_part(args.corpus, args.vocab, limits, quick, tuple(args.systems))
