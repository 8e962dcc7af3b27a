"""The part RuntimeEndpoint and the in-process engine backend share: SGLang's /generate body
and output shape, streaming deltas, and `select` scored from prompt logprobs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from radixlm.lang.backends.base import Completion, GenerateCall, Prompt
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoicesDecision, ChoicesMethod, normalized_logprob
from radixlm.lang.ir import DTYPE_REGEX

Body = dict[str, Any]


class NativeTransport(Protocol):
    """Moves SGLang-shaped /generate bodies to a model and brings its outputs back."""

    def request(self, body: Body) -> Any:
        """One non-streaming /generate call: an output dict, or a list for batches and n > 1."""
        ...

    def stream(self, body: Body) -> Iterator[dict[str, Any]]:
        """One streaming /generate call: its output chunks (text cumulative)."""
        ...

    def model_info(self) -> dict[str, Any]: ...

    def flush_cache(self) -> bool: ...

    def server_info(self) -> dict[str, Any]: ...


def media_fields(prompt: Prompt) -> Body:
    """The prompt's images and videos as one request's `image_data` / `video_data` (one item
    bare, several as a list; absent when none)."""
    fields: Body = {}
    for key, items in (("image_data", prompt.images), ("video_data", prompt.videos)):
        if items:
            fields[key] = items[0] if len(items) == 1 else list(items)
    return fields


def generate_body(call: GenerateCall, stream: bool = False) -> Body:
    """The /generate body for one gen: the SamplingParams fields that were set, the logprob
    options, the images and videos; a `dtype` becomes its regex when no other constraint is
    given."""
    sampling = call.params.model_dump(mode="json", exclude_unset=True)
    if call.dtype is not None and call.params.constraint is None:
        sampling["regex"] = DTYPE_REGEX[call.dtype]
    body: Body = {"text": call.prompt.text, "sampling_params": sampling}
    body.update(call.logprobs.request_fields())
    body.update(media_fields(call.prompt))
    if stream:
        body["stream"] = True
    return body


def _as_list(output: Any) -> list[dict[str, Any]]:
    return list(output) if isinstance(output, list) else [output]


def _input_entries(
    output: dict[str, Any], start: int, first_id: int | None = None
) -> list[list[Any]]:
    """The output's input_token_logprobs from position `start`, one entry per token. A server
    that leaves out the first token (which has no logprob) gets a [None, id, None] entry back."""
    meta = output["meta_info"]
    entries = [list(e) for e in meta.get("input_token_logprobs") or []]
    expected = int(meta.get("prompt_tokens", len(entries) + start)) - start
    if start == 0 and len(entries) == expected - 1:
        entries.insert(0, [None, first_id, None])
    return entries


def _choice_entries(
    entries: list[list[Any]], choice: str, prefix_tokens: int, prompt_last_id: int | None
) -> list[list[Any]]:
    """The logprob entries that cover `choice`. Scoring starts one token before the choice;
    that token is dropped unless tokenization merged it with the choice's first characters.
    With the id of the prompt's own last token, that is exact (same id: not merged); without
    it, the token texts decide (which fails for tokens holding part of a UTF-8 character)."""
    if prefix_tokens == 0 or not entries:
        return entries
    if prompt_last_id is not None:
        return entries[1:] if entries[0][1] == prompt_last_id else entries
    rest = entries[1:]
    texts = [e[2] if len(e) > 2 else None for e in rest]
    if all(isinstance(t, str) for t in texts):
        tail = "".join(texts)  # type: ignore[arg-type]
        if tail != choice and choice.endswith(tail):
            return entries
    return rest


class NativeBackend:
    """A Backend over a NativeTransport (SGLang's /generate semantics)."""

    is_chat_model = False

    def __init__(self, transport: NativeTransport, chat_template: ChatTemplate) -> None:
        self.transport = transport
        self.chat_template = chat_template

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(self, call: GenerateCall) -> Completion:
        outputs = self.transport.request(generate_body(call))
        if isinstance(outputs, list):
            return Completion([o["text"] for o in outputs], [o.get("meta_info") for o in outputs])
        return Completion(outputs["text"], outputs.get("meta_info") or {})

    def generate_stream(self, call: GenerateCall) -> Iterator[tuple[str, Any]]:
        seen = ""
        for chunk in self.transport.stream(generate_body(call, stream=True)):
            if chunk.get("index", 0) != 0:
                continue  # with n > 1 the program streams the first sequence
            text = chunk.get("text", "")
            delta = text[len(seen) :] if text.startswith(seen) else text
            seen = text if text.startswith(seen) else seen + text
            yield delta, chunk.get("meta_info") or {}

    def select(
        self, prompt: Prompt, choices: Sequence[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        """Score all choices in one batched request (max_new_tokens=0, prompt logprobs from the
        token before the choice; the prompt alone rides along to give that token's id). A first
        call on the prompt alone tells where the choice starts and puts the prompt in the cache
        for the batch."""
        media = media_fields(prompt)
        head_body: Body = {"text": prompt.text, "sampling_params": {"max_new_tokens": 0}, **media}
        head = _as_list(self.transport.request(head_body))[0]
        prefix_tokens = int(head["meta_info"]["prompt_tokens"])
        start = max(prefix_tokens - 1, 0)
        texts = [prompt.text + c for c in choices]
        if prefix_tokens > 0:
            # The prompt alone, last in the batch: its one entry is the prompt's own last token,
            # which tells each choice whether tokenization merged into it.
            texts.append(prompt.text)
        body: Body = {
            "text": texts,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
        }
        body.update({key: [value] * len(texts) for key, value in media.items()})
        outputs = _as_list(self.transport.request(body))
        prompt_last_id = None
        if prefix_tokens > 0:
            own = _input_entries(outputs.pop(), start)
            prompt_last_id = own[-1][1] if own else None
        inputs = [
            _choice_entries(_input_entries(o, start), c, prefix_tokens, prompt_last_id)
            for c, o in zip(choices, outputs, strict=True)
        ]
        generated = [list(o["meta_info"].get("output_token_logprobs") or []) for o in outputs]
        unconditional = None
        if method.requires_unconditional_logprobs:
            ids = [[e[1] for e in entries] for entries in inputs]
            alone = _as_list(
                self.transport.request(
                    {
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 0},
                        "return_logprob": True,
                        "return_text_in_logprobs": True,
                        "logprob_start_len": 0,
                    }
                )
            )
            unconditional = [
                _input_entries(o, 0, first[0] if first else None)
                for o, first in zip(alone, ids, strict=True)
            ]
        return method(
            choices=list(choices),
            normalized_prompt_logprobs=[normalized_logprob(e) for e in inputs],
            input_token_logprobs=inputs,
            output_token_logprobs=generated,
            unconditional_token_logprobs=unconditional,
        )

    def cache_prefix(self, text: str) -> None:
        self.transport.request({"text": text, "sampling_params": {"max_new_tokens": 0}})

    def flush_cache(self) -> bool:
        return self.transport.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.transport.server_info()
