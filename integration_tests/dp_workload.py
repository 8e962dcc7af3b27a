"""The shared-prefix workload of the data-parallel tests (a helper module beside them; this
folder is not a package)."""

from __future__ import annotations

import random

PREFIXES = 4
PER_PREFIX = 8


def shared_prefix_prompts() -> list[str]:
    """PER_PREFIX prompts for each of PREFIXES long shared prefixes, in rounds of one per
    prefix, each round in a random order (a fixed order would let round robin over two
    replicas keep every prefix in place by accident)."""
    from radixlm.runtime.fixtures import sample_texts

    heads = sample_texts(PREFIXES, seed=5, words=60)
    tails = sample_texts(PREFIXES * PER_PREFIX, seed=6, words=5)
    rng = random.Random(0)
    prompts = []
    for r in range(PER_PREFIX):
        order = list(range(PREFIXES))
        rng.shuffle(order)
        prompts += [f"{heads[p]} {tails[r * PREFIXES + p]}" for p in order]
    return prompts
