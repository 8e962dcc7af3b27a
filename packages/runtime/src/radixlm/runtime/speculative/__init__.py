"""Speculative decoding: draft tokens proposed before a step, verified in the step's forward.

`ngram` proposes drafts without a model (torch-free; the scheduler asks it); `verify` accepts
or rejects them against the target model's logits so that the output keeps the target's
distribution exactly (greedy: the same tokens).
"""

from radixlm.runtime.speculative.ngram import NgramDrafter, ngram_lookup

__all__ = ["NgramDrafter", "ngram_lookup"]
