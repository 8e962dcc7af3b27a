"""The arithmetic of the pooling routes: sigmoid, softmax, cosine, and how a head's raw outputs
become a relevance score or class probabilities (plain floats; no numpy in the server)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)  # no overflow for very negative x
    return e / (1.0 + e)


def softmax(values: Sequence[float]) -> list[float]:
    """Softmax over `values` (-inf is probability 0); all -inf: all 0."""
    top = max(values)
    if top == -math.inf:
        return [0.0] * len(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity (0 when either vector is zero)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0


def relevance(logits: Sequence[float], activation: str = "sigmoid") -> float:
    """A cross-encoder's relevance: its one logit through `activation` (sigmoid, or identity:
    the raw logit), else the softmax probability of its last class (the "relevant" one of a
    two-class head)."""
    if len(logits) != 1:
        return softmax(logits)[-1]
    return float(logits[0]) if activation == "identity" else sigmoid(logits[0])


def class_probs(task: str, logits: Sequence[float]) -> list[float]:
    """What /v1/classify reports as `probs`: a reward model's raw scores; otherwise the softmax
    of the logits, or the sigmoid of a single one."""
    if task == "reward":
        return [float(v) for v in logits]
    return [sigmoid(logits[0])] if len(logits) == 1 else softmax(logits)


def argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)
