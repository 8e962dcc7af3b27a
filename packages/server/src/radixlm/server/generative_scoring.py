"""SGLang's form of `POST /v1/score` (a body with `label_token_ids`): how likely a generative
model finds each label token as the next token after query + item."""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixlm.sampling import GenerateChunk, GenerateRequest, InvalidRequest
from radixlm.server.errors import APIError
from radixlm.server.openai_common import usage
from radixlm.server.pooling_models import GenerativeScoreRequest
from radixlm.server.score_math import softmax
from radixlm.server.state import ServerState, renamed_errors
from radixlm.server.streams import EngineJSONResponse, EngineStreams, cancel_on_disconnect

#: One greedy token whose logprobs of the labels are read. `ignore_eos`, so that an EOS
#: picked as that token still leaves its position (and the labels' logprobs) in the output.
_ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


def _prompts(request: GenerativeScoreRequest) -> list[dict[str, Any]]:
    """Each item's prompt: query + item (item + query with `item_first`), as text when the
    query is a text, as token ids when it is token ids."""
    items = [request.items] if isinstance(request.items, str) else request.items
    if not items:
        raise InvalidRequest("items", "give at least one item to score")
    query = request.query
    if isinstance(query, str):
        if not all(isinstance(item, str) for item in items):
            raise InvalidRequest("items", "the query is a text, so the items must be texts too")
        texts = [str(item) for item in items]
        return [{"text": t + query if request.item_first else query + t} for t in texts]
    if not all(isinstance(item, list) for item in items):
        raise InvalidRequest(
            "items", "the query is token ids, so each item must be a list of token ids too"
        )
    lists = [list(item) for item in items if isinstance(item, list)]
    return [{"input_ids": ids + query if request.item_first else query + ids} for ids in lists]


def _label_scores(chunk: GenerateChunk, request: GenerativeScoreRequest, index: int) -> list[float]:
    positions = chunk.output_token_ids_logprobs
    if not positions or positions[0] is None:
        raise APIError(
            500,
            f"the engine returned no logprobs of the label tokens for items[{index}] "
            "(token_ids_logprob); this is an engine bug",
        )
    found = {entry.token_id: entry.logprob for entry in positions[0]}
    logprobs = [found.get(token) for token in request.label_token_ids]
    values = [-math.inf if v is None else float(v) for v in logprobs]
    if request.apply_softmax:
        return softmax(values)
    return [math.exp(v) for v in values]


async def _finals(streams: EngineStreams) -> dict[int, GenerateChunk]:
    finals: dict[int, GenerateChunk] = {}
    try:
        await streams.start()
        async for stream, chunk in streams:
            if chunk.finished:
                finals[stream] = chunk
    finally:
        await streams.aclose()
    return finals


async def generative_scores(
    state: ServerState, http: Request, request: GenerativeScoreRequest, route: str
) -> Response:
    """SGLang's answer `{"scores": [[per label] per item], "model", "usage", "object":
    "scoring"}`: per label exp(logprob), or the softmax over the labels' logprobs with
    `apply_softmax`; a label the engine left out counts as logprob -inf."""
    if state.model_info.get("is_generation", True) is False:
        raise APIError(
            400,
            "SGLang's /v1/score form (label_token_ids) scores with a generative model; this "
            "model is a pooling model: send vLLM's form (text_1, text_2) instead",
            param="label_token_ids",
            code="not_a_generative_model",
        )
    model = state.check_model(request.model)
    names = {
        "text": "items",
        "input_ids": "items",
        "token_ids_logprob": "label_token_ids",
        **model.error_names(),
    }
    with renamed_errors(names):
        items = [
            state.prepare(
                GenerateRequest.parse(
                    {
                        **prompt,
                        "sampling_params": _ONE_TOKEN,
                        "return_logprob": True,
                        "token_ids_logprob": request.label_token_ids,
                        "lora_path": model.lora,
                    }
                )
            )
            for prompt in _prompts(request)
        ]
        finals = await cancel_on_disconnect(http, _finals(state.streams(route, items)))
    if len(finals) < len(items):
        raise APIError(500, f"the engine ended {len(items) - len(finals)} item(s) without a "
                       "final chunk (finish_reason set); this is an engine bug")  # fmt: skip
    chunks = [finals[i] for i in range(len(items))]
    scores = [_label_scores(chunk, request, i) for i, chunk in enumerate(chunks)]
    total = usage(
        sum(c.prompt_tokens for c in chunks),
        sum(c.completion_tokens for c in chunks),
        sum(c.cached_tokens for c in chunks) if state.config.enable_cache_report else None,
    )
    return EngineJSONResponse(
        {"scores": scores, "model": model.name, "usage": total, "object": "scoring"}
    )
