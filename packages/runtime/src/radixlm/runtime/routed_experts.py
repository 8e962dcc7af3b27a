"""The experts a mixture-of-experts model routed each token to (SGLang's
`return_routed_experts`, behind `enable_return_routed_experts`).

The executor keeps one row per KV slot, [slots, layers, top_k] int32 (-1 for a dense layer),
written for every token a forward computes. A token served from the prefix cache was routed
when its KV was computed, so its slot's row holds its experts: a request reads the rows of its
tokens' slots (`RoutedTape.extend`) while it holds them, step by step. The answer covers
positions `[routed_experts_start_len, prompt + output - 1)`, every token the model ran on (the
last output token never went through it), as base64 of little-endian int32 with the logical
shape [tokens, layers, top_k].
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import torch


class RoutedExpertsStore:
    """One row of routed expert ids per KV slot (on the CPU, rank 0)."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int, sparse: Sequence[int]):
        self.rows = torch.full((num_slots, num_layers, top_k), -1, dtype=torch.int32)
        #: The layers with experts, in the order the model records them.
        self.sparse = torch.tensor(list(sparse), dtype=torch.int64)

    def write(self, slots: Sequence[int], ids: torch.Tensor) -> None:
        """`ids` [tokens, sparse layers, top_k] of the tokens computed into `slots`."""
        index = torch.tensor(list(slots), dtype=torch.int64)
        values = ids.to(device="cpu", dtype=torch.int32)
        block = self.rows[index]
        block[:, self.sparse] = values
        self.rows[index] = block

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        return self.rows[torch.tensor(list(slots), dtype=torch.int64)]


class RoutedTape:
    """One sequence's rows, position by position, and how much of them the front end has."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.sent = 0
        self.changed_from: int | None = None

    def __len__(self) -> int:
        return 0 if self.rows is None else int(self.rows.shape[0])

    def extend(
        self, store: RoutedExpertsStore, kv_slots: Sequence[int], start: int, end: int
    ) -> None:
        """Positions [start, end) were computed in this step (their KV is in `kv_slots`):
        keep the rows before `start` (positions recomputed since are routed again), read the
        rest from the store."""
        keep = min(len(self), start)
        fresh = store.read(kv_slots[keep:end])
        self.rows = fresh if self.rows is None else torch.cat([self.rows[:keep], fresh])
        self.changed_from = keep if self.changed_from is None else min(self.changed_from, keep)

    def take_new(self) -> tuple[int, torch.Tensor] | None:
        """(first position, rows) the front end does not have yet, or None."""
        if self.rows is None or self.changed_from is None:
            return None
        start = min(self.changed_from, self.sent)
        self.changed_from = None
        self.sent = len(self)
        return start, self.rows[start:]


def encode(rows: torch.Tensor) -> str:
    """SGLang's wire format: base64 of the flattened little-endian int32 ids."""
    return base64.b64encode(
        rows.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
    ).decode("ascii")


def decode(data: str, num_layers: int, top_k: int) -> torch.Tensor:
    """The [tokens, layers, top_k] int32 ids of `encode`'s output."""
    import numpy as np

    flat = np.frombuffer(base64.b64decode(data), dtype="<i4")
    return torch.from_numpy(flat.copy()).reshape(-1, num_layers, top_k)
