"""Request preparation on the caller's side: validation and tokenization into an EngineRequest.

Everything that can be wrong with a request's fields is found here, before it reaches the engine
core, and raised as `InvalidRequest` naming the field; this is the one place each limit is
checked. (A grammar that does not compile is found by the core, which compiles it, and fails
the request before its first chunk.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from radixlm.runtime.input_embeds import input_embeds_cache_ids, parse_input_embeds
from radixlm.runtime.messages import Bootstrap, EngineRequest, LogprobOptions, PoolingAsk
from radixlm.runtime.multimodal.inputs import MultimodalInputs
from radixlm.runtime.multimodal.preparer import MultimodalPreparer
from radixlm.runtime.thinking import THINK_END, end_of_thinking_token, think_end_ids
from radixlm.sampling import (
    CustomLogitProcessor,
    EmbeddingRequest,
    GenerateRequest,
    InvalidRequest,
    SamplingDefaults,
    SamplingParams,
    check_text_fits,
    max_token_chars,
)

T = TypeVar("T")


def _one_media(value: Any) -> Any:
    """A single request's media field: None when absent or empty."""
    if value is None or (isinstance(value, list) and not value):
        return None
    return value


def _one(value: T | list[Any] | None, kind: type[T]) -> T | None:
    """The value of a single (split) request's per-item field."""
    if isinstance(value, list):
        raise InvalidRequest("request", "a single request takes one value per field; split() it")
    return value


@dataclass(frozen=True)
class FrontendLimits:
    """What the loaded model and engine accept."""

    vocab_size: int
    context_length: int
    custom_logit_processors: bool
    clamp_max_tokens: bool = False  # max_new_tokens past the context: cut it, not a 400
    max_logprobs: int = 20  # vLLM-style logprobs / prompt_logprobs counts; -1: no limit
    stream_interval: int = 1  # output tokens per streamed chunk, unless the request says
    hidden_size: int = 0  # the width of `input_embeds` rows (0: embeddings are refused)
    #: Whether the model has experts, and whether the engine keeps their routing.
    mixture_of_experts: bool = False
    routed_experts: bool = False
    #: Whether requests may carry a `priority` (the scheduler's `enable_priority_scheduling`).
    priority_scheduling: bool = False
    #: Prefill/decode disaggregation: `null` (colocated: bootstrap fields are refused),
    #: `prefill` or `decode` (they are required).
    disaggregation_mode: str = "null"


class RequestPreparer:
    """Turns one single `GenerateRequest` into an `EngineRequest`."""

    def __init__(
        self,
        tokenizer: Any,
        defaults: SamplingDefaults,
        limits: FrontendLimits,
        incremental_streaming: bool = False,
        multimodal: MultimodalPreparer | None = None,
        lora_adapters: Callable[[], Mapping[str, str]] | None = None,
        pooling: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        #: A pooling model's `PoolingConfig.as_dict()` (None: a generative model).
        self.pooling = dict(pooling) if pooling is not None else None
        #: The loaded LoRA adapters, name -> directory (None: the engine serves none).
        self.lora_adapters = lora_adapters
        #: A vision model's image and video handling (None: media are refused).
        self.multimodal = multimodal
        self.defaults = defaults
        self.limits = limits
        self.incremental_streaming = incremental_streaming
        # A text longer than context_length * this cannot fit: refused before tokenizing it.
        self.max_token_chars = max_token_chars(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def prepare(self, item: GenerateRequest) -> EngineRequest:
        """Validate and tokenize one single request. Raises InvalidRequest naming the field."""
        if self.pooling is not None:
            raise InvalidRequest(
                "text",
                f"this is a pooling model (task {self.pooling['task']}): it does not generate "
                "text; call encode (/encode, /v1/embeddings, /v1/rerank, /v1/score, /classify)",
            )
        self._refuse_unsupported(item)
        lora_name = self._lora_name(item)
        embeds = self._input_embeds(item)
        prompt_ids = self._prompt_ids(item, embeds)
        prompt_ids, media = self._media(item, prompt_ids, embeds)
        hidden = bool(_one(item.return_hidden_states, bool))
        params = self.defaults.apply(item.sampling_params)  # type: ignore[arg-type]
        params.check(self.limits.vocab_size)
        grammar_after = self._grammar_after(item, params)
        thinking_end = self._thinking_end(params, grammar_after)
        custom = _one(item.custom_logit_processor, str)
        if custom:
            self._check_custom(custom)
        logprobs = self._logprob_options(item, params, len(prompt_ids))
        start = logprobs.input_start
        if start is not None and embeds is not None:
            field = "prompt_logprobs" if params.prompt_logprobs is not None else "logprob_start_len"
            raise InvalidRequest(
                field,
                "prompt logprobs need the prompt's token ids, and an input_embeds prompt has "
                "none; ask for output logprobs only (logprob_start_len -1)",
            )
        if start is not None and media is not None and start < media.items[-1].end:
            # Text after the last image is scored (lang's select); image positions have no ids.
            field = "prompt_logprobs" if params.prompt_logprobs is not None else "logprob_start_len"
            raise InvalidRequest(
                field,
                "prompt logprobs need the prompt's token ids, and images have none; start them "
                f"after the last image (logprob_start_len >= {media.items[-1].end}) or ask for "
                "output logprobs only (logprob_start_len -1)",
            )
        room = self.limits.context_length - len(prompt_ids)
        wanted = params.max_new_tokens
        if wanted is not None and wanted > room and not self.limits.clamp_max_tokens:
            limit = self.limits.context_length
            raise InvalidRequest(
                "max_new_tokens",
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the prompt, {wanted} "
                "to generate); ask for fewer tokens or shorten the prompt",
            )
        bootstrap = self._bootstrap(item, params, wanted, embeds, media, hidden)
        max_new_tokens = room if wanted is None else min(wanted, room)
        if bootstrap is not None and self.limits.disaggregation_mode == "prefill":
            # The prefill half generates the first token only; the decode half the rest.
            max_new_tokens = 1
        created = time.monotonic()
        timeout = _one(item.timeout, float)
        return EngineRequest(
            rid=_one(item.rid, str) or uuid.uuid4().hex,
            prompt_ids=tuple(prompt_ids),
            params=params,
            max_new_tokens=max_new_tokens,
            stream=item.stream,
            incremental=self.incremental_streaming,
            stream_interval=params.stream_interval or self.limits.stream_interval,
            logprobs=logprobs,
            custom_logit_processor=custom,
            input_embeds=embeds,
            multimodal=media,
            return_hidden_states=hidden,
            bad_words_ids=self._bad_words(params),
            thinking_end=thinking_end,
            grammar_after=grammar_after,
            lora_name=lora_name,
            routed_experts_start=self._routed_experts_start(item, len(prompt_ids)),
            priority=self._priority(item),
            deadline=None if timeout is None else created + timeout,
            bootstrap=bootstrap,
            created=created,
        )

    def _bootstrap(
        self,
        item: GenerateRequest,
        params: SamplingParams,
        max_new_tokens: int | None,
        embeds: Any,
        media: MultimodalInputs | None,
        hidden: bool,
    ) -> Bootstrap | None:
        """The request's pairing on a disaggregated engine (None on a colocated one). The
        fields are required there and refused elsewhere, and what a disaggregated request
        cannot carry yet is refused, naming the field."""
        mode = self.limits.disaggregation_mode
        host = _one(item.bootstrap_host, str)
        port = _one(item.bootstrap_port, int)
        room = _one(item.bootstrap_room, int)
        given = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
        if mode == "null":
            for field, value in given.items():
                if value is not None:
                    raise InvalidRequest(
                        field,
                        "this server runs prefill and decode itself (it is not disaggregated); "
                        "remove the bootstrap fields, or send the request to servers started "
                        "with --disaggregation-mode prefill and decode",
                    )
            return None
        # The prefill half needs only the room; the decode half registers it at host:port.
        required = ("bootstrap_room",) if mode == "prefill" else tuple(given)
        for field in required:
            if given[field] is None:
                raise InvalidRequest(
                    field,
                    f"this is a {mode} server (--disaggregation-mode {mode}): a request needs "
                    "bootstrap_host, bootstrap_port (the prefill server's bootstrap endpoint) "
                    "and bootstrap_room (a random id the router sends to both servers); send "
                    "it through a prefill/decode router, or to a colocated server",
                )
        media_field = "image_data" if _one_media(item.image_data) is not None else "video_data"
        refused = {
            "n": (params.n > 1, "parallel sampling (n > 1)"),
            "max_new_tokens": (max_new_tokens == 0, "prompt scoring (max_new_tokens 0)"),
            "input_embeds": (embeds is not None, "input_embeds"),
            media_field: (media is not None, "images and videos"),
            "return_hidden_states": (hidden, "return_hidden_states"),
            "return_routed_experts": (
                bool(_one(item.return_routed_experts, bool)),
                "return_routed_experts",
            ),
        }
        for field, (bad, what) in refused.items():
            if bad:
                raise InvalidRequest(
                    field,
                    f"{what} is not available with prefill/decode disaggregation yet; send the "
                    "request to a colocated server (no --disaggregation-mode)",
                )
        assert room is not None
        return Bootstrap(room, host, port)

    def _priority(self, item: GenerateRequest) -> int:
        """The request's priority (0 when it names none); refused unless the engine
        schedules by priority, so that a priority is never silently ignored."""
        priority = _one(item.priority, int)
        if priority is None:
            return 0
        if not self.limits.priority_scheduling:
            raise InvalidRequest(
                "priority",
                "this engine does not schedule by priority; start it with "
                "--enable-priority-scheduling (enable_priority_scheduling=True) or drop "
                "the field",
            )
        return priority

    def _routed_experts_start(self, item: GenerateRequest, prompt_len: int) -> int | None:
        """`routed_experts_start_len` when the request asks for its routed experts."""
        if not _one(item.return_routed_experts, bool):
            return None
        limits = self.limits
        if not limits.mixture_of_experts:
            raise InvalidRequest(
                "return_routed_experts",
                "this model has no experts (it is not a mixture-of-experts model); remove "
                "return_routed_experts",
            )
        if not limits.routed_experts:
            raise InvalidRequest(
                "return_routed_experts",
                "the server does not keep the routed experts; start it with "
                "--enable-return-routed-experts",
            )
        start = _one(item.routed_experts_start_len, int) or 0
        if not 0 <= start <= prompt_len:
            raise InvalidRequest(
                "routed_experts_start_len",
                f"must lie in [0, prompt_tokens] = [0, {prompt_len}]; got {start}",
            )
        return start

    def _lora_name(self, item: GenerateRequest) -> str | None:
        """The request's adapter name, checked against the loaded ones (None: the base model;
        so is an empty name)."""
        name = _one(item.lora_path, str)
        if not name:
            return None
        if self.lora_adapters is None:
            raise InvalidRequest(
                "lora_path",
                "this engine serves no LoRA adapters; remove lora_path, or start the server "
                "with --lora-paths NAME=PATH (or --enable-lora and POST /load_lora_adapter)",
            )
        loaded = self.lora_adapters()
        if name not in loaded:
            known = ", ".join(sorted(loaded)) or "none"
            raise InvalidRequest(
                "lora_path",
                f"unknown LoRA adapter {name!r} (loaded: {known}); load it with "
                "POST /load_lora_adapter or name a loaded one",
            )
        return name

    def _refuse_unsupported(self, item: GenerateRequest) -> None:
        refused = {
            "audio_data": "audio input is not supported yet; remove audio_data",
        }
        if self.multimodal is None:
            for field, kind in (("image_data", "images"), ("video_data", "videos")):
                refused[field] = (
                    f"this model is text-only: it does not take {kind}; remove {field}, or "
                    "serve a vision model (e.g. --model-path radixlm-demo-vision)"
                )
        for field, message in refused.items():
            if getattr(item, field, None) is not None:
                raise InvalidRequest(field, message)

    def _media(
        self, item: GenerateRequest, prompt_ids: list[int], embeds: Any
    ) -> tuple[list[int], MultimodalInputs | None]:
        """The prompt with its images and videos placed (ids expanded), and the media."""
        images = _one_media(item.image_data)
        videos = _one_media(item.video_data)
        if self.multimodal is None or (images is None and videos is None):
            return prompt_ids, None
        if embeds is not None:
            field = "image_data" if images is not None else "video_data"
            raise InvalidRequest(field, "cannot be combined with input_embeds; send text or ids")
        ids, media = self.multimodal.prepare(prompt_ids, images, videos)
        if not media.items:
            return prompt_ids, None
        limit = self.limits.context_length
        if len(ids) >= limit:
            field = "image_data" if images is not None else "video_data"
            raise InvalidRequest(
                field,
                f"with its images and videos the prompt takes {len(ids)} positions "
                f"({len(prompt_ids)} text tokens, {len(ids) - len(prompt_ids)} more for the "
                f"media) but the context holds {limit}, including at least one generated "
                "token; send fewer or smaller images, or a shorter prompt",
            )
        return ids, media

    def _input_embeds(self, item: GenerateRequest) -> Any:
        """The prompt's embeddings (a float32 tensor [seq, hidden]) when given, else None."""
        if item.input_embeds is None:
            return None
        if self.limits.hidden_size <= 0:
            raise InvalidRequest(
                "input_embeds", "this engine does not take embeddings; send text or input_ids"
            )
        return parse_input_embeds(item.input_embeds, self.limits.hidden_size)  # type: ignore[arg-type]

    def prepare_pooling(self, item: EmbeddingRequest) -> EngineRequest:
        """Validate and tokenize one single encode request (a pooling model's): its text
        (a pair with `text_pair`) tokenized with the model's special tokens, as
        sentence-transformers and transformers do. Raises InvalidRequest naming the field."""
        pooling = self.pooling
        if pooling is None:
            raise InvalidRequest(
                "text",
                "this model generates text; encode needs a pooling model (an embedding, "
                "classification, cross-encoder or reward model, or a causal LM served with "
                "is_embedding)",
            )
        if item.lora_path is not None:
            raise InvalidRequest("lora_path", "pooling models serve no LoRA adapters")
        if item.text_pair is not None and pooling["task"] != "score":
            raise InvalidRequest(
                "text_pair",
                f"text pairs are for cross-encoders (task score); this model's task is "
                f"{pooling['task']}",
            )
        types: list[int] | None = None
        if item.text is not None:
            text = str(item.text)
            check_text_fits(text, self.limits.context_length, self.max_token_chars, "text")
            encoded = self.tokenizer(text, item.text_pair, add_special_tokens=True)
            ids = list(encoded["input_ids"])
            types = encoded.get("token_type_ids")
            field = "text"
        else:
            ids = [int(t) for t in item.input_ids or []]  # type: ignore[arg-type]
            field = "input_ids"
            outside = [t for t in ids if t >= self.limits.vocab_size]
            if outside:
                raise InvalidRequest(
                    field,
                    f"token ids {outside[:5]} are outside the vocabulary of "
                    f"{self.limits.vocab_size} tokens",
                )
        keep = item.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            types = types[-keep:] if types is not None else None
        if not ids:
            raise InvalidRequest(field, "the input is empty (it encodes to no tokens)")
        limit = self.limits.context_length
        if len(ids) > limit:
            raise InvalidRequest(
                field,
                f"the input has {len(ids)} tokens but the model takes at most {limit}; "
                "shorten it or set truncate_prompt_tokens",
            )
        hidden = int(pooling["hidden_size"])
        dimensions = item.dimensions
        if dimensions is not None and (pooling["task"] != "embed" or dimensions > hidden):
            raise InvalidRequest(
                "dimensions",
                f"dimensions applies to embeddings, up to the model's {hidden}; got {dimensions}"
                if pooling["task"] == "embed"
                else f"dimensions applies to embeddings; this model's task is {pooling['task']}",
            )
        normalize = pooling["normalize"] if item.normalize is None else item.normalize
        return EngineRequest(
            rid=item.rid or uuid.uuid4().hex,  # type: ignore[arg-type]
            prompt_ids=tuple(ids),
            params=SamplingParams(max_new_tokens=0),
            max_new_tokens=0,
            pooling=PoolingAsk(
                method=str(pooling["method"]),
                normalize=bool(normalize) and pooling["task"] == "embed",
                dimensions=dimensions,
                token_type_ids=tuple(types) if types is not None and any(types) else None,
            ),
            created=time.monotonic(),
        )

    def _prompt_ids(self, item: GenerateRequest, embeds: Any = None) -> list[int]:
        if embeds is not None:
            # Cache-key pseudo ids, one per row; the model takes the rows themselves.
            field = "input_embeds"
            ids = input_embeds_cache_ids(embeds)
        elif item.text is not None:
            field = "text"
            text = str(item.text)
            check_text_fits(text, self.limits.context_length, self.max_token_chars, field)
            ids = self.encode(text)
        else:
            field = "input_ids"
            ids = [int(t) for t in item.input_ids or []]  # type: ignore[arg-type]
            outside = [t for t in ids if t >= self.limits.vocab_size]
            if outside:
                raise InvalidRequest(
                    field,
                    f"token ids {outside[:5]} are outside the vocabulary of "
                    f"{self.limits.vocab_size} tokens",
                )
        if not ids:
            raise InvalidRequest(field, "the prompt is empty (it encodes to no tokens)")
        limit = self.limits.context_length
        if len(ids) >= limit:
            raise InvalidRequest(
                field,
                f"the prompt has {len(ids)} tokens but the context holds {limit}, including at "
                "least one generated token; shorten the prompt",
            )
        return ids

    def _grammar_after(self, item: GenerateRequest, params: SamplingParams) -> tuple[int, ...]:
        """The token ids the constraint starts after: those of `</think>` when the request
        has a constraint and `require_reasoning` (the model thinks freely first); else none."""
        if not _one(item.require_reasoning, bool) or params.constraint is None:
            return ()
        ids = think_end_ids(self.tokenizer)
        if not ids or max(ids) >= self.limits.vocab_size:
            raise InvalidRequest(
                "require_reasoning",
                f"this model's tokenizer cannot write {THINK_END!r} within its vocabulary, so "
                "the end of its reasoning cannot be found; remove require_reasoning",
            )
        return ids

    def _thinking_end(self, params: SamplingParams, grammar_after: tuple[int, ...]) -> int | None:
        """The token that ends the thinking, when the request sets a thinking_token_budget."""
        if params.thinking_token_budget is None:
            return None
        if params.constraint is not None and not grammar_after:
            raise InvalidRequest(
                "thinking_token_budget",
                "cannot be combined with a structured-output constraint that shapes the "
                "thinking too; set require_reasoning (the constraint then applies after "
                "the thinking) or remove one of them",
            )
        end = end_of_thinking_token(self.tokenizer)
        if end is None or end >= self.limits.vocab_size:
            raise InvalidRequest(
                "thinking_token_budget",
                f"is not enforced for this model: its tokenizer has no single {THINK_END!r} "
                "token to end the thinking with; remove it",
            )
        return end

    def _check_custom(self, custom: str) -> None:
        if not self.limits.custom_logit_processors:
            raise InvalidRequest(
                "custom_logit_processor",
                "custom logit processors are disabled on this engine; start it with "
                "enable_custom_logit_processor=True (radixlm serve "
                "--enable-custom-logit-processor) to allow them",
            )
        try:
            CustomLogitProcessor.from_str(custom)
        except ValueError as error:
            raise InvalidRequest("custom_logit_processor", str(error)) from None

    def _logprob_count(self, params: SamplingParams, field: str) -> int | None:
        """vLLM's `logprobs` / `prompt_logprobs`: -1 is the whole vocabulary; both are bounded
        by the engine's `max_logprobs`."""
        count = getattr(params, field)
        if count is None:
            return None
        count = self.limits.vocab_size if count == -1 else count
        limit = self.limits.max_logprobs
        if limit != -1 and count > limit:
            raise InvalidRequest(
                field,
                f"asks for {count} logprobs per token but this server returns at most {limit} "
                "(its --max-logprobs); ask for fewer",
            )
        return count

    def _logprob_options(
        self, item: GenerateRequest, params: SamplingParams, prompt_len: int
    ) -> LogprobOptions:
        output_count = self._logprob_count(params, "logprobs")
        prompt_count = self._logprob_count(params, "prompt_logprobs")
        ids = item.token_ids_logprob or params.logprob_token_ids
        asked = cast("list[int]", item.token_ids_logprob or [])
        outside = [t for t in asked if t >= self.limits.vocab_size]
        if outside:
            raise InvalidRequest(
                "token_ids_logprob",
                f"token ids {outside[:5]} are outside the vocabulary of "
                f"{self.limits.vocab_size} tokens",
            )
        enabled = bool(_one(item.return_logprob, bool)) or output_count is not None
        # Asking for the logprobs of given token ids asks for logprobs.
        enabled = enabled or prompt_count is not None or bool(ids)
        top = max(_one(item.top_logprobs_num, int) or 0, output_count or 0)
        start: int | None = None
        start_len = _one(item.logprob_start_len, int)
        start_len = -1 if start_len is None else start_len
        if enabled and start_len >= prompt_len:
            raise InvalidRequest(
                "logprob_start_len",
                f"is {start_len} but the prompt has {prompt_len} tokens; give a position "
                f"below {prompt_len} (or -1 for output logprobs only)",
            )
        if enabled and start_len >= 0:
            start = start_len
        if prompt_count is not None:
            start = 0
            top = max(top, prompt_count)
        if top > 0 and not enabled:
            enabled = bool(_one(item.return_logprob, bool))
        return LogprobOptions(
            enabled=enabled,
            top=top if enabled else 0,
            token_ids=tuple(ids) if enabled and ids else None,  # type: ignore[arg-type]
            input_start=start if enabled else None,
            with_text=bool(_one(item.return_text_in_logprobs, bool)),
        )

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        found: list[tuple[int, ...]] = []
        for word in params.bad_words or []:
            for variant in (word, " " + word):
                ids = tuple(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in found:
                    found.append(ids)
        return tuple(found)
