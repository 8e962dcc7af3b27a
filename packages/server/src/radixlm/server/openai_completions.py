"""`POST /v1/completions`: prompts (text, lists, token ids) to engine requests and back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixlm.sampling import GenerateChunk, GenerateRequest, InvalidRequest
from radixlm.server.openai_common import (
    StreamUsage,
    completion_logprobs,
    new_tokens,
    new_tops,
    now,
    param_names,
    parse_body,
    sampling_params,
    stream_events,
    usage,
)
from radixlm.server.openai_models import CompletionRequest
from radixlm.server.pooling import refuse_generation
from radixlm.server.state import ServedModel, ServerState, renamed_errors
from radixlm.server.streams import (
    EngineJSONResponse,
    EngineStreams,
    EventStreamResponse,
    cancel_on_disconnect,
)

Prompt = tuple[str | None, list[int] | None]
#: max_tokens when a request sends none: OpenAI's legacy completions default (SGLang's too).
DEFAULT_MAX_TOKENS = 16


def _prompts(request: CompletionRequest) -> list[Prompt]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [(prompt, None)]
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]  # type: ignore[arg-type]
    return [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]  # type: ignore[arg-type]


class _Completion:
    """One `/v1/completions` call: its engine requests and how their chunks become choices."""

    def __init__(self, state: ServerState, request: CompletionRequest, model: ServedModel) -> None:
        self.state = state
        self.request = request
        self.model = model
        self.report_cached = state.config.enable_cache_report
        self.id = state.new_id("cmpl-")
        self.created = now()
        self.prompts = _prompts(request)
        self.n = request.n
        params = sampling_params(request, unset_max_tokens=DEFAULT_MAX_TOKENS)
        logprobs = request.logprobs
        self.items: list[GenerateRequest] = []
        rooms = _bootstrap_rooms(request, len(self.prompts))
        for i, (text, ids) in enumerate(self.prompts):
            rid = request.rid if request.rid and len(self.prompts) == 1 else None
            if request.rid and len(self.prompts) > 1:
                rid = f"{request.rid}-{i}"
            item = GenerateRequest.parse(
                {
                    "text": text,
                    "input_ids": ids,
                    "sampling_params": params,
                    "rid": rid,
                    "return_logprob": logprobs is not None,
                    "top_logprobs_num": logprobs or 0,
                    "logprob_start_len": 0 if request.echo and logprobs is not None else -1,
                    "return_text_in_logprobs": True,
                    "stream": request.stream,
                    "custom_logit_processor": request.custom_logit_processor,
                    "lora_path": model.lora,
                    "priority": request.priority,
                    "timeout": request.timeout,
                    "bootstrap_host": request.bootstrap_host,
                    "bootstrap_port": request.bootstrap_port,
                    "bootstrap_room": rooms[i],
                }
            )
            self.items.append(state.prepare(item))

    def prompt_text(self, stream: int) -> str:
        text, ids = self.prompts[stream]
        return text if text is not None else str(self.state.engine.tokenizer.decode(ids))

    def choice_index(self, stream: int, chunk: GenerateChunk) -> int:
        return stream * self.n + chunk.index

    def logprobs(self, chunk: GenerateChunk, start: int, count: int, offset: int) -> Any:
        """Logprobs of output tokens [start, start+count), plus the prompt's when echoing."""
        if self.request.logprobs is None:
            return None
        tokenizer = self.state.engine.tokenizer
        tokens = new_tokens(chunk, start + count, start)
        tops = new_tops(chunk, start + count, start)
        if self.request.echo and start == 0:
            tokens = list(chunk.input_token_logprobs or ()) + tokens
            tops = list(chunk.input_top_logprobs or ()) + tops
        return completion_logprobs(tokens, tops, tokenizer, offset)

    def chunk(self, choices: list[dict[str, Any]], usage_value: Any = ...) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
        }
        if usage_value is not ...:
            body["usage"] = usage_value
        return body

    async def collect(self, streams: EngineStreams) -> dict[str, Any]:
        finals: dict[int, tuple[int, GenerateChunk]] = {}
        try:
            await streams.start()
            async for stream, chunk in streams:
                if chunk.finished:
                    finals[self.choice_index(stream, chunk)] = (stream, chunk)
        finally:
            await streams.aclose()
        choices = []
        prompt_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}
        completion = 0
        for index in sorted(finals):
            stream, chunk = finals[index]
            prompt_tokens[stream] = chunk.prompt_tokens
            cached[stream] = chunk.cached_tokens
            completion += chunk.completion_tokens
            prefix = self.prompt_text(stream) if self.request.echo else ""
            choices.append(
                {
                    "index": index,
                    "text": prefix + chunk.text,
                    "logprobs": self.logprobs(chunk, 0, len(chunk.output_ids), 0),
                    "finish_reason": chunk.finish_type,
                }
            )
        reported = sum(cached.values()) if self.report_cached else None
        return self.chunk(choices, usage(sum(prompt_tokens.values()), completion, reported))

    def choice_deltas(
        self, stream: int, chunk: GenerateChunk, tally: StreamUsage
    ) -> list[dict[str, Any]]:
        """The choice to send for one engine chunk of one prompt (none when nothing is new)."""
        index = self.choice_index(stream, chunk)
        progress = tally.update(stream, index, chunk)
        text = chunk.text
        output_len = len(chunk.output_ids)
        delta = text[progress.chars :]
        offset = progress.chars
        if not progress.started and self.request.echo:
            delta = self.prompt_text(stream) + delta
            offset = 0
        count = output_len - progress.tokens
        logprobs = self.logprobs(chunk, progress.tokens, count, offset)
        reason = chunk.finish_type
        out: list[dict[str, Any]] = []
        if delta or count > 0 or reason is not None or not progress.started:
            out.append(
                {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
            )
        progress.started = True
        progress.chars = max(progress.chars, len(text))
        progress.tokens = max(progress.tokens, output_len)
        return out

    def events(self, streams: EngineStreams) -> AsyncIterator[str]:
        return stream_events(
            streams, self.request.stream_options, self.chunk, self.choice_deltas, self.report_cached
        )

    async def beam_search(self) -> dict[str, Any]:
        """The response of a `use_beam_search` call: per prompt, the n best of `best_of` (or n)
        beams, best first, from the engine's optional `beam_search` coroutine."""
        search = getattr(self.state.engine, "beam_search", None)
        if search is None:
            raise InvalidRequest("use_beam_search", "this engine does not support beam search")
        request = self.request
        width = request.best_of or request.n
        tasks = [
            asyncio.ensure_future(
                search(
                    item,
                    width,
                    length_penalty=request.length_penalty,
                    early_stopping=request.early_stopping,
                )
            )
            for item in self.items
        ]
        try:
            beams: list[list[GenerateChunk]] = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one prompt failed: stop the others' searches too
                task.cancel()
            raise
        choices = []
        prompt_tokens = cached = completion = 0
        for stream, results in enumerate(beams):
            prefix = self.prompt_text(stream) if request.echo else ""
            for rank, result in enumerate(results[: self.n]):
                completion += result.completion_tokens
                choices.append(
                    {
                        "index": stream * self.n + rank,
                        "text": prefix + result.text,
                        "logprobs": None,
                        "finish_reason": result.finish_type,
                    }
                )
            if results:
                prompt_tokens += results[0].prompt_tokens
                cached += results[0].cached_tokens
        reported = cached if self.report_cached else None
        return self.chunk(choices, usage(prompt_tokens, completion, reported))


async def create_completion(state: ServerState, http: Request) -> Response:
    refuse_generation(state)
    request = await state.read_body(http, partial(parse_body, CompletionRequest))
    model = state.check_model(request.model).with_lora_path(request.lora_path)
    names = {"text": "prompt", "input_ids": "prompt", **model.error_names(), **param_names(request)}
    with renamed_errors(names):
        call = _Completion(state, request, model)
        if request.use_beam_search:
            return EngineJSONResponse(await cancel_on_disconnect(http, call.beam_search()))
        streams = state.streams("/v1/completions", call.items)
        if request.stream:
            await cancel_on_disconnect(http, streams.start())
            return EventStreamResponse(call.events(streams))
        return EngineJSONResponse(await cancel_on_disconnect(http, call.collect(streams)))


def _bootstrap_rooms(request: CompletionRequest, prompts: int) -> list[int | None]:
    """Each prompt's `bootstrap_room` (prefill/decode disaggregation): one room pairs one
    prompt's halves, so several prompts take a list of rooms, one each."""
    room = request.bootstrap_room
    if room is None:
        return [None] * prompts
    if isinstance(room, int):
        if prompts > 1:
            raise InvalidRequest(
                "bootstrap_room", f"{prompts} prompts take a list of {prompts} distinct rooms"
            )
        return [room]
    if len(room) != prompts:
        raise InvalidRequest(
            "bootstrap_room", f"has {len(room)} rooms but the request has {prompts} prompts"
        )
    return list(room)
