"""The final hidden states one sequence returns (SGLang's `meta_info["hidden_states"]`)."""

from __future__ import annotations

from typing import Any

import torch


class HiddenStates:
    """Final hidden states (after the model's last norm) of one sequence, by position.

    Positions are computed in order; computing position p again (after a retraction or a
    rollback) replaces p and forgets every later one, which is stale then.
    """

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.rows: list[list[float]] = []

    def record(self, start: int, rows: torch.Tensor) -> None:
        """Store the hidden states [k, hidden] of positions `start .. start + k`."""
        if start > len(self.rows):  # earlier positions came from the cache: nothing to align
            return
        del self.rows[start:]
        self.rows.extend(rows.tolist())

    def entries(self, num_output: int) -> list[Any]:
        """SGLang's shape: the prompt's rows as the first entry ([prompt_len][hidden]), then
        one vector per output token that was fed back to the model: all but the last of
        `num_output` (the last one's hidden state is never computed). Empty until the whole
        prompt is computed."""
        if len(self.rows) < self.prompt_len:
            return []
        start = self.prompt_len
        out: list[Any] = [self.rows[:start]]
        out.extend(self.rows[start : start + max(num_output - 1, 0)])
        return out
