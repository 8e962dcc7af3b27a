"""`POST /v1/responses` (OpenAI's Responses API) on the chat route's machinery: input items become
chat messages, the chat answer becomes output items (streamed as Responses events), and stored
responses continue a conversation through `previous_response_id`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixlm.sampling import InvalidRequest
from radixlm.server.errors import APIError, as_api_error
from radixlm.server.openai_chat import _Chat, chat_prompt
from radixlm.server.openai_common import StreamUsage, now, parse_body
from radixlm.server.openai_models import ChatCompletionRequest
from radixlm.server.openai_responses_models import (
    ConversationItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ResponsesRequest,
)
from radixlm.server.pooling import refuse_generation
from radixlm.server.response_store import StoredResponse
from radixlm.server.state import ServedModel, ServerState
from radixlm.server.streams import (
    EngineJSONResponse,
    EngineStreams,
    EventStreamResponse,
    cancel_on_disconnect,
    sse,
)

ROUTE = "/v1/responses"

# Fields the chat machinery names in its errors -> the Responses field the client sent.
_FIELD_NAMES = {
    "messages": "input",
    "text": "input",
    "input_ids": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "lora_path": "model",  # an adapter the engine no longer has (unloaded meanwhile)
}


def _renamed(error: InvalidRequest) -> InvalidRequest:
    """`error` about the Responses fields the client sent (its field and the names it cites)."""
    head, _, rest = error.field.partition(".")
    field = (
        _FIELD_NAMES[head] + (f".{rest}" if rest else "") if head in _FIELD_NAMES else error.field
    )
    message = error.message
    for chat_name in ("max_completion_tokens", "response_format"):
        message = message.replace(chat_name, _FIELD_NAMES[chat_name])
    if (field, message) == (error.field, error.message):
        return error
    return InvalidRequest(field, message)


def chat_messages(items: list[ConversationItem], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as chat messages: `instructions` first (as a system message); function
    calls join the assistant turn before them; function outputs are tool messages."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def chat_request(request: ResponsesRequest, items: list[ConversationItem]) -> ChatCompletionRequest:
    """The chat completion that answers `request` given the whole conversation `items`."""
    body: dict[str, Any] = {
        "messages": chat_messages(items, request.instructions),
        "parallel_tool_calls": request.parallel_tool_calls,
        "stream": request.stream,
    }
    for name, value in (
        ("max_completion_tokens", request.max_output_tokens),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("user", request.user),
    ):
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type == "json_schema":
        spec = {"name": text_format.name or "response", "schema": text_format.schema_}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif text_format is not None:
        body["response_format"] = {"type": text_format.type}
    try:
        return parse_body(ChatCompletionRequest, body)
    except InvalidRequest as error:
        raise _renamed(error) from None


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    prompt = int(chat_usage.get("prompt_tokens", 0))
    completion = int(chat_usage.get("completion_tokens", 0))
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def as_input_item(item: dict[str, Any]) -> ConversationItem | None:
    """An output item as the input item that replays it (None for reasoning)."""
    if item["type"] == "message":
        return MessageItem(role="assistant", content="".join(p["text"] for p in item["content"]))
    if item["type"] == "function_call":
        return FunctionCallItem(
            type="function_call",
            call_id=item["call_id"],
            name=item["name"],
            arguments=item["arguments"],
        )
    return None


class _Turn:
    """One `/v1/responses` call: the conversation so far, the chat call that answers it, and
    the response object built from the answer. Start one with `await _Turn.start(...)`."""

    def __init__(
        self,
        state: ServerState,
        request: ResponsesRequest,
        conversation: tuple[ConversationItem, ...],
        chat: _Chat,
    ) -> None:
        self.state = state
        self.request = request
        self.id = state.new_id("resp_")
        self.created_at = now()
        self.conversation = conversation
        self.chat = chat

    @classmethod
    async def start(
        cls, state: ServerState, request: ResponsesRequest, model: ServedModel
    ) -> _Turn:
        """The turn that answers `request` with `model` after the stored conversation it
        continues (404 when that is gone), its prompt rendered and tokenized."""
        earlier: tuple[ConversationItem, ...] = ()
        if request.previous_response_id is not None:
            previous = state.responses.get(request.previous_response_id)
            if previous is None:
                raise APIError(
                    404,
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            earlier = previous.conversation
        conversation = (*earlier, *request.items())
        try:
            chat_call = chat_request(request, list(conversation))
            chat = _Chat(state, chat_call, await chat_prompt(state, chat_call), model)
            chat.report_cached = True  # input_tokens_details is part of the Responses usage
        except InvalidRequest as error:
            raise _renamed(error) from None
        return cls(state, request, conversation, chat)

    def new_item_id(self, prefix: str) -> str:
        return f"{prefix}_{self.state.new_id('')}"

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object (OpenAI's `Response`) in the given state."""
        request = self.request
        text_format = request.text.format if request.text else None
        choice: Any = request.tool_choice or "auto"
        if isinstance(choice, FunctionToolChoice):
            choice = choice.model_dump()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.chat.model.name,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": None,
            "store": request.store,
            "temperature": request.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format is not None
                else {"type": "text"}
            },
            "tool_choice": choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def finish(self, status: str, output: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        """The final response object; kept in the store when the request asked for it."""
        body = self.body(status, output, _usage(usage))
        if self.request.store:
            replay = [as_input_item(item) for item in output]
            conversation = (*self.conversation, *(i for i in replay if i is not None))
            self.state.responses.put(self.id, StoredResponse(body, conversation))
        return body

    async def collect(self, streams: EngineStreams) -> dict[str, Any]:
        answer = await self.chat.collect(streams)
        choice = answer["choices"][0]
        message = choice["message"]
        incomplete = choice["finish_reason"] == "length"
        item_status = "incomplete" if incomplete else "completed"
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            part = {"type": "reasoning_text", "text": message["reasoning_content"]}
            output.append(
                {"type": "reasoning", "id": self.new_item_id("rs"), "summary": [],
                 "content": [part], "status": item_status}
            )  # fmt: skip
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(
                {"type": "message", "id": self.new_item_id("msg"), "status": item_status,
                 "role": "assistant", "content": [_text_part(message.get("content") or "")]}
            )  # fmt: skip
        for call in calls:
            output.append(
                {"type": "function_call", "id": self.new_item_id("fc"), "call_id": call["id"],
                 "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                 "status": "completed"}
            )  # fmt: skip
        return self.finish("incomplete" if incomplete else "completed", output, answer["usage"])

    def events(self, streams: EngineStreams) -> AsyncIterator[str]:
        return _ResponseEvents(self).run(streams)


class _ResponseEvents:
    """The Responses event stream of one turn: each chat delta opens, extends or closes an
    output item (reasoning, message, function call), so the items stream in order."""

    def __init__(self, turn: _Turn) -> None:
        self.turn = turn
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: int | None = None  # the output index of the item still being written
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.incomplete = False

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n{sse(payload)}"

    def add(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.output.append(item)
        self.open = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=self.open, item=item))
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        elif item["type"] == "message":
            part = _text_part("")
        else:
            return out
        out.append(
            self.event("response.content_part.added", item_id=item["id"], output_index=self.open,
                       content_index=0, part=part)
        )  # fmt: skip
        item["content"] = [dict(part)]
        return out

    def close(self) -> list[str]:
        """The events that finish the open item, if any."""
        if self.open is None:
            return []
        index, item, self.open = self.open, self.output[self.open], None
        where = {"item_id": item["id"], "output_index": index}
        out: list[str] = []
        if item["type"] == "function_call":
            out.append(
                self.event("response.function_call_arguments.done", **where,
                           arguments=item["arguments"])
            )  # fmt: skip
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
            out.append(
                self.event(f"response.{kind}.done", **where, content_index=0, text=part["text"],
                           **extra)
            )  # fmt: skip
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))  # fmt: skip
        item["status"] = "incomplete" if self.incomplete else "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def message(self) -> dict[str, Any]:
        return {"type": "message", "id": self.turn.new_item_id("msg"), "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip

    def text(self, kind: str, delta: str) -> list[str]:
        """Text for the open item of type `kind` (a new one if another kind is open)."""
        out: list[str] = []
        if self.open is None or self.output[self.open]["type"] != kind:
            if kind == "message":
                out += self.add(self.message())
            else:
                out += self.add({"type": "reasoning", "id": self.turn.new_item_id("rs"),
                                 "summary": [], "content": [], "status": "in_progress"})  # fmt: skip
        assert self.open is not None
        item = self.output[self.open]
        item["content"][0]["text"] += delta
        event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(
            self.event(event, item_id=item["id"], output_index=self.open, content_index=0,
                       delta=delta, **extra)
        )  # fmt: skip
        return out

    def tool_call(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        function = delta.get("function") or {}
        if "id" in delta:
            item = {"type": "function_call", "id": self.turn.new_item_id("fc"),
                    "call_id": delta["id"], "name": function.get("name", ""), "arguments": "",
                    "status": "in_progress"}  # fmt: skip
            out += self.add(item)
            self.calls[int(delta["index"])] = len(self.output) - 1
        arguments = function.get("arguments")
        index = self.calls.get(int(delta["index"]))
        if arguments and index is not None:
            item = self.output[index]
            item["arguments"] += arguments
            out.append(
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=arguments)
            )  # fmt: skip
        return out

    def choice(self, choice: dict[str, Any]) -> list[str]:
        delta = choice.get("delta") or {}
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self.text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self.text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self.tool_call(call)
        if choice.get("finish_reason") == "length":
            self.incomplete = True
        return out

    async def run(self, streams: EngineStreams) -> AsyncIterator[str]:
        turn = self.turn
        created = turn.body("in_progress", [])
        yield self.event("response.created", response=created)
        yield self.event("response.in_progress", response=created)
        tally = StreamUsage()
        try:
            async for stream, chunk in streams:
                for choice in turn.chat.choice_deltas(stream, chunk, tally):
                    for event in self.choice(choice):
                        yield event
            if not self.output:  # an empty answer is an empty message, as when not streamed
                for event in self.add(self.message()):
                    yield event
            for event in self.close():
                yield event
            status = "incomplete" if self.incomplete else "completed"
            body = turn.finish(status, self.output, tally.summary())
            yield self.event(f"response.{status}", response=body)
        except Exception as error:
            api = as_api_error(error) or APIError(500, f"engine error: {error}")
            yield self.event("error", code=str(api.code or api.status), message=api.message,
                             param=api.param)  # fmt: skip
            failure = {"code": "server_error", "message": api.message}
            yield self.event("response.failed", response=turn.body("failed", self.output, None,
                                                                   failure))  # fmt: skip
        finally:
            await streams.aclose()


async def create_response(state: ServerState, http: Request) -> Response:
    refuse_generation(state)
    request = await state.read_body(http, partial(parse_body, ResponsesRequest))
    turn = await _Turn.start(state, request, state.check_model(request.model))
    try:
        streams = state.streams(ROUTE, [turn.chat.item])
        if request.stream:
            await cancel_on_disconnect(http, streams.start())
            return EventStreamResponse(turn.events(streams))
        return EngineJSONResponse(await cancel_on_disconnect(http, turn.collect(streams)))
    except InvalidRequest as error:
        raise _renamed(error) from None


def stored_response(state: ServerState, response_id: str) -> dict[str, Any]:
    """A stored response's body; 404 when it was never stored or has been dropped."""
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")  # fmt: skip
    return entry.body


def delete_response(state: ServerState, response_id: str) -> dict[str, Any]:
    stored_response(state, response_id)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
