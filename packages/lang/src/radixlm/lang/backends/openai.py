"""OpenAI: programs against an OpenAI-compatible API (api.openai.com, or radixlm's own /v1).

Needs the `openai` client: `pip install "radixlm-lang[openai]"`.

What an API cannot do, and what happens instead:

- Chat models generate whole assistant turns: a gen must open the assistant turn. Several gens
  in one turn need `@function(num_api_spec_tokens=N)` (speculative execution).
- `select` needs prompt logprobs: completion models score choices with `echo` + `logprobs`;
  chat models raise UnsupportedFeature.
- Sampling fields beyond OpenAI's (top_k, min_p, regex, json_schema on completions, ...) are
  sent in `extra_body` when `server_extensions` is on (the default when `base_url` is given:
  radixlm, SGLang and vLLM accept them); otherwise they raise UnsupportedFeature. On chat
  models a json_schema becomes `response_format`.
- Images go to chat models as `image_url` parts. OpenAI's API takes no video: `video()` raises
  UnsupportedFeature, unless `server_extensions` is on, when a chat model gets it as a
  `video_url` part (radixlm's `/v1`, SGLang and vLLM accept them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixlm.lang.backends.base import Completion, GenerateCall, Prompt
from radixlm.lang.chat_template import DEFAULT, ChatTemplate, resolve_chat_template
from radixlm.lang.choices import ChoicesDecision, ChoicesMethod, normalized_logprob
from radixlm.lang.errors import BackendError, BackendUnavailable, UnsupportedFeature
from radixlm.lang.ir import DTYPE_REGEX

# SamplingParams field -> OpenAI request field.
_STANDARD = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "n": "n",
    "logit_bias": "logit_bias",
}
# Fields radixlm / SGLang / vLLM servers take in the body beyond OpenAI's.
_EXTENSIONS = {
    "min_new_tokens": "min_tokens",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "ignore_eos": "ignore_eos",
    "no_stop_trim": "no_stop_trim",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "structural_tag": "structural_tag",
    "choice": "choice",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "repetition_detection": "repetition_detection",
    "custom_params": "custom_params",
}
# OpenAI's own completion models; every other name is taken for a chat model.
_COMPLETION_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


class OpenAI:
    """An OpenAI-compatible API as a program backend.

    `is_chat_model` defaults to True except for OpenAI's completion models. `api_key` defaults
    to $OPENAI_API_KEY (a placeholder when `base_url` is given and none is set: local servers
    need none). `chat_template` (name or ChatTemplate) only shapes `s.text()`; chat models get
    `s.messages()`. Other keywords go to `openai.OpenAI` (`timeout`, `max_retries`, ...).
    """

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        is_chat_model: bool | None = None,
        chat_template: str | ChatTemplate | None = None,
        server_extensions: bool | None = None,
        **client_kwargs: Any,
    ) -> None:
        try:
            import openai
        except ImportError:
            raise ImportError(
                'the OpenAI backend needs the openai client: pip install "radixlm-lang[openai]"'
            ) from None
        self._openai = openai
        if api_key is None and base_url is not None and not os.environ.get("OPENAI_API_KEY"):
            api_key = "EMPTY"
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self.model_name = model_name
        self.base_url = base_url
        self._is_chat = (
            is_chat_model if is_chat_model is not None else model_name not in _COMPLETION_MODELS
        )
        self.server_extensions = (
            base_url is not None if server_extensions is None else server_extensions
        )
        self.chat_template = resolve_chat_template(chat_template) if chat_template else DEFAULT

    @property
    def is_chat_model(self) -> bool:
        return self._is_chat

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # ----- requests -----

    def _call(self, create: Callable[..., Any], **kwargs: Any) -> Any:
        openai = self._openai
        try:
            return create(model=self.model_name, **kwargs)
        except openai.APITimeoutError as error:
            raise BackendError(f"{self.model_name} did not answer in time: {error}") from error
        except openai.APIConnectionError as error:
            where = self.base_url or "the OpenAI API"
            raise BackendUnavailable(f"cannot reach {where}: {error}") from error
        except openai.APIStatusError as error:
            raise BackendError(
                f"{self.model_name} answered {error.status_code}: {error.message}",
                status=error.status_code,
            ) from error

    def _request(self, call: GenerateCall) -> dict[str, Any]:
        """The create() keywords for a gen; raises UnsupportedFeature for what cannot go."""
        params = call.params
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        values = {name: getattr(params, name) for name in params.model_fields_set}
        if call.dtype is not None and params.constraint is None:
            values["regex"] = DTYPE_REGEX[call.dtype]
        if self._is_chat and values.get("json_schema") is not None:
            schema = json.loads(values.pop("json_schema"))
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": call.name or "output", "schema": schema},
            }
        for field, value in values.items():
            if field in _STANDARD:
                if value is not None:
                    kwargs[_STANDARD[field]] = value
            elif field in _EXTENSIONS and self.server_extensions:
                extra[_EXTENSIONS[field]] = (
                    value.model_dump() if hasattr(value, "model_dump") else value
                )
            else:
                kind = "chat" if self._is_chat else "completion"
                raise UnsupportedFeature(
                    f"{field} is not part of the OpenAI API, so {kind} model {self.model_name} "
                    "cannot take it; use RuntimeEndpoint, or OpenAI(..., server_extensions=True) "
                    "against a server that accepts it"
                )
        if call.logprobs.return_logprob:
            if self._is_chat:
                kwargs["logprobs"] = True
                if call.logprobs.top_logprobs_num:
                    kwargs["top_logprobs"] = call.logprobs.top_logprobs_num
            else:
                kwargs["logprobs"] = call.logprobs.top_logprobs_num or 0
        if extra:
            kwargs["extra_body"] = extra
        if self._is_chat:
            kwargs["messages"] = self._chat_messages(call)
        else:
            if call.prompt.videos:
                raise UnsupportedFeature(
                    f"completion model {self.model_name} takes a prompt text only, not video(); "
                    "use a chat model with server_extensions, or RuntimeEndpoint"
                )
            kwargs["prompt"] = call.prompt.text
        return kwargs

    def _chat_messages(self, call: GenerateCall) -> list[dict[str, Any]]:
        prompt = call.prompt
        if prompt.videos and not self.server_extensions:
            raise UnsupportedFeature(
                f"the OpenAI API takes no videos, so chat model {self.model_name} cannot take "
                "video(); use RuntimeEndpoint, or OpenAI(..., server_extensions=True) against a "
                "server that accepts video_url parts (radixlm, SGLang, vLLM)"
            )
        if prompt.role != "assistant" or prompt.role_text.strip():
            raise UnsupportedFeature(
                f"{self.model_name} is a chat model: gen({call.name!r}) must open an assistant "
                "turn, with nothing before it in the turn (s += sgl.assistant(sgl.gen(...))); "
                "for text and several gens in one turn use @function(num_api_spec_tokens=...)"
            )
        return [dict(m) for m in prompt.messages]

    @staticmethod
    def _meta(response: Any, choice: Any) -> dict[str, Any]:
        usage = getattr(response, "usage", None)
        meta: dict[str, Any] = {
            "id": getattr(response, "id", None),
            "finish_reason": {"type": choice.finish_reason} if choice.finish_reason else None,
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
        }
        logprobs = getattr(choice, "logprobs", None)
        if logprobs is not None:
            content = getattr(logprobs, "content", None)
            if content is not None:
                meta["output_token_logprobs"] = [[t.logprob, None, t.token] for t in content]
            elif getattr(logprobs, "token_logprobs", None) is not None:
                meta["output_token_logprobs"] = [
                    [lp, None, tok]
                    for lp, tok in zip(logprobs.token_logprobs, logprobs.tokens, strict=False)
                ]
        return meta

    def _text(self, choice: Any) -> str:
        if self._is_chat:
            return str(choice.message.content or "")
        return str(choice.text or "")

    def generate(self, call: GenerateCall) -> Completion:
        kwargs = self._request(call)
        create = (
            self.client.chat.completions.create if self._is_chat else self.client.completions.create
        )
        response = self._call(create, **kwargs)
        choices = sorted(response.choices, key=lambda c: c.index)
        if len(choices) == 1:
            return Completion(self._text(choices[0]), self._meta(response, choices[0]))
        return Completion(
            [self._text(c) for c in choices], [self._meta(response, c) for c in choices]
        )

    def generate_stream(self, call: GenerateCall) -> Iterator[tuple[str, Any]]:
        kwargs = self._request(call)
        create = (
            self.client.chat.completions.create if self._is_chat else self.client.completions.create
        )
        stream = self._call(create, stream=True, **kwargs)
        meta: dict[str, Any] = {}
        try:
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.index != 0:
                        continue
                    delta = (choice.delta.content if self._is_chat else choice.text) or ""
                    if choice.finish_reason:
                        meta = {"id": chunk.id, "finish_reason": {"type": choice.finish_reason}}
                    if delta or choice.finish_reason:
                        yield delta, meta
        except self._openai.APIError as error:
            raise BackendError(f"{self.model_name} stream failed: {error}") from error

    # ----- select -----

    def _echo_scores(self, texts: list[str], skip: int) -> list[list[list[Any]]]:
        """Logprob entries of each text's tokens that end past character `skip`."""
        response = self._call(
            self.client.completions.create,
            prompt=texts,
            max_tokens=0,
            echo=True,
            logprobs=0,
            temperature=0,
        )
        scored = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            lp = choice.logprobs
            scored.append(
                [
                    [value, None, token]
                    for token, value, offset in zip(
                        lp.tokens, lp.token_logprobs, lp.text_offset, strict=False
                    )
                    if offset + len(token) > skip
                ]
            )
        return scored

    def select(
        self, prompt: Prompt, choices: Sequence[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        """Completion models: score each choice from echoed prompt logprobs (one request)."""
        if self._is_chat:
            raise UnsupportedFeature(
                f"select() needs prompt logprobs, which chat model {self.model_name} does not "
                "return; use a completion model (OpenAI(..., is_chat_model=False)) or "
                "RuntimeEndpoint"
            )
        inputs = self._echo_scores([prompt.text + c for c in choices], len(prompt.text))
        alone = (
            self._echo_scores(list(choices), 0) if method.requires_unconditional_logprobs else None
        )
        return method(
            choices=list(choices),
            normalized_prompt_logprobs=[normalized_logprob(e) for e in inputs],
            input_token_logprobs=inputs,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=alone,
        )

    def cache_prefix(self, text: str) -> None:
        """An API has no explicit cache to fill; nothing to do."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {"model": self.model_name, "base_url": self.base_url, "is_chat_model": self._is_chat}

    def __repr__(self) -> str:
        return f"OpenAI({self.model_name!r})"
