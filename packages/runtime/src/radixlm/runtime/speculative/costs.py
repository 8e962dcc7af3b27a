"""What a step costs, measured at start-up: speculative decoding drafts a row while its chance
of acceptance pays for the row (and for proposing it).

A step of R tokens costs about `row_seconds * (fixed_rows + R)`: what it pays once (reading
the weights, launching the step) and what each row adds. The two differ by orders between
machines and formats — float32 on a CPU reads 4 bytes a weight and a row is nearly free
beside that; the int4 C kernels compute each row on its own — so they are measured, not
assumed: two short forwards (one token, then `rows` tokens of one sequence) at the request
table's padding row, writing only the pool's padding slot.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch
from radixlm.runtime.model_runner import ModelRunner


@dataclass(frozen=True)
class StepCost:
    """`row_seconds * (fixed_rows + R)`: the time of a step of R tokens."""

    row_seconds: float
    fixed_rows: float
    #: The step size it was fitted up to (from one token).
    rows: int


def measure_step_cost(runner: ModelRunner, rows: int = 8, repeats: int = 3) -> StepCost:
    """Time one-token and `rows`-token forwards on `runner` (the best of `repeats` each): the
    line through the two (a row costs more past a few rows on CPUs, so measure up to the
    largest step drafts may make). Not under tensor parallelism (the other ranks would not
    run them)."""
    table = runner.req_to_token_pool
    row, slot = table.padding_row, runner.kv_pool.padding_slot

    def best(count: int) -> float:
        entries = [BatchEntry(row, [0] * count, 0, [slot] * count)]
        fastest = float("inf")
        for _ in range(repeats):
            batch = ForwardBatch.build(entries, table.req_to_token)
            start = time.perf_counter()
            runner.forward(batch)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            fastest = min(fastest, time.perf_counter() - start)
        return fastest

    counters = dataclasses.replace(runner.stats)
    best(1)  # warm-up (packing, first-call allocations)
    one, many = best(1), best(rows)
    runner.stats = counters  # these forwards are not the engine's
    per_row = max((many - one) / (rows - 1), one * 1e-3)
    return StepCost(per_row, max(one / per_row - 1.0, 0.0), rows)
