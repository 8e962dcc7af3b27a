"""GenerateRequest: the body of SGLang's native `/generate`, single or batch, and its split."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from radixlm.sampling.errors import InvalidRequest
from radixlm.sampling.params import SamplingParams

# An image or audio item: a path, URL, base64 string or raw bytes, or a dict (processor output).
MediaItem = str | bytes | dict[str, Any]

# Fields that may hold one value for the whole batch or a list with one value per item.
_PER_ITEM_SCALARS = (
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "lora_path",
    "custom_logit_processor",
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "priority",
    "timeout",
    "require_reasoning",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)
# Fields whose single-request value is itself a list, so only a list of lists is per-item.
_PER_ITEM_LISTS = ("token_ids_logprob",)
# Media: in a batch, a list with one entry per item (each entry one item or a list of items).
_PER_ITEM_MEDIA = ("image_data", "video_data", "audio_data")


class GenerateRequest(BaseModel):
    """SGLang's `/generate` body.

    Exactly one of `text`, `input_ids` and `input_embeds` is given. A list of prompts (or a list
    of id lists, or a 3-D embeds list) makes a batch: then every per-request field holds either
    one value for all items or a list with one value per item. `split()` returns one single
    request per item. Build with `GenerateRequest.parse(body)` to get InvalidRequest on bad input.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: list[list[float]] | list[list[list[float]]] | None = None
    image_data: MediaItem | list[MediaItem | list[MediaItem] | None] | None = None
    #: Videos (Qwen2-VL): per video a file path / URL / base64 string, or a list of frames.
    video_data: MediaItem | list[MediaItem | list[MediaItem] | None] | None = None
    audio_data: MediaItem | list[MediaItem | list[MediaItem] | None] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool | list[bool] = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    return_hidden_states: bool | list[bool] = False
    #: Mixture-of-experts models: return the experts each token was routed to (the engine
    #: must run with `enable_return_routed_experts`), from prompt position
    #: `routed_experts_start_len` on.
    return_routed_experts: bool | list[bool] = False
    routed_experts_start_len: int | list[int] = 0
    #: Scheduling priority (the engine must run with `enable_priority_scheduling`): by
    #: default a larger value runs first (`schedule_low_priority_values_first` reverses it);
    #: None is the engine's default priority, 0.
    priority: int | list[int | None] | None = None
    #: Seconds the request may take from its arrival; past it the request ends with
    #: finish reason abort (what it generated is kept). None: no limit.
    timeout: float | list[float | None] | None = None
    #: SGLang's: the model reasons (`<think>...</think>`) before its answer, so a
    #: structured-output constraint applies only after `</think>` (the reasoning is free).
    #: The chat API sets it itself when the server has a reasoning parser.
    require_reasoning: bool | list[bool] = False
    #: Prefill/decode disaggregation (SGLang's fields; only for a server started with
    #: `--disaggregation-mode prefill` or `decode`): a router sends the same values to the
    #: prefill server and to the decode server. `bootstrap_host:bootstrap_port` is the
    #: prefill server's bootstrap endpoint, `bootstrap_room` a random id in [0, 2**63) that
    #: pairs the two halves of the request (a batch takes a list of distinct rooms).
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> GenerateRequest:
        """Validate a JSON body; raises InvalidRequest naming the field."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as error:
            raise InvalidRequest.from_validation_error(error) from None

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _parse_sampling_params(cls, value: Any) -> Any:
        # Parse here so errors name `sampling_params.<field>` (or `sampling_params.<i>.<field>`).
        if isinstance(value, Mapping):
            return SamplingParams.parse(value)
        if isinstance(value, list):
            return [
                SamplingParams.parse(v, field_prefix=str(i)) if isinstance(v, Mapping) else v
                for i, v in enumerate(value)
            ]
        return value

    @model_validator(mode="after")
    def _shape(self) -> GenerateRequest:
        given = [n for n in ("text", "input_ids", "input_embeds") if getattr(self, n) is not None]
        if not given:
            raise InvalidRequest(
                "text", "give the prompt as one of text, input_ids or input_embeds"
            )
        if len(given) > 1:
            raise InvalidRequest(given[1], f"give only one of {', '.join(given)}")
        size = self.batch_size
        if size == 0:
            raise InvalidRequest(given[0], "the batch is empty; give at least one prompt")
        for ids in self._id_lists():
            if not ids:
                raise InvalidRequest("input_ids", "a prompt must hold at least one token id")
            if min(ids) < 0:
                raise InvalidRequest("input_ids", "token ids must be >= 0")
        timeouts = self.timeout if isinstance(self.timeout, list) else [self.timeout]
        if any(value is not None and not value > 0 for value in timeouts):
            raise InvalidRequest("timeout", "must be a number of seconds > 0 (or null: no limit)")
        self._check_bootstrap()
        for name in ("logprob_start_len", "top_logprobs_num", "routed_experts_start_len"):
            values = getattr(self, name)
            floor = -1 if name == "logprob_start_len" else 0
            for value in values if isinstance(values, list) else [values]:
                if value < floor:
                    raise InvalidRequest(name, f"must be >= {floor}; got {value}")
        if self.is_single:
            self._check_single()
        else:
            self._check_batch(size)
        return self

    def _check_bootstrap(self) -> None:
        """The bootstrap fields' ranges (whether the server needs them is the engine's call)."""
        ports = (
            self.bootstrap_port if isinstance(self.bootstrap_port, list) else [self.bootstrap_port]
        )
        if any(port is not None and not 0 < port < 65536 for port in ports):
            raise InvalidRequest("bootstrap_port", "must be a TCP port in [1, 65535]")
        rooms = (
            self.bootstrap_room if isinstance(self.bootstrap_room, list) else [self.bootstrap_room]
        )
        if any(room is not None and not 0 <= room < 2**63 for room in rooms):
            raise InvalidRequest("bootstrap_room", "must be an integer in [0, 2**63)")
        hosts = (
            self.bootstrap_host if isinstance(self.bootstrap_host, list) else [self.bootstrap_host]
        )
        if any(host is not None and not host.strip() for host in hosts):
            raise InvalidRequest("bootstrap_host", "must be a host name or address, not empty")

    def _id_lists(self) -> list[list[int]]:
        ids = self.input_ids
        if ids is None:
            return []
        return [ids] if self.is_single else ids  # type: ignore[list-item,return-value]

    def _check_single(self) -> None:
        for name in _PER_ITEM_SCALARS:
            if isinstance(getattr(self, name), list):
                raise InvalidRequest(name, "a single prompt takes one value, not a list")
        if isinstance(self.sampling_params, list):
            raise InvalidRequest("sampling_params", "a single prompt takes one object, not a list")
        ids = self.token_ids_logprob
        if ids and isinstance(ids[0], list):
            raise InvalidRequest("token_ids_logprob", "a single prompt takes a flat list of ids")

    def _check_batch(self, size: int) -> None:
        def check_length(name: str, value: list[Any]) -> None:
            if len(value) != size:
                raise InvalidRequest(
                    name, f"has {len(value)} entries but the batch has {size} prompts"
                )

        for name in _PER_ITEM_SCALARS:
            value = getattr(self, name)
            if isinstance(value, list):
                check_length(name, value)
        if isinstance(self.sampling_params, list):
            check_length("sampling_params", self.sampling_params)
        ids = self.token_ids_logprob
        if ids and isinstance(ids[0], list):
            check_length("token_ids_logprob", ids)
        for name in _PER_ITEM_MEDIA:
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, list):
                    raise InvalidRequest(name, "a batch takes a list with one entry per prompt")
                check_length(name, value)
        if isinstance(self.rid, str):
            raise InvalidRequest("rid", "a batch takes a list of request ids, one per prompt")
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise InvalidRequest("rid", "request ids in a batch must be distinct")
        room = self.bootstrap_room
        if isinstance(room, int):
            # One room pairs one prefill half with one decode half.
            raise InvalidRequest(
                "bootstrap_room", "a batch takes a list of bootstrap rooms, one per prompt"
            )
        given = [r for r in room or [] if r is not None]
        if len(set(given)) != len(given):
            raise InvalidRequest("bootstrap_room", "bootstrap rooms in a batch must be distinct")

    @property
    def is_single(self) -> bool:
        """One prompt (as opposed to a batch)."""
        if self.text is not None:
            return isinstance(self.text, str)
        if self.input_ids is not None:
            return not self.input_ids or not isinstance(self.input_ids[0], list)
        embeds = self.input_embeds
        return not (embeds and embeds[0] and isinstance(embeds[0][0], list))

    @property
    def batch_size(self) -> int:
        """1 for a single prompt, else the number of prompts."""
        if self.is_single:
            return 1
        prompts = self.text if self.text is not None else self.input_ids or self.input_embeds
        return len(prompts or [])

    @property
    def params(self) -> SamplingParams:
        """The sampling parameters of a single request (defaults when none were given)."""
        if isinstance(self.sampling_params, list):
            raise TypeError("a batch request has one SamplingParams per item; split() it first")
        return self.sampling_params or SamplingParams()

    def split(self) -> list[GenerateRequest]:
        """One single request per item, per-item values taken from lists, the rest broadcast.

        Does not mutate self. A single request returns [self].
        """
        if self.is_single:
            return [self]
        items: list[GenerateRequest] = []
        for i in range(self.batch_size):
            values: dict[str, Any] = {"stream": self.stream}
            for name in ("text", "input_ids", "input_embeds"):
                prompts = getattr(self, name)
                if prompts is not None:
                    values[name] = prompts[i]
            for name in _PER_ITEM_SCALARS:
                value = getattr(self, name)
                values[name] = value[i] if isinstance(value, list) else value
            params = self.sampling_params
            values["sampling_params"] = params[i] if isinstance(params, list) else params
            ids = self.token_ids_logprob
            values["token_ids_logprob"] = ids[i] if ids and isinstance(ids[0], list) else ids
            for name in _PER_ITEM_MEDIA:
                value = getattr(self, name)
                values[name] = value[i] if value is not None else None
            items.append(GenerateRequest.model_construct(**values))
        return items
