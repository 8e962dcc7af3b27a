"""Where each request field of radixlm's HTTP API comes from (OpenAI, SGLang, vLLM or radixlm
itself) and how radixlm's behaviour differs from the original, for docs/http-api.md.

`ORIGINS[model][field]` is "origin" or "origin: difference"; `"*"` is the model's default
(fields of OpenAI's own sub-objects, say). gen_http_api.py fails when a field of a request
model has no entry and no default, so every new field gets its line here.
"""

from __future__ import annotations

OAI, S, V, R = "OpenAI", "SGLang", "vLLM", "radixlm"

_SAMPLING_EXTRAS = {
    "top_k": f"{S} / {V}: 0 and -1 both mean no cap (vLLM's 0 accepted)",
    "min_p": f"{S} / {V}",
    "repetition_penalty": f"{S} / {V}",
    "min_tokens": V,
    "stop_token_ids": f"{S} / {V}",
    "stop_regex": S,
    "ignore_eos": f"{S} / {V}",
    "skip_special_tokens": f"{S} / {V}",
    "spaces_between_special_tokens": f"{S} / {V}",
    "no_stop_trim": S,
    "include_stop_str_in_output": V,
    "allowed_token_ids": V,
    "bad_words": V,
    "repetition_detection": V,
    "regex": S,
    "json_schema": S,
    "ebnf": S,
    "structural_tag": S,
    "choice": f"{S} (/generate) / {V}: also on the OpenAI routes",
    "structured_outputs": f"{V}: json, regex, choice, grammar (EBNF), json_object, "
    "structural_tag; whitespace_pattern is refused (the server's --json-whitespace decides)",
    "guided_json": f"{V} (older name of structured_outputs.json)",
    "guided_regex": f"{V} (older name)",
    "guided_choice": f"{V} (older name)",
    "guided_grammar": f"{V} (older name; EBNF)",
    "guided_whitespace_pattern": f"{V} (older name): refused, as whitespace_pattern",
    "guided_decoding_backend": f"{V} (older): refused; the server's --grammar-backend decides",
    "strict_constraint": f"{R}: refuse constraints the grammar alone does not enforce",
    "thinking_token_budget": f"{V}: enforced by forcing </think> after N thinking tokens",
    "custom_params": S,
    "custom_logit_processor": f"{S}: reference or SGLang's dill form; needs "
    "--enable-custom-logit-processor",
    "rid": f"{S}: the request id (abort_request takes it)",
    "sampling_seed": f"{S}: alias of seed",
}
_OPENAI_SHARED = {
    "model": f"{OAI}: the served name or 'default', or a LoRA adapter ('name' as {V}, "
    f"'served:name' as {S}); any other name is a 404",
    "lora_path": f"{S}: a LoRA adapter's name; a 400 when `model` names another one",
    "priority": f"{V} / {S}: needs --enable-priority-scheduling, else a 400",
    "timeout": f"{R}: seconds from arrival; past them finish_reason abort, output kept",
    "bootstrap_host": f"{S}: prefill/decode disaggregation: the prefill server's bootstrap "
    "host; required by a decode server, a 400 on a colocated one",
    "bootstrap_port": f"{S}: the prefill server's bootstrap port (its "
    "--disaggregation-bootstrap-port); required by a decode server, a 400 on a colocated one",
    "bootstrap_room": f"{S}: a random id in [0, 2**63) pairing a request's prefill and decode "
    "halves (/v1/completions: a list, one per prompt); required by prefill and decode servers, "
    "a 400 on a colocated one",
    "n": OAI,
    "stream": OAI,
    "stream_options": f"{OAI} (continuous_usage_stats: {V})",
    "user": f"{OAI}: accepted, unused",
    "max_tokens": f"{OAI}: past the context a 400 naming both numbers (--clamp-max-tokens cuts it)",
    "temperature": OAI,
    "top_p": OAI,
    "stop": OAI,
    "seed": OAI,
    "logit_bias": OAI,
    "presence_penalty": OAI,
    "frequency_penalty": OAI,
    **_SAMPLING_EXTRAS,
}

ORIGINS: dict[str, dict[str, str]] = {
    "GenerateRequest": {
        "*": S,
        "input_embeds": f"{S}: cached by a hash of each row, never shared with token prompts",
        "image_data": f"{S}: one image_token placeholder per image in the prompt; refused by "
        "text-only models",
        "video_data": f"{S}: one video_token placeholder per video in the prompt; refused by "
        "models without video",
        "audio_data": f"{S}: refused (no audio models yet)",
        "lora_path": f"{S}: a loaded LoRA adapter's name (a list for a batch); unknown: a 400",
        "return_routed_experts": f"{S}: mixture-of-experts models, with "
        "--enable-return-routed-experts; meta_info.routed_experts: base64 int32 "
        "[tokens, layers, top_k]",
        "routed_experts_start_len": f"{S}: in [0, prompt_tokens], else a 400",
        "priority": f"{S}: needs --enable-priority-scheduling, else a 400; larger runs "
        "first unless --schedule-low-priority-values-first",
        "timeout": f"{R}: seconds from arrival; past them finish_reason abort, output kept",
        "require_reasoning": f"{S}: a constraint applies after </think>; needs "
        "--reasoning-parser, else a 400",
        "bootstrap_host": f"{S}: prefill/decode disaggregation: the prefill server's bootstrap "
        "host; required by a decode server, a 400 on a colocated one",
        "bootstrap_port": f"{S}: the prefill server's bootstrap port (its "
        "--disaggregation-bootstrap-port); required by a decode server, a 400 on a colocated "
        "one",
        "bootstrap_room": f"{S}: a random id in [0, 2**63) pairing a request's prefill and "
        "decode halves (a batch: a list of distinct rooms); required by prefill and decode "
        "servers, a 400 on a colocated one",
        "logprob_start_len": f"{S}: at or past the prompt's length a 400 (not clamped)",
        "token_ids_logprob": f"{S}: turns logprobs on by itself",
        "return_hidden_states": f"{S}: the prompt is recomputed, not served from the cache",
        "stream": f"{S}: streamed logprobs are the new tokens' only, with "
        "output_token_logprobs_length",
    },
    "SamplingParams": {
        "*": S,
        "max_new_tokens": f"{S}: default 128; past the context a 400 "
        "(engine clamp_max_tokens cuts it)",
        "min_new_tokens": S,
        "include_stop_str_in_output": V,
        "repetition_detection": R,
        "thinking_token_budget": _SAMPLING_EXTRAS["thinking_token_budget"],
        "top_k": _SAMPLING_EXTRAS["top_k"],
        "allowed_token_ids": V,
        "bad_words": V,
        "seed": f"{S} / {V} (sampling_seed is accepted as its alias)",
        "choice": S,
        "strict_constraint": _SAMPLING_EXTRAS["strict_constraint"],
        "detokenize": f"{V}: false returns token ids only; stop strings are then refused",
        "stream_interval": f"{V}: tokens per streamed chunk; first and last chunks at once",
        "logprobs": f"{V}: -1 is the whole vocabulary, bounded by --max-logprobs",
        "prompt_logprobs": f"{V}: -1 is the whole vocabulary, bounded by --max-logprobs",
        "logprob_token_ids": f"{V}: turns logprobs on by itself",
        "extra_args": f"{V}: reach custom logit processors under custom_params' keys",
        "flat_logprobs": f"{V}: columns (logprobs, token_ids, texts, offsets), not a list per "
        "token",
    },
    "RepetitionDetection": {"*": R},
    "ContentPart": {
        "*": OAI,
        "image_url": f"{OAI}: also a bare URL string; the model's image_token stands for it",
        "video_url": f"{V} / {S}: the model's video_token stands for it",
    },
    "MediaURL": {"*": OAI, "detail": f"{OAI}: accepted, ignored"},
    "StreamOptions": {"*": OAI, "continuous_usage_stats": V},
    "StructuredOutputs": {"*": V, "whitespace_pattern": f"{V}: refused"},
    "CompletionRequest": {
        **_OPENAI_SHARED,
        "max_tokens": f"{OAI}: default 16 (as OpenAI's and SGLang's completions); past the "
        "context a 400 (--clamp-max-tokens cuts it)",
        "prompt": OAI,
        "echo": OAI,
        "logprobs": f"{OAI}: at most 20",
        "best_of": f"{OAI}: equal to n, or the beam width with use_beam_search",
        "suffix": f"{OAI}: refused (no fill-in-the-middle)",
        "use_beam_search": f"{V}: beam width best_of or n; not with stream or logprobs",
        "length_penalty": V,
        "early_stopping": V,
    },
    "ChatCompletionRequest": {
        **_OPENAI_SHARED,
        "max_tokens": f"{OAI}: no default cap (until a stop or the context is full); past the "
        "context a 400 (--clamp-max-tokens cuts it)",
        "messages": OAI,
        "max_completion_tokens": f"{OAI}: as max_tokens",
        "logprobs": OAI,
        "top_logprobs": f"{OAI}: at most 20",
        "response_format": OAI,
        "tools": OAI,
        "tool_choice": OAI,
        "parallel_tool_calls": OAI,
        "chat_template_kwargs": f"{S} / {V} (e.g. enable_thinking)",
        "separate_reasoning": f"{S}: with --reasoning-parser, reasoning_content apart",
        "modalities": f"{OAI}: only ['text']",
        "metadata": f"{OAI}: accepted, unused",
        "store": f"{OAI}: accepted, unused",
        "service_tier": f"{OAI}: accepted, unused",
        "safety_identifier": f"{OAI}: accepted, unused",
        "prompt_cache_key": f"{OAI}: accepted, unused (the radix cache needs no key)",
        "prompt_cache_retention": f"{OAI}: accepted, unused",
        "prompt_cache_options": f"{OAI}: accepted, unused",
        "reasoning_effort": f"{OAI}: accepted, unused",
        "verbosity": f"{OAI}: accepted, unused",
        "audio": f"{OAI}: refused",
        "prediction": f"{OAI}: refused",
        "web_search_options": f"{OAI}: refused",
        "functions": f"{OAI} (deprecated): refused; use tools",
        "function_call": f"{OAI} (deprecated): refused; use tool_choice",
        "moderation": f"{OAI}: refused",
    },
    "ResponsesRequest": {
        "*": OAI,
        "model": _OPENAI_SHARED["model"],
        "previous_response_id": f"{OAI}: over an in-memory LRU store (--response-store-size)",
        "store": f"{OAI}: kept in this process's memory only",
        "background": f"{OAI}: refused",
        "conversation": f"{OAI}: refused",
        "prompt": f"{OAI}: refused",
        "max_tool_calls": f"{OAI}: refused",
        "stream_options": f"{OAI}: refused",
        "include": f"{OAI}: accepted, ignored",
        "reasoning": f"{OAI}: accepted, ignored",
        "truncation": f"{OAI}: accepted, ignored",
        "service_tier": f"{OAI}: accepted, ignored",
        "tools": f"{OAI}: function tools only (no built-in tools)",
    },
    # The pooling routes (packages/server/src/radixlm/server/pooling.py).
    "EmbeddingsRequest": {
        "*": OAI,
        "model": _OPENAI_SHARED["model"],
        "user": f"{OAI}: accepted, unused",
        "encoding_format": OAI,
        "dimensions": f"{OAI}: the first n values, normalised again when the model normalises",
        "truncate_prompt_tokens": V,
        "normalize": V,
    },
    "RerankRequest": {
        "*": f"{V} / Jina / Cohere",
        "model": _OPENAI_SHARED["model"],
        "user": f"{V}: accepted, unused",
        "top_n": f"{V} / Jina / Cohere: none or 0 is every document",
        "return_documents": "Jina / Cohere",
        "truncate_prompt_tokens": V,
    },
    "RerankDocument": {"*": "Jina / Cohere"},
    "ScoreRequest": {
        "*": V,
        "model": _OPENAI_SHARED["model"],
        "user": f"{V}: accepted, unused",
    },
    "GenerativeScoreRequest": {
        "*": S,
        "model": _OPENAI_SHARED["model"],
        "label_token_ids": f"{S}: its presence chooses this form of /v1/score",
    },
    "ClassifyRequest": {
        "*": V,
        "model": _OPENAI_SHARED["model"],
        "user": f"{V}: accepted, unused",
        "input": f"{V}: also token ids, as /v1/embeddings",
    },
    "EmbeddingRequest": {
        "*": S,
        "truncate_prompt_tokens": V,
        "dimensions": f"{S} / {V}",
        "normalize": V,
    },
    # The rollout engine's routes (packages/server/src/radixlm/server/weights.py).
    "UpdateWeightsFromDisk": {
        "*": S,
        "load_format": f"{S}: only safetensors checkpoints are read (auto, safetensors)",
    },
    "UpdateWeightsFromTensor": {
        "*": S,
        "named_tensors": f"{R}: instead of SGLang's pickles",
        "flattened_bucket": f"{R}: SGLang's flattened bucket as base64 and JSON, not a pickle",
        "safetensors": R,
        "serialized_named_tensors": f"{S}: refused (unpickling runs the sender's code)",
        "load_format": f"{S}: direct or flattened_bucket (the form sent says which)",
    },
    "NamedTensorData": {"*": R},
    "FlattenedBucketData": {"*": R},
    "BucketEntry": {"*": S},
    "InitWeightsUpdateGroup": {"*": S, "backend": f"{S}: default gloo (SGLang's: nccl)"},
    "UpdateWeightsFromDistributed": {"*": S},
    "GetWeightsByName": {"*": S},
    "PauseGeneration": {"*": S},
    "MemoryOccupation": {
        "*": S,
        "tags": f"{S}: cuda_graph holds nothing on CPUs; resuming a tag not released does nothing",
    },
}
#: Sub-objects of OpenAI's request shapes (messages, tools, formats): OpenAI's.
DEFAULT = OAI


def origin_of(model: str, field: str) -> str:
    """The origin text of `field` of `model`; KeyError for a request model's unknown field."""
    table = ORIGINS.get(model)
    if table is None:
        return DEFAULT
    if field in table:
        return table[field]
    if "*" in table:
        return table["*"]
    raise KeyError(f"{model}.{field} has no origin in tools/docs/field_origins.py; add it")
