"""`/tokenize` and `/detokenize` (also under `/v1`): the served model's tokenizer over HTTP,
in SGLang's shape (`prompt` a string or a list, `tokens` / `count` / `max_model_len`; `text`
back) with vLLM's extras (`messages` rendered through the chat template, `return_token_strs`;
`prompt` back from `/detokenize`)."""

from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.requests import Request

from radixlm.sampling import InvalidRequest
from radixlm.server.openai_chat import render_chat
from radixlm.server.openai_common import parse_body
from radixlm.server.state import ServerState


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a `prompt` (one string or a list of them) or a chat's `messages`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    #: Default: True for a prompt (as generation tokenizes it), False for messages (the
    #: chat template writes the special tokens itself).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("prompt", "give either prompt (text) or messages (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids (one list, or a list of lists) back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def _tokenizer(state: ServerState) -> Any:
    tokenizer = getattr(state.engine, "tokenizer", None)
    if tokenizer is None:
        raise InvalidRequest("model", "this engine has no tokenizer to tokenize with")
    return tokenizer


def tokenize(state: ServerState, request: TokenizeRequest) -> dict[str, Any]:
    """The ids (and optionally the token strings) of each prompt, or of the rendered chat."""
    tokenizer = _tokenizer(state)
    if request.messages is not None:
        text = render_chat(
            tokenizer,
            request.messages,
            request.tools,
            state.config.chat_template,
            request.chat_template_kwargs,
            add_generation_prompt=request.add_generation_prompt,
        )
        texts, single, special = [text], True, bool(request.add_special_tokens)
    else:
        prompt = request.prompt
        single = isinstance(prompt, str)
        texts = [prompt] if isinstance(prompt, str) else list(prompt or [])
        special = request.add_special_tokens is not False
    for text in texts:
        state.check_text_fits(text, "prompt" if request.messages is None else "messages")
    ids = [list(tokenizer.encode(text, add_special_tokens=special)) for text in texts]
    out: dict[str, Any] = {
        "tokens": ids[0] if single else ids,
        "count": len(ids[0]) if single else [len(i) for i in ids],
        "max_model_len": state.context_length,
    }
    if request.return_token_strs:
        strs = [tokenizer.convert_ids_to_tokens(i) for i in ids]
        out["token_strs"] = strs[0] if single else strs
    return out


def detokenize(state: ServerState, request: DetokenizeRequest) -> dict[str, Any]:
    """The text of each id list; ids outside the vocabulary are refused by name."""
    tokenizer = _tokenizer(state)
    tokens = request.tokens
    single = not tokens or not isinstance(tokens[0], list)
    lists = cast(list[list[int]], [tokens] if single else tokens)
    vocab = state.model_info.get("vocab_size")
    for ids in lists:
        bad = [i for i in ids if i < 0 or (isinstance(vocab, int) and i >= vocab)]
        if bad:
            raise InvalidRequest(
                "tokens", f"ids {bad[:5]} are outside the vocabulary (0..{vocab or '?'} - 1)"
            )
    texts = [
        tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens) for ids in lists
    ]
    text: str | list[str] = texts[0] if single else texts
    return {"text": text, "prompt": text}


def tokenize_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", tags=["native"])
    @router.post("/v1/tokenize", tags=["native"])
    async def tokenize_route(http: Request) -> dict[str, Any]:
        """Token ids of a prompt or a chat (SGLang's and vLLM's `/tokenize`)."""
        request = await state.read_body(http, lambda body: parse_body(TokenizeRequest, body))
        return await state.run_blocking(tokenize, state, request)

    @router.post("/detokenize", tags=["native"])
    @router.post("/v1/detokenize", tags=["native"])
    async def detokenize_route(http: Request) -> dict[str, Any]:
        """Text of token ids (`text` as SGLang names it, `prompt` as vLLM does)."""
        request = await state.read_body(http, lambda body: parse_body(DetokenizeRequest, body))
        return await state.run_blocking(detokenize, state, request)

    return router
