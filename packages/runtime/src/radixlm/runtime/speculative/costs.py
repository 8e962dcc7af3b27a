"""What a step costs, and so when a draft row pays (torch-free but for the measurement): speculative decoding drafts a row while its
chance of acceptance beats what the row (and proposing it) costs against what a token costs
without drafts.

A step's time grows with its rows in ways that differ by orders between machines and
formats — float32 on a CPU reads 4 bytes a weight and its first rows are nearly free; the
int4 C kernels compute each row on its own; past a few rows either grows faster — so on CPUs
it is measured at start: forwards of 1, 2, 4, 8 ... tokens of one sequence at the request
table's padding row, writing only the pool's padding slot, with every row's logits (as a
verify step: the LM head is a large part of a row's cost). Elsewhere a step is taken to cost
16 rows besides its rows (reading the weights dominates a GPU's decode step).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.runtime.model_runner import ModelRunner

#: What a step costs besides its rows, in rows, where it is not measured.
ASSUMED_FIXED_ROWS = 16.0


@dataclass(frozen=True)
class StepCost:
    """A step's time by its rows: `points` (rows, seconds) measured, linear between them and
    past the last two."""

    points: tuple[tuple[int, float], ...]

    @classmethod
    def assumed(cls, fixed_rows: float = ASSUMED_FIXED_ROWS) -> StepCost:
        """`fixed_rows + R` row-times for R rows."""
        return cls(((1, 1.0 + fixed_rows), (2, 2.0 + fixed_rows)))

    def seconds(self, rows: float) -> float:
        points = self.points
        at = bisect.bisect_left([r for r, _ in points], rows)
        at = min(max(at, 1), len(points) - 1)
        (r0, t0), (r1, t1) = points[at - 1], points[at]
        return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)

    def scaled(self, factor: float) -> StepCost:
        return StepCost(tuple((rows, seconds * factor) for rows, seconds in self.points))


@dataclass(frozen=True)
class DraftCosts:
    """The target's step cost, a proposer's (a draft forward for B requests; None: proposals
    cost nothing, as a lookup), and the most tokens a step with drafts may take."""

    target: StepCost
    proposer: StepCost | None = None
    step_tokens: int | None = None

    def threshold(self, size: int) -> float:
        """The chance of acceptance a draft row must beat in a step of `size` decodes: what
        the rows drafts add cost (at the margin: a row costs more past a few) plus proposing
        one draft, over what a token costs without drafts (1.0: never)."""
        room = size if self.step_tokens is None else min(size, self.step_tokens - size)
        if room <= 0:
            return 1.0
        target = self.target
        plain = target.seconds(size) / size
        marginal = (target.seconds(size + room) - target.seconds(size)) / room
        proposing = 0.0 if self.proposer is None else self.proposer.seconds(size) / size
        return (marginal + proposing) / plain


def measure_step_cost(runner: ModelRunner, up_to: int = 8, repeats: int = 3) -> StepCost:
    """Time forwards of 1, 2, 4 ... `up_to` tokens on `runner` (the best of `repeats` each).
    Not under tensor parallelism (the other ranks would not run them)."""
    import torch

    from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch

    table = runner.req_to_token_pool
    row, slot = table.padding_row, runner.kv_pool.padding_slot

    def best(count: int) -> float:
        # Every row's logits, as a step that verifies drafts computes them.
        entries = [BatchEntry(row, [0] * count, 0, [slot] * count, num_logits=count)]
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
    # The padding row is put back (a CUDA graph's padded rows read it; a draft model's
    # runner shares the target's table).
    padding = table.req_to_token[row].clone()
    best(1)  # warm-up (packing, first-call allocations)
    sizes = [1]
    while sizes[-1] * 2 <= max(up_to, 2):
        sizes.append(sizes[-1] * 2)
    points = [(size, best(size)) for size in sizes]
    runner.stats = counters  # these forwards are not the engine's
    table.req_to_token[row].copy_(padding)
    # Noise must not make a row look free or negative: times grow with the rows.
    steady = [points[0]]
    for size, seconds in points[1:]:
        steady.append((size, max(seconds, steady[-1][1] * (1 + 1e-3))))
    return StepCost(tuple(steady))
