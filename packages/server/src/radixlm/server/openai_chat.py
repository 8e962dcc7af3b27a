"""`POST /v1/chat/completions`: messages through the chat template (images and videos as the
model's placeholders, their URLs to the engine), constraints from response_format and
tool_choice, reasoning and tool calls parsed out of the output (streamed as deltas)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixlm.sampling import GenerateChunk, GenerateRequest, InvalidRequest
from radixlm.server.openai_common import (
    StreamUsage,
    chat_logprobs,
    new_tokens,
    new_tops,
    now,
    param_names,
    parse_body,
    requested_constraints,
    sampling_params,
    stream_events,
    usage,
)
from radixlm.server.openai_models import (
    MEDIA_PARTS,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    Tool,
)
from radixlm.server.pooling import refuse_generation
from radixlm.server.reasoning import ReasoningFormat, ReasoningStream, reasoning_format
from radixlm.server.state import ServedModel, ServerState, renamed_errors
from radixlm.server.streams import (
    EngineJSONResponse,
    EngineStreams,
    EventStreamResponse,
    cancel_on_disconnect,
)
from radixlm.server.tool_calls import ToolCallReader, tool_call_constraint


@dataclass
class ChatMedia:
    """The images and videos of a conversation in prompt order, each with the content part
    it came from (`messages.0.content.1`), so that the engine's errors about one name it."""

    urls: dict[str, list[str]] = field(default_factory=lambda: {"image": [], "video": []})
    parts: dict[str, list[str]] = field(default_factory=lambda: {"image": [], "video": []})

    def error_names(self) -> dict[str, str]:
        """The engine's names for the media -> the client's: `image_data` is the one image's
        part (`messages.0.content.1`), or `messages` when there are several; `image_data[i]`
        (radixlm's engine) and `image_data.i` name the i-th image's part."""
        names: dict[str, str] = {}
        for kind in ("image", "video"):
            parts = self.parts[kind]
            if parts:
                names[f"{kind}_data"] = parts[0] if len(parts) == 1 else "messages"
            for index, part in enumerate(parts):
                names[f"{kind}_data[{index}]"] = part
                names[f"{kind}_data.{index}"] = part
        return names


def _content_text(
    message: ChatMessage, where: str, tokens: dict[str, str | None], media: ChatMedia
) -> str | None:
    """The message's content as one string: the text parts joined, the model's placeholder
    (`image_token` / `video_token`) where each image or video sits, a line break between a
    placeholder and text that follows it directly; their URLs go to `media`.
    InvalidRequest naming the part when the model does not take its modality."""
    if not isinstance(message.content, list):
        return message.content
    pieces: list[str] = []
    after_media = False
    for index, part in enumerate(message.content):
        kind = MEDIA_PARTS.get(part.type)
        if kind is None:
            words = part.text or ""
            # A placeholder and the text right after it are on separate lines ("<image>\nWhat
            # is this?"), as LLaVA-style prompts write them (vLLM's rendering does the same).
            if after_media and words[:1] and not words[:1].isspace():
                words = "\n" + words
            pieces.append(words)
            after_media = False
            continue
        after_media = True
        field_name = f"{where}.content.{index}"
        token = tokens[kind]
        if token is None:
            raise InvalidRequest(
                field_name,
                f"this model does not take {kind}s (it names no {kind}_token); remove the "
                f"{part.type} part, or serve a model that takes {kind}s",
            )
        pieces.append(token)
        media.urls[kind].append(str(part.media_url))
        media.parts[kind].append(field_name)
    return "".join(pieces)


def _template_message(
    message: ChatMessage, where: str, tokens: dict[str, str | None], media: ChatMedia
) -> dict[str, Any]:
    """A message as chat templates expect it (content one string, tool-call arguments as
    objects)."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": _content_text(message, where, tokens, media),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments: Any = call.function.arguments
            if isinstance(arguments, str):
                with contextlib.suppress(json.JSONDecodeError):
                    arguments = json.loads(arguments)
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        out["tool_calls"] = calls
    return out


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str | None,
    template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a conversation; InvalidRequest when the template cannot render it."""
    if tokenizer is None:
        raise InvalidRequest(
            "messages", "this engine has no tokenizer to render chats; use /v1/completions"
        )
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "messages",
            "this model has no chat template; use /v1/completions, or start the server with "
            "--chat-template",
        )
    kwargs = dict(template_kwargs or {})
    if template is not None:
        kwargs["chat_template"] = template
    try:
        prompt = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as error:  # jinja2 errors, raise_exception() in templates, bad kwargs
        raise InvalidRequest(
            "messages", f"the chat template cannot render these messages: {error}"
        ) from None
    return str(prompt)


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered through the chat template, its tokens, and its images and
    videos (one placeholder each in the prompt, in order)."""

    text: str
    input_ids: list[int]
    media: ChatMedia = field(default_factory=ChatMedia)


def _offered_tools(request: ChatCompletionRequest) -> list[Tool] | None:
    """The tools the model is told about (none under tool_choice "none")."""
    return request.tools if request.effective_tool_choice != "none" else None


async def chat_prompt(state: ServerState, request: ChatCompletionRequest) -> ChatPrompt:
    """Render and tokenize the conversation in the server's thread pool (a long conversation
    takes long), after refusing one whose contents alone cannot fit in the context.

    Chat templates write each message's content in full, so the contents' total length is a
    lower bound on the prompt's. (A template that drops some, such as earlier turns' reasoning,
    is refused wrongly only when what it drops is itself longer than the bound: the context's
    size times the tokenizer's longest token, many times what real text needs.) The rendered
    prompt is checked again, exactly, before it is tokenized."""
    state.check_text_fits(sum(len(m.text() or "") for m in request.messages), "messages")
    tokenizer = state.engine.tokenizer
    tools = _offered_tools(request)
    tokens = state.media_tokens
    media = ChatMedia()
    messages = [
        _template_message(m, f"messages.{i}", tokens, media) for i, m in enumerate(request.messages)
    ]
    tool_specs = [t.model_dump(exclude_none=True) for t in tools] if tools else None

    def render() -> ChatPrompt:
        text = render_chat(
            tokenizer,
            messages,
            tool_specs,
            state.config.chat_template,
            request.chat_template_kwargs,
        )
        state.check_text_fits(text, "messages")
        return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)), media)

    return await state.run_blocking(render)


class _Chat:
    """One `/v1/chat/completions` call, on its rendered prompt."""

    def __init__(
        self,
        state: ServerState,
        request: ChatCompletionRequest,
        prompt: ChatPrompt,
        model: ServedModel,
    ) -> None:
        self.state = state
        self.request = request
        self.model = model
        #: Whether usage carries the cached prompt tokens (the Responses API's always does).
        self.report_cached = state.config.enable_cache_report
        self.id = state.new_id("chatcmpl-")
        self.created = now()
        choice = request.effective_tool_choice
        tools = _offered_tools(request)
        self.reader_mode: str | None = None
        self.function_name: str | None = None
        if tools:
            if isinstance(choice, NamedToolChoice):
                self.reader_mode, self.function_name = "named", choice.function.name
            elif choice == "required":
                self.reader_mode = "required"
            else:
                self.reader_mode = state.config.tool_call_parser
        # The output's reasoning section (None: no reasoning parser, or thinking disabled):
        # returned apart unless `separate_reasoning` is false, and left free by a constraint.
        reasoning = reasoning_format(
            state.config.reasoning_parser, prompt.text, request.chat_template_kwargs
        )
        self.reasoning: ReasoningFormat | None = reasoning if request.separate_reasoning else None
        self.constraint_param: str | None = None
        params = sampling_params(
            request,
            self.max_tokens_name,
            unset_max_tokens=None,  # until a stop or the context is full, as OpenAI's chat
            max_new_tokens=request.max_completion_tokens,
            json_schema=self._constraint(tools, choice),
        )
        self.media = prompt.media
        item = GenerateRequest.parse(
            {
                "input_ids": prompt.input_ids,
                "image_data": prompt.media.urls["image"] or None,
                "video_data": prompt.media.urls["video"] or None,
                "sampling_params": params,
                "rid": request.rid,
                "return_logprob": request.logprobs,
                "top_logprobs_num": request.top_logprobs or 0,
                "return_text_in_logprobs": True,
                "stream": request.stream,
                "custom_logit_processor": request.custom_logit_processor,
                "lora_path": model.lora,
                "priority": request.priority,
                "timeout": request.timeout,
                "bootstrap_host": request.bootstrap_host,
                "bootstrap_port": request.bootstrap_port,
                "bootstrap_room": request.bootstrap_room,
                # The constraint (response_format, tool_choice) shapes the answer, not the
                # reasoning: it applies after `</think>`.
                "require_reasoning": reasoning is not None,
            }
        )
        self.item = state.prepare(item)
        self.readers: dict[int, ToolCallReader] = {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}
        self.contents: dict[int, str] = {}  # streamed content so far, per choice

    @property
    def max_tokens_name(self) -> str:
        if self.request.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens"

    def param_names(self) -> dict[str, str]:
        """SamplingParams fields -> this request's fields (for errors)."""
        names = param_names(self.request, self.max_tokens_name, self.constraint_param)
        return {
            "text": "messages",
            "input_ids": "messages",
            **self.media.error_names(),
            **self.model.error_names(),
            **names,
        }

    def _constraint(self, tools: Any, choice: Any) -> str | None:
        """The constraint response_format or the tools set (json_schema text), or None."""
        request = self.request
        found: list[tuple[str, str | None]] = []
        if request.response_format is not None and request.response_format.type != "text":
            schema: Any = {"type": "object"}
            spec = request.response_format.json_schema
            if request.response_format.type == "json_schema" and spec and spec.schema_:
                schema = spec.schema_
            found.append(("response_format", json.dumps(schema)))
        tool_schema = (
            tool_call_constraint(tools, choice, request.parallel_tool_calls) if tools else None
        )
        if tool_schema is not None:
            found.append(("tool_choice", tool_schema))
        found += [(c.param, None) for c in requested_constraints(request)]
        if len(found) > 1:
            raise InvalidRequest(
                found[1][0],
                f"only one constraint may shape the output; got {', '.join(n for n, _ in found)}",
            )
        if not found or found[0][1] is None:
            return None  # the extras travel in their own fields
        self.constraint_param = found[0][0]
        return found[0][1]

    def reader(self, index: int) -> ToolCallReader | None:
        if self.reader_mode is None:
            return None
        if index not in self.readers:
            limit = None if self.request.parallel_tool_calls else 1
            self.readers[index] = ToolCallReader(self.reader_mode, self.function_name, limit)
        return self.readers[index]

    def logprobs(self, chunk: GenerateChunk, start: int, end: int) -> Any:
        if not self.request.logprobs:
            return None
        tokens = new_tokens(chunk, end, start)
        tops = new_tops(chunk, end, start)
        return chat_logprobs(tokens, tops, self.state.engine.tokenizer)

    def chunk(self, choices: list[dict[str, Any]], usage_value: Any = ...) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
        }
        if usage_value is not ...:
            body["usage"] = usage_value
        return body

    async def collect(self, streams: EngineStreams) -> dict[str, Any]:
        finals: dict[int, GenerateChunk] = {}
        try:
            await streams.start()
            async for _, chunk in streams:
                if chunk.finished:
                    finals[chunk.index] = chunk
        finally:
            await streams.aclose()
        choices = []
        completion = prompt = cached = 0
        for index in sorted(finals):
            chunk = finals[index]
            prompt, cached = chunk.prompt_tokens, chunk.cached_tokens
            completion += chunk.completion_tokens
            text = chunk.text
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning is not None:
                reasoning, text = self.reasoning.split(text)
                message["reasoning_content"] = reasoning or None
                message["content"] = text
            reason: str | None = chunk.finish_type
            reader = self.reader(index)
            if reader is not None:
                content, calls = reader.result(text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self.logprobs(chunk, 0, len(chunk.output_ids)),
                    "finish_reason": reason,
                }
            )
        reported = cached if self.report_cached else None
        body = self.chunk(choices, usage(prompt, completion, reported))
        body["object"] = "chat.completion"
        return body

    def choice_deltas(
        self, stream: int, chunk: GenerateChunk, tally: StreamUsage
    ) -> list[dict[str, Any]]:
        """The chunks' choices for one engine chunk of one choice."""
        index = chunk.index
        progress = tally.update(stream, index, chunk)
        text = chunk.text
        output_len = len(chunk.output_ids)
        reason: str | None = chunk.finish_type
        out: list[dict[str, Any]] = []
        if not progress.started:
            progress.started = True
            out.append(
                {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
            )  # fmt: skip
        delta: dict[str, Any] = {}
        fresh = text[progress.chars :]
        if self.reasoning is not None:
            parser = self.reasoning_streams.setdefault(index, self.reasoning.stream())
            thought, fresh = parser.feed(fresh, final=reason is not None)
            if thought:
                delta["reasoning_content"] = thought
        reader = self.reader(index)
        if reader is not None:
            self.contents[index] = self.contents.get(index, "") + fresh
            content, calls = reader.deltas(self.contents[index], final=reason is not None)
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
        elif fresh:
            delta["content"] = fresh
        logprobs = self.logprobs(chunk, progress.tokens, output_len)
        progress.chars = max(progress.chars, len(text))
        progress.tokens = max(progress.tokens, output_len)
        if delta or (logprobs and logprobs["content"]):
            out.append(
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            )
        if reason is not None:
            if reader is not None and reader.called and reason == "stop":
                reason = "tool_calls"
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out

    def events(self, streams: EngineStreams) -> AsyncIterator[str]:
        return stream_events(
            streams, self.request.stream_options, self.chunk, self.choice_deltas, self.report_cached
        )


async def create_chat_completion(state: ServerState, http: Request) -> Response:
    refuse_generation(state)
    request = await state.read_body(http, partial(parse_body, ChatCompletionRequest))
    model = state.check_model(request.model).with_lora_path(request.lora_path)
    with renamed_errors({"text": "messages", "input_ids": "messages", **param_names(request)}):
        call = _Chat(state, request, await chat_prompt(state, request), model)
    with renamed_errors(call.param_names()):
        streams = state.streams("/v1/chat/completions", [call.item])
        if request.stream:
            await cancel_on_disconnect(http, streams.start())
            return EventStreamResponse(call.events(streams))
        return EngineJSONResponse(await cancel_on_disconnect(http, call.collect(streams)))
