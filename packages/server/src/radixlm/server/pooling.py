"""The pooling routes over the engine's optional `encode`: OpenAI's `/v1/embeddings`, vLLM's
`/v1/rerank`, `/v1/score` and `/v1/classify`, SGLang's `/encode`; and the checks that keep
generation off pooling models and pooling off generative ones."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from radixlm.sampling import EmbeddingOutput, EmbeddingRequest, InvalidRequest
from radixlm.server.errors import APIError
from radixlm.server.generative_scoring import generative_scores
from radixlm.server.openai_common import now, parse_body
from radixlm.server.pooling_models import (
    ClassifyRequest,
    EmbeddingsRequest,
    GenerativeScoreRequest,
    PoolingFields,
    PoolingInput,
    RerankRequest,
    ScoreRequest,
)
from radixlm.server.score_math import argmax, class_probs, cosine, relevance
from radixlm.server.state import ServedModel, ServerState, renamed_errors
from radixlm.server.streams import EngineJSONResponse, cancel_on_disconnect

#: The routes that serve each pooling task, named when a route refuses a model.
TASK_ROUTES = {
    "embed": "/v1/embeddings, /v1/rerank, /v1/score or /encode",
    "classify": "/v1/classify or /encode",
    "score": "/v1/rerank, /v1/score, /v1/classify or /encode",
    "reward": "/v1/classify or /encode",
}
_SCORING_TASKS = ("score", "embed")
_CLASSIFYING_TASKS = ("classify", "reward", "score")


@dataclass(frozen=True)
class PoolingInfo:
    """A pooling model's `model_info()["pooling"]`: what `encode` returns and how to read it
    (task embed: the pooled vector; classify: one logit per label; score: a cross-encoder's
    logit(s) for a text pair; reward: the reward model's score(s))."""

    task: str
    method: str = "last"
    normalize: bool = False
    num_labels: int = 1
    id2label: Mapping[str, str] = field(default_factory=dict)
    hidden_size: int = 0
    #: A cross-encoder's activation over its one logit ("sigmoid", the default, or
    #: "identity"), as the checkpoint's sentence-transformers config names it.
    activation: str = "sigmoid"

    @classmethod
    def of(cls, state: ServerState) -> PoolingInfo | None:
        """The served model's pooling facts; None for a generative model."""
        raw = state.model_info.get("pooling")
        if not isinstance(raw, Mapping):
            return None
        labels = raw.get("id2label") or {}
        return cls(
            task=str(raw.get("task", "embed")),
            method=str(raw.get("method", "last")),
            normalize=bool(raw.get("normalize", False)),
            num_labels=int(raw.get("num_labels", 1)),
            id2label={str(k): str(v) for k, v in labels.items()},
            hidden_size=int(raw.get("hidden_size", 0)),
            activation=str(raw.get("activation") or "sigmoid"),
        )

    def label(self, index: int) -> str:
        return self.id2label.get(str(index), f"LABEL_{index}")

    @property
    def routes(self) -> str:
        return TASK_ROUTES.get(self.task, "/encode")


def refuse_generation(state: ServerState) -> None:
    """A 400 from a generation route (`/generate`, `/v1/completions`, `/v1/chat/completions`,
    `/v1/responses`) when the served model is a pooling model: `model_info()["is_generation"]`
    is False. An engine that does not report it serves a generative model."""
    if state.model_info.get("is_generation", True) is not False:
        return
    info = PoolingInfo.of(state)
    what = f"a pooling model (task {info.task})" if info else "a pooling model"
    routes = info.routes if info else "/encode"
    raise APIError(
        400,
        f"this model is {what} and does not generate text; use {routes}",
        param="model",
        code="not_a_generative_model",
    )


def pooling_model(
    state: ServerState, route: str, tasks: Sequence[str] | None, hint: str = ""
) -> PoolingInfo:
    """The served model's pooling facts when it is a pooling model of one of `tasks` (None:
    any); otherwise a 400 saying what fits."""
    info = PoolingInfo.of(state)
    if info is None:
        raise APIError(
            400,
            "this model generates text; serve an embedding / classification model for "
            f"{route}{hint}",
            param="model",
            code="not_a_pooling_model",
        )
    if tasks is not None and info.task not in tasks:
        raise APIError(
            400,
            f"{route} needs a model of task {' or '.join(tasks)}; this model's task is "
            f"{info.task}: use {info.routes}",
            param="model",
            code="wrong_task",
        )
    return info


# Engine calls.

Job = tuple[EmbeddingRequest, Mapping[str, str]]


def _job(names: Mapping[str, str], **fields: Any) -> Job:
    """A single EmbeddingRequest and the request fields the engine's fields are reported as."""
    with renamed_errors(names):
        return EmbeddingRequest.parse(fields), names


async def encode_all(state: ServerState, route: str, jobs: Sequence[Job]) -> list[EmbeddingOutput]:
    """Every job on the engine at once; the outputs in order. The first failure (its field
    renamed to the one the client sent) cancels the others."""

    async def one(request: EmbeddingRequest, names: Mapping[str, str]) -> EmbeddingOutput:
        with renamed_errors(names):
            return await state.encode(route, request)

    tasks = [asyncio.ensure_future(one(request, names)) for request, names in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # nothing for those done
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


def _shared(state: ServerState, request: PoolingFields, model: ServedModel) -> dict[str, Any]:
    """The EmbeddingRequest fields every prompt of a call takes."""
    truncate = request.truncate_prompt_tokens
    if truncate == -1:  # vLLM's "the model's context": nothing to cut when it is unknown
        truncate = state.context_length
    return {"truncate_prompt_tokens": truncate, "lora_path": model.lora}


def _prompts(value: PoolingInput) -> list[dict[str, Any]]:
    """OpenAI's `input` as EmbeddingRequest prompts, `{"text": ...}` or `{"input_ids": ...}`."""
    if isinstance(value, str):
        return [{"text": value}]
    if not value:
        raise InvalidRequest("input", "the input is empty; give at least one text or token list")
    if all(isinstance(v, int) for v in value):
        return [{"input_ids": list(value)}]
    return [{"text": v} if isinstance(v, str) else {"input_ids": list(v)} for v in value]  # type: ignore[arg-type]


def _usage(outputs: Sequence[EmbeddingOutput]) -> dict[str, int]:
    tokens = sum(output.prompt_tokens for output in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _float32_base64(values: Sequence[float]) -> str:
    """The little-endian float32 bytes of `values`, base64 (what OpenAI's clients decode)."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


async def _pair_scores(
    state: ServerState,
    route: str,
    info: PoolingInfo,
    firsts: list[str],
    seconds: list[str],
    shared: dict[str, Any],
    params: tuple[str, str],
    names: Mapping[str, str],
) -> tuple[list[float], list[EmbeddingOutput]]:
    """The score of each pair (first, seconds[i]), the first being firsts[i], or firsts[0]
    when there is one: a cross-encoder's relevance of the pair, or the cosine of an embedding
    model's vectors of the two (each text embedded once); and the engine's outputs."""
    first, second = params
    pick = (lambda i: firsts[0]) if len(firsts) == 1 else firsts.__getitem__
    if info.task == "score":
        pair_names = {**names, "text": first, "text_pair": second}
        jobs = [
            _job(pair_names, text=pick(i), text_pair=text, **shared)
            for i, text in enumerate(seconds)
        ]
        outputs = await encode_all(state, route, jobs)
        return [relevance(output.embedding, info.activation) for output in outputs], outputs
    jobs = [_job({**names, "text": first}, text=text, **shared) for text in firsts]
    jobs += [_job({**names, "text": second}, text=text, **shared) for text in seconds]
    outputs = await encode_all(state, route, jobs)
    left, right = outputs[: len(firsts)], outputs[len(firsts) :]
    vector = (lambda i: left[0]) if len(left) == 1 else left.__getitem__
    scores = [cosine(vector(i).embedding, out.embedding) for i, out in enumerate(right)]
    return scores, outputs


# Routes.


async def create_embeddings(state: ServerState, http: Request) -> Response:
    route = "/v1/embeddings"
    pooling_model(state, route, ("embed",))
    request = await state.read_body(http, partial(parse_body, EmbeddingsRequest))
    model = state.check_model(request.model)
    names = {"text": "input", "input_ids": "input", **model.error_names()}
    shared = {
        **_shared(state, request, model),
        "dimensions": request.dimensions,
        "normalize": request.normalize,
    }
    jobs = [_job(names, **prompt, **shared) for prompt in _prompts(request.input)]
    outputs = await cancel_on_disconnect(http, encode_all(state, route, jobs))
    base64_format = request.encoding_format == "base64"
    data = [
        {
            "object": "embedding",
            "embedding": _float32_base64(out.embedding) if base64_format else list(out.embedding),
            "index": i,
        }
        for i, out in enumerate(outputs)
    ]
    return EngineJSONResponse(
        {
            "id": state.new_id("embd-"),
            "object": "list",
            "created": now(),
            "model": model.name,
            "data": data,
            "usage": _usage(outputs),
        }
    )


async def rerank(state: ServerState, http: Request, route: str) -> Response:
    info = pooling_model(state, route, _SCORING_TASKS)
    request = await state.read_body(http, partial(parse_body, RerankRequest))
    model = state.check_model(request.model)
    documents = [d if isinstance(d, str) else d.text for d in request.documents]
    work = _pair_scores(
        state,
        route,
        info,
        [request.query],
        documents,
        _shared(state, request, model),
        ("query", "documents"),
        model.error_names(),
    )
    scores, outputs = await cancel_on_disconnect(http, work)
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties by index
    results = []
    for index in ranked[: request.top_n or len(documents)]:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if request.return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return EngineJSONResponse(
        {
            "id": state.new_id("rerank-"),
            "model": model.name,
            "usage": _usage(outputs),
            "results": results,
        }
    )


def _parse_score(body: dict[str, Any]) -> ScoreRequest | GenerativeScoreRequest:
    """SGLang's form when the body has `label_token_ids`, vLLM's otherwise."""
    if "label_token_ids" in body:
        return parse_body(GenerativeScoreRequest, body)
    return parse_body(ScoreRequest, body)


def _texts(value: str | list[str], name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise InvalidRequest(name, "give at least one text")
    return texts


async def score(state: ServerState, http: Request, route: str) -> Response:
    request = await state.read_body(http, _parse_score)
    if isinstance(request, GenerativeScoreRequest):
        return await generative_scores(state, http, request, route)
    hint = " (or send SGLang's form, query / items / label_token_ids, to score with this model)"
    info = pooling_model(state, route, _SCORING_TASKS, hint)
    model = state.check_model(request.model)
    firsts, seconds = _texts(request.text_1, "text_1"), _texts(request.text_2, "text_2")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequest(
            "text_2",
            f"has {len(seconds)} texts but text_1 has {len(firsts)}; give one text_1 for any "
            "number of text_2 (1 to N), or as many of each (N to N)",
        )
    work = _pair_scores(
        state,
        route,
        info,
        firsts,
        seconds,
        _shared(state, request, model),
        ("text_1", "text_2"),
        model.error_names(),
    )
    scores, outputs = await cancel_on_disconnect(http, work)
    return EngineJSONResponse(
        {
            "id": state.new_id("score-"),
            "object": "list",
            "created": now(),
            "model": model.name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(outputs),
        }
    )


async def classify(state: ServerState, http: Request, route: str) -> Response:
    info = pooling_model(state, route, _CLASSIFYING_TASKS)
    request = await state.read_body(http, partial(parse_body, ClassifyRequest))
    model = state.check_model(request.model)
    names = {"text": "input", "input_ids": "input", **model.error_names()}
    shared = _shared(state, request, model)
    jobs = [_job(names, **prompt, **shared) for prompt in _prompts(request.input)]
    outputs = await cancel_on_disconnect(http, encode_all(state, route, jobs))
    data = []
    for index, output in enumerate(outputs):
        probs = class_probs(info.task, output.embedding)
        data.append(
            {
                "index": index,
                "label": info.label(argmax(probs)),
                "probs": probs,
                "num_classes": len(probs),
            }
        )
    return EngineJSONResponse(
        {
            "id": state.new_id("classify-"),
            "object": "list",
            "created": now(),
            "model": model.name,
            "data": data,
            "usage": _usage(outputs),
        }
    )


async def encode(state: ServerState, http: Request) -> Response:
    pooling_model(state, "/encode", None)
    request = await state.read_body(http, EmbeddingRequest.parse)
    jobs: list[Job] = [(item, {}) for item in request.split()]
    outputs = await cancel_on_disconnect(http, encode_all(state, "/encode", jobs))
    if request.is_single:
        return EngineJSONResponse(outputs[0].to_json())
    return EngineJSONResponse([output.to_json() for output in outputs])


def _documented(*models: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body itself: one model, or any of
    several (for /docs and docs/http-api.md)."""
    schemas = [model.model_json_schema() for model in models]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def pooling_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["pooling"])

    @router.post("/v1/embeddings", openapi_extra=_documented(EmbeddingsRequest))
    async def embeddings(http: Request) -> Response:
        """OpenAI's embeddings, from an embedding model: float or base64 vectors, `dimensions`,
        vLLM's `truncate_prompt_tokens` and `normalize`."""
        return await create_embeddings(state, http)

    @router.post("/v1/rerank", openapi_extra=_documented(RerankRequest))
    async def rerank_v1(http: Request) -> Response:
        """Documents ranked by relevance to a query (vLLM's, Jina's and Cohere's shape), by a
        cross-encoder or by the cosine of an embedding model's vectors; also `/rerank`."""
        return await rerank(state, http, "/v1/rerank")

    @router.post("/rerank", include_in_schema=False)
    async def rerank_alias(http: Request) -> Response:
        return await rerank(state, http, "/rerank")

    @router.post("/v1/score", openapi_extra=_documented(ScoreRequest, GenerativeScoreRequest))
    async def score_v1(http: Request) -> Response:
        """vLLM's score of text pairs (text_1 1 to N or N to N with text_2), by a
        cross-encoder or an embedding model's cosine; or, for a body with label_token_ids,
        SGLang's probabilities of label tokens after query + item from a generative model;
        also `/score`."""
        return await score(state, http, "/v1/score")

    @router.post("/score", include_in_schema=False)
    async def score_alias(http: Request) -> Response:
        return await score(state, http, "/score")

    @router.post("/v1/classify", openapi_extra=_documented(ClassifyRequest))
    async def classify_v1(http: Request) -> Response:
        """vLLM's classification: each input's label and class probabilities, from a
        classifier (softmax), a cross-encoder (sigmoid) or a reward model (raw scores); also
        `/classify`."""
        return await classify(state, http, "/v1/classify")

    @router.post("/classify", include_in_schema=False)
    async def classify_alias(http: Request) -> Response:
        return await classify(state, http, "/classify")

    @router.post("/encode", openapi_extra=_documented(EmbeddingRequest))
    async def encode_route(http: Request) -> Response:
        """SGLang's `/encode`: a pooling model's raw output (embedding, logits or reward) per
        input, single or batch."""
        return await encode(state, http)

    return router
