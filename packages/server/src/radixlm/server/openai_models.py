"""The OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) as pydantic models.

Top-level fields are checked strictly (an unknown field is a 400 naming it). The SGLang / vLLM
extras that `extra_body` sends (top_k, min_p, regex, json_schema, ...) are fields here too.
Messages ignore unknown keys, so a response message can be sent back as it came; their content
is a string or a list of text, `image_url` and `video_url` parts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from radixlm.sampling import InvalidRequest, RepetitionDetection


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: one constraint, named by its key."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by both routes that map onto `radixlm.sampling.SamplingParams`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    # OpenAI sampling fields (None: not sent, so the engine's defaults apply).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    # SGLang / vLLM extras, as extra_body sends them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    repetition_detection: RepetitionDetection | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    strict_constraint: bool | None = None
    thinking_token_budget: int | None = None
    custom_params: dict[str, Any] | None = None
    custom_logit_processor: str | None = None
    rid: str | None = None
    #: SGLang's field: the LoRA adapter to answer with (or name it in `model`).
    lora_path: str | None = None
    #: vLLM's and SGLang's field (the server must run with --enable-priority-scheduling).
    priority: int | None = None
    #: Seconds the request may take; past them it ends with finish reason abort.
    timeout: float | None = None
    #: SGLang's prefill/decode disaggregation fields, which a router sets identically on the
    #: requests it sends a prefill and a decode server: the prefill server's bootstrap
    #: endpoint and the room pairing the two halves (completions: one room per prompt).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | list[int] | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1; got {value}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options", "is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's beam search: beam_width is best_of (or n); the n best beams come back.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be empty")
            if any(isinstance(item, list) and not item for item in value):
                raise ValueError("a token-id prompt must hold at least one id")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"must be in [0, 20]; got {value}")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise InvalidRequest("suffix", "is not supported (no fill-in-the-middle); omit it")
        if self.use_beam_search:
            return self._beam_search_options()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of", "is not supported unless equal to n; omit it")
        return self

    def _beam_search_options(self) -> CompletionRequest:
        if self.stream:
            raise InvalidRequest("stream", "is not supported with beam search; set it to false")
        if self.logprobs is not None:
            raise InvalidRequest("logprobs", "is not supported with beam search; omit it")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(
                "best_of", f"is the beam width and must be at least n ({self.n}); raise it"
            )
        return self


class MediaURL(BaseModel):
    """Where an image or video is: an `http(s)` URL, a `data:` URL, or what else the engine
    takes (a path under its allowed directory, base64). `detail` is OpenAI's image detail,
    accepted and ignored (the model's processor decides the resolution)."""

    model_config = ConfigDict(extra="ignore")

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


#: Content part type -> the modality it carries.
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}


class ContentPart(BaseModel):
    """One part of a message's content: `text`, an image (`image_url`) or a video
    (`video_url`); the media URL as an object or, as some clients send it, a bare string."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    image_url: MediaURL | None = None
    video_url: MediaURL | None = None

    @field_validator("image_url", "video_url", mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _known_type(self) -> ContentPart:
        if self.type == "text":
            if self.text is None:
                raise ValueError("a text content part needs text")
        elif self.type in MEDIA_PARTS:
            if getattr(self, self.type) is None:
                raise ValueError(f"a content part of type {self.type} needs {self.type}.url")
        elif self.type == "input_audio":
            raise ValueError(
                "audio input is not supported yet; send text, image_url or video_url parts"
            )
        else:
            raise ValueError(
                f"content parts of type {self.type!r} are not supported by this server; "
                "send text, image_url or video_url parts"
            )
        return self

    @property
    def media_url(self) -> str | None:
        """The URL of an image or video part; None for text."""
        media = getattr(self, self.type) if self.type in MEDIA_PARTS else None
        return media.url if isinstance(media, MediaURL) else None


_CONTENT_PARTS = TypeAdapter(list[ContentPart])


def _parts_first(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a list as parts alone (so its errors are not buried under "not a string")."""
    return _CONTENT_PARTS.validate_python(value) if isinstance(value, list) else handler(value)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message; unknown keys (refusal, annotations, ...) are ignored. Images and videos
    may only sit in user messages, as in OpenAI's API."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    _content_parts = field_validator("content", mode="wrap")(_parts_first)

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.role != "user":
            for index, part in enumerate(self.content if isinstance(self.content, list) else []):
                if part.type in MEDIA_PARTS:
                    raise InvalidRequest(
                        f"content.{index}",
                        f"{part.type} parts are only taken in user messages, not in a "
                        f"{self.role} message; move the {MEDIA_PARTS[part.type]} to a user message",
                    )
        return self

    def text(self) -> str | None:
        """The text parts joined (images and videos left out); None without content."""
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return self


# Sent by OpenAI clients, accepted, and ignored.
IGNORED_CHAT_FIELDS = (
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "reasoning_effort",
    "verbosity",
)
# Sent by OpenAI clients and refused when set (this server cannot honour them).
UNSUPPORTED_CHAT_FIELDS = (
    "audio",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "moderation",
)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: with --reasoning-parser, return the reasoning apart as reasoning_content.
    separate_reasoning: bool = True
    modalities: list[str] | None = None
    #: One conversation, one room (prefill/decode disaggregation).
    bootstrap_room: int | None = None

    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"must be in [0, 20]; got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        for name in UNSUPPORTED_CHAT_FIELDS:
            if getattr(self, name) is not None:
                hint = "; use tools and tool_choice" if name.startswith("function") else ""
                raise InvalidRequest(name, f"is not supported by this server{hint}")
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequest("modalities", "only ['text'] is supported")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest(
                "max_completion_tokens",
                "give max_completion_tokens or max_tokens, not both with different values",
            )
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequest("tool_choice", "needs tools; list the tools that may be called")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise InvalidRequest(
                    "tool_choice",
                    f"names {self.tool_choice.function.name!r}, which is not among the tools "
                    f"({', '.join(names)})",
                )
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """`tool_choice` with OpenAI's default: auto when tools are given, else none."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice
