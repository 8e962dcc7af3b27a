"""The `POST /v1/responses` request body (OpenAI's Responses API) as pydantic models.

Top-level fields are checked strictly (an unknown field is a 400 naming it). Input items ignore
keys they do not use (`id`, `status`, `annotations`), so output items can be sent back as input.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from radixlm.sampling import InvalidRequest

_TEXT_PARTS = ("input_text", "output_text", "text")


class InputPart(BaseModel):
    """One content part of a message: text only (`input_text` / `output_text`)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> InputPart:
        if self.type not in _TEXT_PARTS:
            raise ValueError(
                f"content parts of type {self.type!r} are not supported by this server; "
                "send input_text parts only"
            )
        if self.text is None:
            raise ValueError(f"an {self.type} part needs text")
        return self


_PARTS = TypeAdapter(list[InputPart])


def _parts_first(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a list as parts alone (so its errors are not buried under "not a string")."""
    return _PARTS.validate_python(value) if isinstance(value, list) else handler(value)


def _joined(content: str | list[InputPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content)


class MessageItem(BaseModel):
    """`{"role", "content"}` (optionally `"type": "message"`): a turn of the conversation."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]

    _content = field_validator("content", mode="wrap")(_parts_first)

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(BaseModel):
    """A function call the model made (an output item sent back as input)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(BaseModel):
    """The result of a function call, matched to it by `call_id`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputPart]

    _output = field_validator("output", mode="wrap")(_parts_first)

    def text(self) -> str:
        return _joined(self.output)


class ReasoningItem(BaseModel):
    """A reasoning output item sent back as input: accepted and left out of the prompt."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


_ITEM_MODELS: dict[str, type[BaseModel]] = {
    "reasoning": ReasoningItem,
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def _parse_item(index: int, value: Any) -> BaseModel:
    """One input item by its `type` (a message when it has none); InvalidRequest otherwise."""
    if isinstance(value, BaseModel):
        return value
    kind = value.get("type", "message") if isinstance(value, dict) else None
    model = _ITEM_MODELS.get(str(kind))
    if model is None:
        what = (
            f"of type {kind!r}" if isinstance(value, dict) else f"that are {type(value).__name__}"
        )
        raise InvalidRequest(
            f"{index}",
            f"input items {what} are not supported by this server; send messages, "
            "function_call and function_call_output items",
        )
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise InvalidRequest.from_validation_error(error, prefix=str(index)) from None


#: An item of a conversation as this server keeps it (and as `input` lists them).
ConversationItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(BaseModel):
    """A function the model may call, in the Responses API's flat shape."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        kind = value.get("type", "function") if isinstance(value, dict) else "function"
        if kind != "function":
            raise InvalidRequest(
                "type",
                f"built-in tools ({kind!r}) are not available on this server; "
                "only function tools are",
            )
        return value


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise InvalidRequest("schema", "type json_schema needs a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, ignored


# Sent by OpenAI clients and refused when set (this server cannot honour them).
UNSUPPORTED_RESPONSES_FIELDS = ("conversation", "prompt", "max_tool_calls", "stream_options")


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`: OpenAI's Responses API over the chat template.

    Supported: `input` as a string or a list of message, `function_call` and
    `function_call_output` items (text content only); `instructions` (a system message first,
    not carried over by `previous_response_id`); `max_output_tokens`, `temperature`, `top_p`;
    `text.format` (`text`, `json_object`, `json_schema`, enforced by constrained decoding);
    function `tools` with `tool_choice` and `parallel_tool_calls`; `stream` (Responses'
    server-sent events); `previous_response_id` and `store` over an in-memory store of the
    latest responses (see `GET /v1/responses/{response_id}`).

    Not supported: built-in tools (web_search, file_search, code_interpreter, MCP, ...),
    `background` mode, `conversation`, prompt templates, images and files. `include`,
    `reasoning`, `truncation`, `service_tier` and prompt-cache fields are accepted and ignored.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[ConversationItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = Field(default=None, description="refused when true")

    include: Any = Field(default=None, description="accepted and ignored")
    reasoning: Any = Field(default=None, description="accepted and ignored")
    service_tier: Any = Field(default=None, description="accepted and ignored")
    safety_identifier: Any = Field(default=None, description="accepted and ignored")
    prompt_cache_key: Any = Field(default=None, description="accepted and ignored")
    prompt_cache_retention: Any = Field(default=None, description="accepted and ignored")
    truncation: Any = Field(default=None, description="accepted and ignored")

    conversation: Any = Field(default=None, description="not supported: refused when set")
    prompt: Any = Field(default=None, description="not supported: refused when set")
    max_tool_calls: Any = Field(default=None, description="not supported: refused when set")
    stream_options: Any = Field(default=None, description="not supported: refused when set")

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list):  # item by item, so errors name the item's own fields
            return [_parse_item(i, item) for i, item in enumerate(value)]
        return handler(value)

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        for name in UNSUPPORTED_RESPONSES_FIELDS:
            if getattr(self, name) is not None:
                raise InvalidRequest(name, "is not supported by this server; omit it")
        if self.background:
            raise InvalidRequest("background", "background mode is not supported; omit it")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise InvalidRequest("input", "must not be empty")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequest("tool_choice", "needs tools; list the tools that may be called")
        if isinstance(self.tool_choice, FunctionToolChoice):
            names = [tool.name for tool in self.tools or []]
            if self.tool_choice.name not in names:
                raise InvalidRequest(
                    "tool_choice",
                    f"names {self.tool_choice.name!r}, which is not among the tools "
                    f"({', '.join(names)})",
                )
        return self

    def items(self) -> list[ConversationItem]:
        """`input` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
