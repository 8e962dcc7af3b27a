"""The end of a reasoning model's thinking: `</think>`'s ids, and vLLM's `thinking_token_budget`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THINK_END = "</think>"


def think_end_ids(tokenizer: Any) -> tuple[int, ...]:
    """The token ids of `</think>` as the tokenizer writes it (one id for Qwen3 and
    DeepSeek-R1 tokenizers, which hold it as an added token; several for others)."""
    return tuple(int(t) for t in tokenizer.encode(THINK_END, add_special_tokens=False))


def end_of_thinking_token(tokenizer: Any) -> int | None:
    """The id of `</think>` when the tokenizer holds it as a single token, else None."""
    ids = think_end_ids(tokenizer)
    return ids[0] if len(ids) == 1 else None


@dataclass
class ThinkingBudget:
    """One sequence's budget: the output counts as thinking until `end_token_id` appears in
    it; once `budget` output tokens are out with no end token among them, the next token is
    forced to be the end token. (So the rule holds whether the chat template opened the
    thinking in the prompt or the model opens it itself.)"""

    end_token_id: int
    budget: int
    _scanned: int = 0
    _ended: bool = False

    def forced_token(self, output_ids: Sequence[int]) -> int | None:
        """The token the next step must sample, or None. Reads `output_ids` (the output so
        far) and remembers how far it has read, so each token is scanned once."""
        if len(output_ids) < self._scanned:  # tokens were taken back
            self._scanned, self._ended = 0, False
        if not self._ended:
            self._ended = self.end_token_id in output_ids[self._scanned :]
            self._scanned = len(output_ids)
        if self._ended or len(output_ids) < self.budget:
            return None
        return self.end_token_id
