"""Pooling models: how a sequence's final hidden states become one vector.

A pooling model (an embedder, a cross-encoder, a classifier, a reward model) runs a prompt's
prefill and no decode. Its `PoolingConfig` says what it returns (`task`), which rows it pools
(`method`) and whether embeddings are L2-normalised; it comes from the checkpoint's
sentence-transformers files (`modules.json`, `1_Pooling/config.json`, a `Normalize` module)
when there are any, else from the architecture and the engine's flags. Each sequence's
`PooledRows` collects what its method needs as the prefill's chunks are computed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

PoolingTask = Literal["embed", "classify", "score", "reward"]
PoolingMethod = Literal["last", "mean", "cls"]
POOLING_METHODS: tuple[str, ...] = ("last", "mean", "cls")

# sentence-transformers' Pooling flags -> radixlm's methods.
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


class PoolingConfigError(ValueError):
    """A checkpoint's pooling set-up that radixlm cannot reproduce (named in the message)."""


@dataclass(frozen=True)
class PoolingConfig:
    """What a pooling model returns.

    - `task`: "embed" (the pooled vector), "classify" (a classifier's logits, one per label),
      "score" (a cross-encoder's logit over a text pair), "reward" (a reward model's score);
    - `method`: the rows pooled: the last token's, the mean of every token's, or the first
      token's (`cls`);
    - `normalize`: embeddings are L2-normalised (a request may say otherwise);
    - `num_labels` / `id2label`: the head's outputs (0 for an embedder).
    """

    task: PoolingTask
    method: PoolingMethod
    normalize: bool
    num_labels: int = 0
    id2label: dict[str, str] = field(default_factory=dict)
    #: Where `method` and `normalize` came from (logged, reported by get_model_info).
    source: str = ""
    #: A cross-encoder's activation over its logit ("sigmoid" or "identity", from its
    #: sentence-transformers config; None: the default, sigmoid for one label).
    activation: str | None = None

    def as_dict(self, hidden_size: int) -> dict[str, Any]:
        """The `pooling` entry of `model_info()` (what the HTTP server reads)."""
        return {
            "task": self.task,
            "method": self.method,
            "normalize": self.normalize,
            "num_labels": self.num_labels,
            "id2label": dict(self.id2label),
            "hidden_size": hidden_size,
            "source": self.source,
            "activation": self.activation,
        }


def read_sentence_transformers(path: Path) -> tuple[PoolingMethod, bool] | None:
    """The pooling method and normalisation of a sentence-transformers directory (None when
    it has no `modules.json`). Modules radixlm does not run (a `Dense` projection, ...) are
    refused rather than skipped: the embeddings would differ from the model's."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    method: PoolingMethod | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            method = _st_pooling(path / str(module.get("path", "")))
        else:
            raise PoolingConfigError(
                f"{modules_file}: the sentence-transformers module {module.get('type')!r} "
                "is not supported (radixlm runs Transformer, Pooling and Normalize); drop it "
                "from modules.json to serve the model without it"
            )
    if method is None:
        raise PoolingConfigError(f"{modules_file} has no Pooling module")
    return method, normalize


def _st_pooling(directory: Path) -> PoolingMethod:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise PoolingConfigError(f"{config_file} is missing (the Pooling module's config)")
    config = json.loads(config_file.read_text())
    for name in _ST_UNSUPPORTED:
        if config.get(name):
            raise PoolingConfigError(
                f"{config_file}: {name} is not supported; radixlm pools the last token, "
                "the mean or the first token (pooling_method)"
            )
    chosen = [method for name, method in _ST_MODES.items() if config.get(name)]
    if len(chosen) != 1:
        raise PoolingConfigError(
            f"{config_file}: exactly one of {', '.join(_ST_MODES)} must be true"
        )
    if config.get("include_prompt") is False:
        raise PoolingConfigError(f"{config_file}: include_prompt false is not supported")
    return chosen[0]  # type: ignore[return-value]


_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


def cross_encoder_activation(path: Path, hf_config: Any) -> str | None:
    """The activation sentence-transformers' CrossEncoder applies to this checkpoint's logit:
    `activation_fn` in `config_sentence_transformers.json` (6.x), else in config.json's
    `sentence_transformers` entry (4.x, 5.x) or `sbert_ce_default_activation_function`."""
    names = []
    st_file = path / "config_sentence_transformers.json"
    if st_file.is_file():
        names.append(json.loads(st_file.read_text()).get("activation_fn"))
    entry = getattr(hf_config, "sentence_transformers", None)
    if isinstance(entry, dict):
        names.append(entry.get("activation_fn"))
    names.append(getattr(hf_config, "sbert_ce_default_activation_function", None))
    for name in names:
        if name:
            short = str(name).rsplit(".", 1)[-1]
            if short not in _ACTIVATIONS:
                raise PoolingConfigError(
                    f"{path}: the cross-encoder activation {name!r} is not supported "
                    "(radixlm applies Sigmoid or Identity)"
                )
            return _ACTIVATIONS[short]
    return None


def pooling_config(
    path: Path,
    task: PoolingTask,
    default_method: PoolingMethod,
    *,
    method: str | None = None,
    normalize: bool | None = None,
    num_labels: int = 0,
    id2label: dict[Any, Any] | None = None,
    activation: str | None = None,
) -> PoolingConfig:
    """The pooling of a checkpoint: the engine's flags (`method`, `normalize`), else its
    sentence-transformers files, else the architecture's default (`default_method`;
    embeddings normalised, as vLLM and SGLang do)."""
    sources = []
    st = read_sentence_transformers(path) if task == "embed" else None
    chosen: str = default_method
    chosen_normalize = task == "embed"
    if st is not None:
        chosen, chosen_normalize = st
        sources.append("sentence-transformers config")
    if method is not None:
        if method not in POOLING_METHODS:
            raise PoolingConfigError(
                f"pooling_method must be one of {', '.join(POOLING_METHODS)}; got {method!r}"
            )
        chosen = method
        sources.append("pooling_method flag")
    if normalize is not None:
        chosen_normalize = normalize
        sources.append("normalize flag")
    labels = {str(k): str(v) for k, v in (id2label or {}).items()}
    return PoolingConfig(
        task=task,
        method=chosen,  # type: ignore[arg-type]
        normalize=chosen_normalize and task == "embed",
        num_labels=num_labels,
        id2label=labels or {str(i): f"LABEL_{i}" for i in range(num_labels)},
        source=", ".join(sources) or "the architecture's default",
        activation=activation,
    )


class PooledRows:
    """What one sequence's pooling keeps of its prompt's final hidden states, chunk by chunk.

    `last` keeps the last prompt position's row (earlier positions may come from the prefix
    cache); `mean` sums every row (its prompt is computed whole: no cached prefix); `cls`
    keeps position 0's row."""

    def __init__(self, method: PoolingMethod, prompt_len: int) -> None:
        self.method = method
        self.prompt_len = prompt_len
        self._sum: torch.Tensor | None = None
        self._counted = 0
        self.vector: torch.Tensor | None = None

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt position must be computed (no prefix from the cache)."""
        return self.method != "last"

    def record(self, start: int, rows: torch.Tensor) -> None:
        """The final hidden states [k, hidden] of positions `start .. start + k`."""
        end = start + rows.shape[0]
        if self.method == "last":
            if end == self.prompt_len:
                self.vector = rows[-1].float()
        elif self.method == "cls":
            if start == 0:
                self.vector = rows[0].float()
        else:
            if start != self._counted:  # a chunk computed again (after a retraction)
                self._sum, self._counted = None, 0
                if start != 0:
                    return
            part = rows.float().sum(dim=0)
            self._sum = part if self._sum is None else self._sum + part
            self._counted = end
            if end == self.prompt_len:
                self.vector = self._sum / self.prompt_len

    @property
    def done(self) -> bool:
        return self.vector is not None


def finish_embedding(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> list[float]:
    """An embedding as a request asked for it: its first `dimensions` values (Matryoshka),
    then L2-normalised when `normalize`."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return [float(v) for v in vector.tolist()]
