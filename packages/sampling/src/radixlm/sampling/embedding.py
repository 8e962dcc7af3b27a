"""EmbeddingRequest / EmbeddingOutput: SGLang's `/encode` body and result, for pooling models
(embedders, cross-encoders, classifiers, reward models)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from radixlm.sampling.errors import InvalidRequest

_PER_ITEM = ("rid", "text_pair")


class EmbeddingRequest(BaseModel):
    """SGLang's `/encode` body (its `EmbeddingReqInput`), single or batch.

    Exactly one of `text` and `input_ids`. `text_pair` makes a (text, text_pair) pair for a
    cross-encoder (tokenized as the model's tokenizer joins two segments, with token types).
    A list of prompts is a batch; `rid` and `text_pair` then hold one value per item.

    - `dimensions`: keep the first `dimensions` values (Matryoshka embeddings), then normalise
      again when the embedding is normalised;
    - `normalize`: None takes the model's choice (a sentence-transformers `Normalize` module,
      else the engine's flag); True / False force it;
    - `truncate_prompt_tokens` (vLLM): keep the last k tokens of a longer prompt instead of
      refusing it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str | list[str] | None = None
    text_pair: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    dimensions: int | None = Field(default=None, gt=0)
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, gt=0)
    lora_path: str | None = None

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> EmbeddingRequest:
        """Validate a JSON body; raises InvalidRequest naming the field."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as error:
            raise InvalidRequest.from_validation_error(error) from None

    @model_validator(mode="after")
    def _shape(self) -> EmbeddingRequest:
        given = [n for n in ("text", "input_ids") if getattr(self, n) is not None]
        if not given:
            raise InvalidRequest("text", "give the input as text or input_ids")
        if len(given) > 1:
            raise InvalidRequest("input_ids", "give only one of text, input_ids")
        if self.batch_size == 0:
            raise InvalidRequest(given[0], "the batch is empty; give at least one input")
        ids = self.input_ids
        rows = [] if ids is None else [ids] if self.is_single else ids
        for row in cast(list[list[int]], rows):
            if not row:
                raise InvalidRequest("input_ids", "an input must hold at least one token id")
            if min(row) < 0:
                raise InvalidRequest("input_ids", "token ids must be >= 0")
        if self.text_pair is not None and self.text is None:
            raise InvalidRequest("text_pair", "a pair needs its first text in `text`")
        for name in _PER_ITEM:
            value = getattr(self, name)
            if self.is_single and isinstance(value, list):
                raise InvalidRequest(name, "a single input takes one value, not a list")
            if not self.is_single and value is not None:
                if not isinstance(value, list):
                    raise InvalidRequest(name, "a batch takes a list with one value per input")
                if len(value) != self.batch_size:
                    raise InvalidRequest(
                        name, f"has {len(value)} entries but the batch has {self.batch_size}"
                    )
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise InvalidRequest("rid", "request ids in a batch must be distinct")
        return self

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        ids = self.input_ids or []
        return not ids or not isinstance(ids[0], list)

    @property
    def batch_size(self) -> int:
        if self.is_single:
            return 1
        return len(self.text if self.text is not None else self.input_ids or [])

    def split(self) -> list[EmbeddingRequest]:
        """One single request per input (per-item values from lists); a single one is [self]."""
        if self.is_single:
            return [self]
        shared = {
            "dimensions": self.dimensions,
            "normalize": self.normalize,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "lora_path": self.lora_path,
        }
        items = []
        for i in range(self.batch_size):
            values: dict[str, Any] = dict(shared)
            for name in ("text", "input_ids", *_PER_ITEM):
                value = getattr(self, name)
                values[name] = value[i] if isinstance(value, list) else value
            items.append(EmbeddingRequest.model_construct(**values))
        return items


class EmbeddingOutput(NamedTuple):
    """The result of one single `EmbeddingRequest`.

    `embedding` is the pooled (and, as asked, truncated / normalised) vector of an embedding
    model, or the head's raw outputs (logits, one per label, or the reward) of a
    classifier, cross-encoder or reward model.
    """

    rid: str
    embedding: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int = 0
    e2e_latency: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """SGLang's `/encode` answer for one input."""
        return {
            "embedding": list(self.embedding),
            "meta_info": {
                "id": self.rid,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "e2e_latency": self.e2e_latency,
            },
        }
