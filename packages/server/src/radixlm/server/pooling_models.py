"""The request bodies of the pooling routes (`/v1/embeddings`, `/v1/rerank`, `/v1/score`,
`/v1/classify`) as pydantic models. SGLang's `/encode` body is `radixlm.sampling.EmbeddingRequest`.

Top-level fields are checked strictly: an unknown field is a 400 naming it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: A prompt or several: a text, texts, token ids, or token-id lists (OpenAI's `input`).
PoolingInput = str | list[str] | list[int] | list[list[int]]


class PoolingFields(BaseModel):
    """Fields every pooling route of the OpenAI / vLLM family takes."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        default=None,
        description="keep the last k tokens of a longer prompt instead of refusing it; -1: "
        "as many as the model's context holds",
    )

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _positive_or_context(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("must be at least 1, or -1 for the model's context length")
        return value


class EmbeddingsRequest(PoolingFields):
    """OpenAI's `POST /v1/embeddings` body, with vLLM's `truncate_prompt_tokens` and
    `normalize`."""

    input: PoolingInput = Field(
        description="a text, a list of texts, token ids or a list of token-id lists"
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: the little-endian float32 bytes, base64"
    )
    dimensions: int | None = Field(
        default=None, gt=0, description="keep the first n values (Matryoshka embeddings)"
    )
    normalize: bool | None = Field(
        default=None, description="none: the model's choice; true / false force it"
    )


class RerankDocument(BaseModel):
    """A document given as an object (Jina's and Cohere's form)."""

    model_config = ConfigDict(extra="forbid")

    text: str


class RerankRequest(PoolingFields):
    """`POST /v1/rerank`'s body (vLLM's, Jina's and Cohere's shape)."""

    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = Field(
        default=None, ge=0, description="the n most relevant documents; none or 0: all"
    )
    return_documents: bool = Field(default=True, description="echo each document's text")


class ScoreRequest(PoolingFields):
    """`POST /v1/score`'s body in vLLM's form: pairs of texts (1 to N, or N to N)."""

    text_1: str | list[str]
    text_2: str | list[str]


class GenerativeScoreRequest(BaseModel):
    """`POST /v1/score`'s body in SGLang's form (the body has `label_token_ids`): the
    probabilities of `label_token_ids` as the next token after query + item, from a
    generative model."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    query: str | list[int]
    items: str | list[str] | list[list[int]]
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: bool = Field(
        default=False, description="softmax over the labels; false: each label's probability"
    )
    item_first: bool = Field(default=False, description="prompt item + query instead")

    @field_validator("label_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int]) -> list[int]:
        if min(value) < 0:
            raise ValueError("token ids must be >= 0")
        return value


class ClassifyRequest(PoolingFields):
    """`POST /v1/classify`'s body (vLLM's shape)."""

    input: PoolingInput = Field(
        description="a text, a list of texts, token ids or a list of token-id lists"
    )
