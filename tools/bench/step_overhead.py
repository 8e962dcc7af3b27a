#!/usr/bin/env python3
"""The engine's own cost per scheduler step, outside the model forward, on the tiny model.

B requests (B = 1, 8, 32, 64) decode together through an in-process `Engine` on the tests'
2-layer random-weight Llama (`radixlm.runtime.fixtures.build_tiny_model`), whose forward is so
cheap that what the engine does around it shows. This script wraps, on this one engine's
objects (no runtime code changes), `EngineCore.step` (the whole step: schedule, build the
batch, forward, sample, append and stop checks, emit), `ModelRunner.forward` and
`ModelRunner.sample`, and keeps the decode steps in which all B requests run one token each.
It reports, per step (median over those steps): the step, the forward, the time outside the
forward (step - forward), its sampling share, and the time outside the forward per running
request; and the time in the core's `emit` after the step (the outputs handed to the front
end: on this engine's thread, it runs the front end's output processing, detokenization
included; in process mode that runs in the front process). Modes: `plain` (blocking generate), `stream` (every token streamed back as a chunk),
`grammar` (streamed, and every request under a regex: mask fill and accept per token).

    .venv/bin/python tools/bench/step_overhead.py                 # ~1 min on 2 cores
    .venv/bin/python tools/bench/step_overhead.py --quick         # a few seconds
    .venv/bin/python tools/bench/step_overhead.py --batch-sizes 1,64 --modes plain --json out.json
    .venv/bin/python tools/bench/step_overhead.py --clock thread   # CPU time: steadier when shared
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODES = ("plain", "stream", "grammar")
#: Issue 35's goal for the time outside the forward: µs per step, and µs per running request.
GOAL_FIXED_US, GOAL_PER_REQUEST_US = 150, 10
#: Only lowercase letters and spaces: never forces a token (no jump-forward splits the batch);
#: with the EOS banned (min_new_tokens) it never ends before max_new_tokens.
GRAMMAR_REGEX = "[a-z ]+"


@dataclass
class StepTime:
    """One step: seconds in the step, in the forward and in sampling; entries and new tokens;
    seconds in the core's `emit` after it (the front end's share of the outputs: on the
    engine's thread here, in the front process when the core has its own)."""

    step_s: float
    forward_s: float
    sample_s: float
    entries: int
    tokens: int
    emit_s: float = 0.0


@dataclass
class StepClock:
    """What the wrapped methods measured (written on the engine thread only)."""

    steps: list[StepTime] = field(default_factory=list)
    forward_s: float = 0.0
    sample_s: float = 0.0
    entries: int = 0
    tokens: int = 0
    last: StepTime | None = None  # the step whose outputs the next emit delivers


def install(core: Any, now: Callable[[], float] = time.perf_counter) -> StepClock:
    """Wrap `core.step`, its runner's `forward` and `sample` and its executor's `run` on these
    instances (run on the engine thread, between steps); the clock they write to. `now`:
    wall time, or `time.thread_time` (the engine thread's CPU time: the time outside the
    forward is that thread's alone, and the other load of a shared machine inflates it far
    less; the forward's figure then leaves out torch's other threads)."""
    import torch

    clock = StepClock()
    runner = core.executor.runner
    step, forward, sample, run = core.step, runner.forward, runner.sample, core.executor.run
    # Older cores hand their outputs over inside the step (no `emit`): nothing to time then.
    emit = getattr(core, "emit", None)
    sync: Callable[[], None] = (
        torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    )

    def timed(method: Callable[..., Any], slot: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = now()
            try:
                out = method(*args, **kwargs)
                sync()  # on CUDA the forward returns before the device has finished
                return out
            finally:
                setattr(clock, slot, getattr(clock, slot) + now() - start)

        return wrapper

    def shaped_run(batch: Any, *args: Any, **kwargs: Any) -> Any:
        clock.entries = len(batch.entries)
        clock.tokens = sum(len(e.input_ids) for e in batch.entries)
        return run(batch, *args, **kwargs)

    def timed_step() -> None:
        clock.forward_s = clock.sample_s = 0.0
        clock.entries = clock.tokens = 0
        start = now()
        step()
        total = now() - start
        clock.last = None
        if clock.entries:
            clock.last = StepTime(
                total, clock.forward_s, clock.sample_s, clock.entries, clock.tokens
            )
            clock.steps.append(clock.last)

    def timed_emit(outputs: Any) -> Any:
        start = now()
        try:
            return emit(outputs)
        finally:
            if clock.last is not None:
                clock.last.emit_s += now() - start

    runner.forward = timed(forward, "forward_s")
    runner.sample = timed(sample, "sample_s")
    core.executor.run = shaped_run
    core.step = timed_step
    if emit is not None:
        core.emit = timed_emit
    return clock


def _median_us(values: list[float]) -> float:
    return 1e6 * statistics.median(values) if values else float("nan")


def summarize(steps: list[StepTime], batch: int, mode: str) -> dict[str, Any]:
    """Medians over the decode steps that ran all `batch` requests, one token each."""
    full = [s for s in steps if s.entries == batch and s.tokens == batch]
    outside = [s.step_s - s.forward_s for s in full]
    return {
        "mode": mode,
        "batch": batch,
        "decode_steps": len(full),
        "step_us": _median_us([s.step_s for s in full]),
        "forward_us": _median_us([s.forward_s for s in full]),
        "outside_forward_us": _median_us(outside),
        "sample_us": _median_us([s.sample_s for s in full]),
        "outside_forward_and_sampling_us": _median_us(
            [s.step_s - s.forward_s - s.sample_s for s in full]
        ),
        "outside_forward_per_request_us": _median_us(outside) / batch,
        "emit_us": _median_us([s.emit_s for s in full]),
        "outside_forward_with_emit_us": _median_us(
            [s.step_s - s.forward_s + s.emit_s for s in full]
        ),
        "outside_forward_share": statistics.median(
            [(s.step_s - s.forward_s) / s.step_s for s in full]
        )
        if full
        else float("nan"),
    }


def build_engine(model_dir: Path, max_batch: int) -> Any:
    from radixlm.runtime import Engine

    return Engine(
        str(model_dir),
        show_progress=False,
        max_running_requests=max(64, max_batch),
        grammar_backend="xgrammar",
        engine_process=False,  # the clock wraps the core's methods on its thread
    )


def measure(
    engine: Any,
    clock: StepClock,
    batch: int,
    mode: str,
    new_tokens: int,
    prompt_len: int,
    seed: int,
) -> dict[str, Any]:
    """`batch` requests of `prompt_len` random tokens decoding `new_tokens` each, together."""
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params: dict[str, Any] = {
        "max_new_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if mode == "grammar":
        params["regex"] = GRAMMAR_REGEX
        # With ignore_eos the EOS stays allowed wherever the regex may end, and the grammar
        # ends the request when the model picks it; min_new_tokens bans it instead (it bans
        # the EOS only without ignore_eos).
        del params["ignore_eos"]
        params["min_new_tokens"] = new_tokens
    engine.flush_cache()  # the radix cache would otherwise keep growing across the runs
    first = len(engine.run_in_loop(lambda core: clock.steps))
    if mode == "plain":
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        produced = sum(len(o["output_ids"]) for o in outs)
    else:
        chunks = list(engine.generate(input_ids=prompts, sampling_params=params, stream=True))
        produced = len(chunks)
    steps = engine.run_in_loop(lambda core: list(clock.steps[first:]))
    row = summarize(steps, batch, mode)
    row["produced"] = produced
    return row


def fit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, the least-squares line outside(B) = fixed + per_request * B through its batch
    sizes' medians: µs per step whatever runs, and µs more per running request."""
    fits = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        points = [(r["batch"], r["outside_forward_us"]) for r in rows if r["mode"] == mode]
        if len({b for b, _ in points}) < 2:
            continue
        mean_b = statistics.fmean(b for b, _ in points)
        mean_y = statistics.fmean(y for _, y in points)
        slope = sum((b - mean_b) * (y - mean_y) for b, y in points) / sum(
            (b - mean_b) ** 2 for b, _ in points
        )
        fits.append({"mode": mode, "fixed_us": mean_y - slope * mean_b, "per_request_us": slope})
    return fits


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'mode':8s}{'batch':>6s}{'steps':>7s}{'step µs':>10s}{'forward µs':>12s}"
        f"{'outside µs':>12s}{'of it sampling':>16s}{'per request µs':>16s}{'outside %':>11s}"
        f"{'emit µs':>10s}{'outside+emit µs':>17s}"
    )
    for r in rows:
        print(
            f"{r['mode']:8s}{r['batch']:6d}{r['decode_steps']:7d}{r['step_us']:10.0f}"
            f"{r['forward_us']:12.0f}{r['outside_forward_us']:12.0f}{r['sample_us']:16.0f}"
            f"{r['outside_forward_per_request_us']:16.1f}{100 * r['outside_forward_share']:10.0f}%"
            f"{r['emit_us']:10.0f}{r['outside_forward_with_emit_us']:17.0f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch-sizes", help="default 1,8,32,64 (1,8 with --quick)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    parser.add_argument("--new-tokens", type=int, help="tokens each request decodes (default 64)")
    parser.add_argument("--rounds", type=int, help="repeats per batch size (default 3)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="few steps, batch 1 and 8")
    parser.add_argument("--model-path", help="a model directory (default: the tiny model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time, or the engine thread's CPU time (steadier on a shared machine)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ("1,8" if quick else "1,8,32,64")
    args.new_tokens = args.new_tokens or (12 if quick else 64)
    args.rounds = args.rounds or (1 if quick else 3)
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose among {','.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from radixlm.runtime.fixtures import build_tiny_model

    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    model_dir = Path(args.model_path or build_tiny_model(tempfile.mkdtemp(prefix="step-tiny-")))
    engine = build_engine(model_dir, max(batches))
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        now = time.thread_time if args.clock == "thread" else time.perf_counter
        clock = engine.run_in_loop(lambda core: install(core, now))
        # Untimed: the first steps pay for lazy set-up (allocations, grammar compilation).
        for mode in modes:
            measure(engine, clock, 2, mode, 8, args.prompt_len, args.seed)
        for mode in modes:
            for batch in batches:
                per_round = [
                    measure(engine, clock, batch, mode, args.new_tokens, args.prompt_len, k)
                    for k in range(args.rounds)
                ]
                # Medians over the rounds' medians of each figure.
                row = dict(per_round[0])
                for key in list(row):
                    if key.endswith("_us") or key == "outside_forward_share":
                        row[key] = statistics.median(r[key] for r in per_round)
                row["decode_steps"] = sum(r["decode_steps"] for r in per_round)
                rows.append(row)
    finally:
        engine.shutdown()
    from report import machine

    info = machine()
    print(
        f"{'model' if args.model_path else 'tiny model'} ({model_dir}), torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, {info['cpu']}; {time.perf_counter() - began:.1f} s"
    )
    print_table(rows)
    fits = fit(rows)
    for line in fits:
        print(
            f"{line['mode']:8s} outside the forward: {line['fixed_us']:.0f} µs per step "
            f"+ {line['per_request_us']:.1f} µs per running request "
            f"(goal: ≤ {GOAL_FIXED_US} + ≤ {GOAL_PER_REQUEST_US})"
        )
    if args.json:
        meta = {
            "command": " ".join(
                ["python", "tools/bench/step_overhead.py", *(argv or sys.argv[1:])]
            ),
            "machine": info,
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "grammar_regex": GRAMMAR_REGEX,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        figures = {"meta": meta, "rows": rows, "fits": fits}
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0 if rows and all(r["decode_steps"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
