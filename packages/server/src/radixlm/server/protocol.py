"""EngineClient: what the server needs from an engine, as a structural Protocol.

The server never imports an engine. Anything with these members can be served by
`create_app(engine, config)`: radixlm's own `radixlm.runtime.Engine`, a remote-engine proxy, or a
test double. The runtime satisfies it structurally (it does not import this module).

Output chunks are plain dicts in SGLang's `/generate` response shape:

    {
      "index": 0,                        # which of the request's n sequences (0 when n == 1)
      "text": "...",                     # cumulative decoded text of that sequence
      "output_ids": [...],               # cumulative output token ids of that sequence
      "meta_info": {
        "id": "<rid>",
        "prompt_tokens": int,
        "completion_tokens": int,
        "cached_tokens": int,            # prompt tokens served from the radix cache
        "finish_reason": None | {"type": "stop" | "length" | "abort", "matched": int | str | None,
                                  "message": str (abort only, optional)},
        "e2e_latency": float,            # seconds since the request arrived
        # present when the request asked for logprobs (SGLang's layout):
        "input_token_logprobs": [[logprob | None, token_id, text | None], ...],
        "output_token_logprobs": [[logprob, token_id, text | None], ...],
        "input_top_logprobs": [[[logprob, token_id, text | None], ...] | None, ...],
        "output_top_logprobs": [[[logprob, token_id, text | None], ...], ...],
        "input_token_ids_logprobs" / "output_token_ids_logprobs": same layout as top logprobs,
      },
    }

A sequence's last chunk has a non-null `finish_reason`. A sequence's `text` only ever grows:
each chunk's text starts with the previous one's (hold back what a stop string may still trim,
and incomplete UTF-8), since the server sends clients the difference. Output logprob lists
may be cumulative like `text` (one entry per output token so far) or hold only the new tokens'
entries (radixlm's engine streams them so, as SGLang does, with the running count in
`output_token_logprobs_length`); the server accepts both. `[logprob, token_id, text]` triples carry the text when the
request set `return_text_in_logprobs` (the server sets it on OpenAI routes; it decodes the token
itself when the text is None).

What the server sends (so an engine can rely on it): `generate` receives single requests only
(batches are split by the server), always with a `rid` (the client's, or a fresh unique one; a
rid already running is refused with a 400 before it reaches the engine). Sampling parameters
hold only the fields the client sent (`model_fields_set`), so `SamplingDefaults.apply` can put
the model's defaults under them. The server has already checked token ids against
`model_info()["vocab_size"]`, token-id prompts against `max_context_length`, text prompts'
length in characters against `max_context_length` times `radixlm.sampling.max_token_chars`
of `tokenizer` (a text longer than that cannot fit whatever its tokens), and a
`custom_logit_processor` (present only when the server enables them, and loadable with
`CustomLogitProcessor.from_str`). OpenAI chat requests arrive as `input_ids` (the chat template
is rendered and tokenized by the server, without adding special tokens again); completions
arrive as `text` or `input_ids` as the client sent them. `response_format` and
`tool_choice: "required"` / named arrive as `sampling_params.json_schema`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from radixlm.sampling import GenerateRequest


@runtime_checkable
class EngineClient(Protocol):
    """The engine interface the HTTP server consumes.

    All coroutine methods are called from the server's event loop and must not block it.

    Optional (not part of the structural check; the server looks for it with `getattr` and
    answers 400 "this engine does not support beam search" without it):

        async def beam_search(request: GenerateRequest, beam_width: int, *,
                              length_penalty: float = 1.0,
                              early_stopping: bool = False) -> list[dict[str, Any]]

    Beam search over one single request's prompt (`/v1/completions` with `use_beam_search`):
    `max_new_tokens`, `ignore_eos` and `skip_special_tokens` come from its sampling params. It
    returns the `beam_width` best sequences, best first, as final chunks (`index` is the rank;
    `meta_info` may add `score`, the cumulative logprob over generated_len ** length_penalty).
    Errors are raised as for `generate`; cancelling it aborts whatever it has running.
    """

    def generate(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Run one single (already split) request; yield its output chunks.

        With `request.stream` true, yield a chunk whenever a sequence has new output (text and
        output_ids cumulative); otherwise yield only each sequence's final chunk. For
        `sampling_params.n > 1`, chunks of the n sequences interleave, told apart by `index`.
        The iterator ends once every sequence has finished. Bad input raises
        `radixlm.sampling.InvalidRequest` before the first chunk (grammar errors, a prompt longer
        than the context, token ids outside the vocabulary); an overloaded engine raises
        `radixlm.sampling.EngineOverloaded`. An InvalidRequest's `field` is reported to the client
        as the error's `param` (the server renames `text` / `input_ids` to `prompt` / `messages` on
        the OpenAI routes). Closing the iterator early (`aclose()`, or a CancelledError thrown in
        at an await, when the client disconnects) aborts the request in the engine and releases
        everything it held.
        """
        ...

    async def abort(self, rid: str) -> bool:
        """Abort a request by id; its stream ends with finish_reason `abort` (one final chunk per
        unfinished sequence). False if unknown."""
        ...

    async def flush_cache(self) -> bool:
        """Drop every unlocked entry of the prefix cache. False if requests are running."""
        ...

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/get_model_info`: `model_path`, `tokenizer_path`, `is_generation`,
        `max_context_length`, `vocab_size`, `chat_template` (None if the model has none),
        `eos_token_ids`, and anything else the engine wants to report."""
        ...

    def server_info(self) -> dict[str, Any]:
        """Config and live stats, JSON-serialisable. `/metrics` exports these keys when present
        (at the top level or one level down): `num_running_reqs`, `num_queued_reqs`,
        `cache_hit_rate` (0..1), `token_usage` (0..1)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (chat templates, token counting, token-id texts), read
        once when the app is created and then used from the server's worker threads."""
        ...
