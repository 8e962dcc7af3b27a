"""A `transformers` logits processor, so constraints work with `model.generate` (extra `hf`).

    from transformers import LogitsProcessorList
    processor = GrammarLogitsProcessor.from_tokenizer(tokenizer, GrammarSpec("regex", r"\\d+"))
    model.generate(**inputs, logits_processor=LogitsProcessorList([processor]))

Greedy decoding and sampling are supported (also `num_return_sequences`); beam search is not,
because beams reorder rows between steps. Jump-forward needs an engine that can append tokens,
so it is not used here; for the same reason the constraint is compiled strict (`generate`
cannot take tokens back, so keywords only validation and rollback would enforce are refused by
name). A processor serves one `generate` call; make a new one per call.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from radixlm.constrained.bitmask import allocate_bitmask, apply_bitmask
from radixlm.constrained.interfaces import CompiledGrammar, Grammar, GrammarBackend
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.registry import DEFAULT_BACKEND, create_backend
from radixlm.constrained.spec import GrammarSpec
from radixlm.constrained.tokenizer import TokenizerInfo


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks every row's logits to the tokens its grammar allows next.

    On the first call it takes the prompt length from `input_ids`; on every later call it
    feeds each row's newest token to that row's grammar. A row whose grammar has terminated
    allows only stop tokens (transformers pads finished rows itself).
    """

    def __init__(self, backend: GrammarBackend, grammar: GrammarSpec | CompiledGrammar) -> None:
        self._backend = backend
        self._compiled = (
            grammar
            if isinstance(grammar, CompiledGrammar)
            else backend.compile(grammar.with_strict(True))
        )
        self._grammars: list[Grammar] = []
        self._bitmask: Any = None
        self._stops = list(backend.tokenizer_info.stop_token_ids)

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        spec: GrammarSpec,
        *,
        backend: str = DEFAULT_BACKEND,
        vocab_size: int | None = None,
        options: GrammarOptions | None = None,
    ) -> GrammarLogitsProcessor:
        """Build the backend from a local HF tokenizer (pass the model's `vocab_size` when its
        embedding is wider than the tokenizer) and compile `spec` (raises GrammarError)."""
        info = TokenizerInfo.from_hf(tokenizer, vocab_size=vocab_size)
        return cls(create_backend(backend, info, options), spec)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = input_ids.shape[0]
        if not self._grammars:
            base = self._backend.matcher(self._compiled)
            self._grammars = [base] + [base.fork() for _ in range(batch - 1)]
            self._bitmask = allocate_bitmask(batch, self._backend.tokenizer_info.vocab_size)
        elif len(self._grammars) != batch:
            raise ValueError(
                "the batch changed size between steps (beam search?); "
                "GrammarLogitsProcessor supports greedy decoding and sampling"
            )
        else:
            for row, grammar in enumerate(self._grammars):
                if not grammar.is_terminated():
                    token = int(input_ids[row, -1])
                    if not grammar.accept_token(token):
                        raise ValueError(
                            f"row {row} produced token {token}, which its grammar does not allow; "
                            "was another processor applied after this one?"
                        )
        for row, grammar in enumerate(self._grammars):
            if grammar.is_terminated():
                self._bitmask[row] = 0
                for stop in self._stops:
                    self._bitmask[row, stop // 32] |= (1 << (stop % 32)) - (
                        1 << 32 if stop % 32 == 31 else 0
                    )
            else:
                grammar.fill_bitmask(self._bitmask, row)
        apply_bitmask(scores, self._bitmask.to(scores.device))
        return scores
