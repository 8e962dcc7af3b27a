"""EngineClient: what the server needs from an engine, as a structural Protocol.

The server never imports an engine. Anything with these members can be served by
`create_app(engine, config)`: radixlm's own `radixlm.runtime.Engine`, a remote-engine proxy, or a
test double. The runtime satisfies it structurally (it does not import this module).

Output chunks are `radixlm.sampling.GenerateChunk`s, frozen dataclasses the server reads by
attribute; `chunk.to_json()` writes SGLang's `/generate` response layout (`index`, `text`,
`output_ids`, `meta_info`), the one place that layout is written, and is what `/generate`
answers. A chunk holds `rid`, `index` (which of the request's n sequences, 0 when n == 1),
`text` and `output_ids` (that sequence's output so far), `prompt_tokens`, `completion_tokens`,
`cached_tokens` (prompt tokens served from the prefix cache), `e2e_latency` (seconds since the
request arrived) and `finish_reason`: None until the sequence's last chunk, then a
`FinishReason(type="stop" | "length" | "abort", matched=token id | stop string | None,
message=...)`. When the request asked for logprobs they are tuples of
`LogprobEntry(logprob, token_id, text)`: `output_token_logprobs` and `input_token_logprobs`
one entry per token, `output_top_logprobs`, `input_top_logprobs` and the
`*_token_ids_logprobs` one tuple of entries per position (None where a position has none);
other `meta_info` keys an engine reports go in `extra`.

A sequence's `text` only ever grows: each chunk's text starts with the previous one's (hold
back what a stop string may still trim, and incomplete UTF-8), since the server sends clients
the difference. Output logprobs may be cumulative like `text` (one entry per output token so
far) or hold only the new tokens' entries (radixlm's engine streams them so, as SGLang does,
with the running count in `output_token_logprobs_length`); the server accepts both. An entry
carries its `text` when the request set `return_text_in_logprobs` (the server sets it on
OpenAI routes; it decodes the token itself when the text is None).

What the server sends (so an engine can rely on it): `generate` receives single requests only
(batches are split by the server), always with a `rid` (the client's, or a fresh unique one).
Sampling parameters hold only the fields the client sent (`model_fields_set`), so
`SamplingDefaults.apply` can put the model's defaults under them. The engine validates what
it owns, once, with the same message for its own API and for HTTP: token ids against its
vocabulary, the prompt against its context (a `text` prompt best before tokenizing it, when
its length in characters alone cannot fit: `radixlm.sampling.check_text_fits`),
`custom_logit_processor` (allowed or not, and loadable), a `rid` already in use
(`InvalidRequest` naming `rid`). The server checks before calling the engine only what it
alone knows: its routes' fields, and the chats it renders, whose length in characters it
checks against `max_context_length` times `radixlm.sampling.max_token_chars` of `tokenizer`
before rendering and tokenizing them. OpenAI chat requests arrive as `input_ids` (the chat
template is rendered and tokenized by the server, without adding special tokens again);
completions arrive as `text` or `input_ids` as the client sent them. `response_format` and
`tool_choice: "required"` / named arrive as `sampling_params.json_schema`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from radixlm.sampling import GenerateChunk, GenerateRequest


@runtime_checkable
class EngineClient(Protocol):
    """The engine interface the HTTP server consumes.

    All coroutine methods are called from the server's event loop and must not block it.

    Optional members (not part of the structural check; the server looks for them with
    `getattr`):

        async def beam_search(request: GenerateRequest, beam_width: int, *,
                              length_penalty: float = 1.0,
                              early_stopping: bool = False) -> list[GenerateChunk]

    Beam search over one single request's prompt (`/v1/completions` with `use_beam_search`;
    without it that is a 400 "this engine does not support beam search"): `max_new_tokens`,
    `ignore_eos` and `skip_special_tokens` come from its sampling params. It returns the
    `beam_width` best sequences, best first, as final chunks (`index` is the rank; `score` may
    hold the cumulative logprob over generated_len ** length_penalty). Errors are raised as for
    `generate`; cancelling it aborts whatever it has running.

        async def encode(request: EmbeddingRequest) -> EmbeddingOutput

    A pooling model's output for one single (already split) `radixlm.sampling.EmbeddingRequest`,
    always with a `rid` (the client's or a fresh one), for `/v1/embeddings`, `/v1/rerank`,
    `/v1/score`, `/v1/classify` and `/encode` (without it those routes answer a 400 "this
    engine does not serve pooling models"). `embedding` holds what `model_info()["pooling"]`'s
    task says: task embed, the pooled vector (cut to `dimensions` and normalised as asked);
    classify, the classifier's logits, one per label; score, a cross-encoder's logit(s) for
    the pair (`text`, `text_pair`); reward, the reward model's raw score(s). `prompt_tokens`
    counts the tokens pooled (after `truncate_prompt_tokens`); the routes' usage sums it.
    Errors are raised as for `generate`: `InvalidRequest` (a 400 with its field as `param`:
    a prompt longer than the context, token ids outside the vocabulary, an unknown
    `lora_path`, `dimensions` above the model's), `EngineOverloaded` and `EngineUnavailable`
    (503). The server runs the inputs of a call concurrently; cancelling the coroutine (the
    client went away, or another input of the call failed) aborts the request in the engine.
    A pooling model's `model_info()` says `is_generation: False` and describes the model as
    `pooling: {"task": "embed" | "classify" | "score" | "reward", "method": "last" | "mean" |
    "cls", "normalize": bool, "num_labels": int, "id2label": {"0": "LABEL_0", ...},
    "hidden_size": int}` (None, or absent, for a generative model). The generation routes
    (`/generate`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses`) refuse a
    model whose `is_generation` is False; the pooling routes refuse one without `pooling`
    (SGLang's form of `/v1/score`, with `label_token_ids`, calls `generate` instead, asking
    for one token's `token_ids_logprob`), and `/health_generate` probes a pooling model with
    one `encode`.

        healthy: bool  # a property, read on every /health

    False while the engine cannot serve (its process died and is restarting, or it shut
    down): `/health` then answers 503. An engine without it counts as healthy.

        def load_lora_adapter(lora_name: str, lora_path: str) -> Awaitable[dict[str, str] | None]
        def unload_lora_adapter(lora_name: str) -> Awaitable[dict[str, str] | None]
        def lora_adapters() -> dict[str, str]

    LoRA adapters (SGLang's `/load_lora_adapter` and `/unload_lora_adapter`; without these
    members those routes answer a 400 "this engine does not support LoRA adapters" and only
    the base model is served). `load_lora_adapter` loads the PEFT directory `lora_path` under
    `lora_name`; `unload_lora_adapter` removes an adapter: requests already running on it
    finish, new ones naming it are refused. Both return at once with an awaitable (radixlm's
    `Reply`, a coroutine) that resolves once the engine has done it, to the adapters then
    loaded (name -> path; None: the server reads `lora_adapters()`), and must not block the
    event loop; a failure raises `radixlm.sampling.InvalidRequest` naming
    `lora_name` or `lora_path` with what is wrong (a name already loaded, or unknown, a path
    that is missing or not an adapter, a rank or target modules the engine cannot hold), a
    400 naming that field. `lora_adapters()` is synchronous and cheap (it is read on every
    OpenAI request whose `model` is not the base model's name, and on `/v1/models`): the
    adapters loaded now, name -> path, in the order they were loaded. A request for an
    adapter arrives as `GenerateRequest.lora_path` (its name; one per single request, as
    `split()` gives it): an OpenAI request whose `model` is an adapter's name (vLLM's
    convention) or `<served name>:<adapter>` (SGLang's), or that sent `lora_path` (SGLang's
    field), and any `/generate` request with `lora_path`. The engine refuses an unknown name
    with `InvalidRequest` naming `lora_path` (the server reports it under the field the
    client used: `model` or `lora_path`).

        def update_weights_from_disk(model_path, flush_cache, weight_version) -> dict
        def update_weights_from_tensor(named_tensors, *, load_format, flush_cache,
                                       weight_version) -> dict
        def init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                      *, group_name, backend) -> dict
        def update_weights_from_distributed(names, dtypes, shapes, *, group_name,
                                            flush_cache, weight_version) -> dict
        def get_weights_by_name(name, truncate_size) -> list
        def pause_generation(mode) / continue_generation()
        def release_memory_occupation(tags) -> dict
        def resume_memory_occupation(tags) -> dict

    A rollout engine for reinforcement learning (SGLang's names; without a member its route
    answers a 400 "this engine cannot ..."). Each returns its result or an awaitable of it,
    and must not block the event loop while the engine works: SGLang's `{"success",
    "message"}` (with `weight_version` for the updates), a refusal being `success: false`
    with a message saying why. `update_weights_from_tensor` gets from the server
    `load_format="flattened_bucket"` and `named_tensors` as SGLang's bucket dict
    `{"flattened_tensor": bytes, "metadata": [{"name", "shape", "dtype", "start_idx",
    "end_idx"}]}` (byte offsets, torch dtype names such as `bfloat16`), and raises
    `InvalidRequest` for an entry that does not fit the buffer. `dtypes` are torch's names
    too. `release_memory_occupation` / `resume_memory_occupation` take None (all) or a list
    of `weights`, `kv_cache`, `cuda_graph`.
    """

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Run one single (already split) request; yield its output chunks.

        With `request.stream` true, yield a chunk whenever a sequence has new output (text and
        output_ids cumulative); otherwise yield only each sequence's final chunk. For
        `sampling_params.n > 1`, chunks of the n sequences interleave, told apart by `index`.
        The iterator ends once every sequence has finished. Bad input raises
        `radixlm.sampling.InvalidRequest` before the first chunk (grammar errors, a prompt longer
        than the context, token ids outside the vocabulary, a rid in use); an overloaded engine
        raises `radixlm.sampling.EngineOverloaded` (a 503) before the first chunk. An engine
        that stops serving (its process died, it shut down) raises
        `radixlm.sampling.EngineUnavailable`, before the first chunk or between chunks: a 503,
        or an error event ending the stream once chunks were sent. An InvalidRequest's `field`
        is reported to the client as the error's `param` (the server renames `text` /
        `input_ids` to `prompt` / `messages` on the OpenAI routes). Closing the iterator early
        (`aclose()`, or a CancelledError thrown in at an await, when the client disconnects)
        aborts the request in the engine and releases everything it held.
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
        """SGLang's `/get_model_info`: `model_path`, `tokenizer_path`, `is_generation` (False
        for a pooling model; absent counts as True), `pooling` (None for a generative model,
        else the pooling model's task, method, normalize, num_labels, id2label and
        hidden_size: see `encode` above), `max_context_length`, `vocab_size`, `chat_template`
        (None if the model has none), `eos_token_ids`, and anything else the engine wants to
        report. Read once, when the server first needs it."""
        ...

    def server_info(self) -> dict[str, Any]:
        """Config and live stats, JSON-serialisable. `/metrics` exports these keys when present
        (at the top level or one level down): `num_running_reqs`, `num_queued_reqs`,
        `cache_hit_rate` (0..1), `token_usage` (0..1), `max_total_num_tokens` (KV token
        slots), `generated_tokens` (cumulative; its rate is `sglang:gen_throughput`),
        `num_retractions` (cumulative), `avg_spec_accept_length`, `spec_draft_tokens` and
        `spec_accepted_tokens`. It is read at every scrape, from a worker thread."""
        ...

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (chat templates, token counting, token-id texts), read
        once when the app is created and then used from the server's worker threads."""
        ...
