"""Drop-in behaviour for SGLang, vLLM and OpenAI clients (issue 15's numbered items), on the
real engine, each request sent the way the named client sends it (the `openai` client's
`extra_body` for SGLang / vLLM fields, SGLang's `/generate` body as its frontend sends it)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

USER: Any = [{"role": "user", "content": "Say something."}]


def test_chat_without_max_tokens_runs_until_the_context_is_full(
    client: openai.OpenAI, server: Any
) -> None:
    # Item 1: OpenAI's chat has no token cap by default (random weights: no EOS).
    reply = client.chat.completions.create(
        model="tiny-llama", messages=USER, extra_body={"ignore_eos": True}
    )
    usage = reply.usage
    assert usage is not None and reply.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == server.engine.context_length


def test_completions_without_max_tokens_stop_at_openais_sixteen(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="tiny-llama", prompt="Once", extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 16


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(
    client: openai.OpenAI, server: Any, route: str
) -> None:
    # Item 2: OpenAI / vLLM answer 400, not a clamped 200.
    context = server.engine.context_length
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=context)
        else:
            client.completions.create(model="tiny-llama", prompt="Once", max_tokens=context)
    error = raised.value
    assert error.param == "max_tokens", error.body
    assert f"maximum context length is {context} tokens" in str(error)
    assert "you requested" in str(error)


def test_generate_max_new_tokens_beyond_the_context_is_a_400(http: Any, server: Any) -> None:
    context = server.engine.context_length
    body = {"text": "Once", "sampling_params": {"max_new_tokens": context}}
    response = http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "sampling_params.max_new_tokens"


def test_the_clamp_opt_in_cuts_max_tokens_to_the_context(serve: Any) -> None:
    import httpx

    served = serve(clamp_max_tokens=True)
    context = served.engine.context_length
    body = {"text": "Once", "sampling_params": {"max_new_tokens": context, "ignore_eos": True}}
    with httpx.Client(base_url=served.url, timeout=120) as http:
        meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["prompt_tokens"] + meta["completion_tokens"] == context


def test_sampling_seed_is_sglangs_name_for_seed(http: Any, client: openai.OpenAI) -> None:
    # Item 3: SGLang's frontend sends sampling_params.sampling_seed.
    def native(params: dict[str, Any]) -> list[int]:
        body = {"text": "Once", "sampling_params": {"max_new_tokens": 6, **params}}
        response = http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return list(response.json()["output_ids"])

    assert native({"sampling_seed": 7, "temperature": 1.0}) == native(
        {"seed": 7, "temperature": 1.0}
    )
    one = client.completions.create(
        model="tiny-llama", prompt="Once", max_tokens=6, extra_body={"sampling_seed": 3}
    )
    two = client.completions.create(model="tiny-llama", prompt="Once", max_tokens=6, seed=3)
    assert one.choices[0].text == two.choices[0].text


def test_model_default_is_the_served_model_and_unknown_names_are_404(
    client: openai.OpenAI,
) -> None:
    # Item 4: SGLang's documentation calls the model "default".
    reply = client.chat.completions.create(model="default", messages=USER, max_tokens=2)
    assert reply.model == "tiny-llama"
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    assert "tiny-llama" in str(raised.value)


def test_logprob_token_ids_alone_turn_logprobs_on(http: Any) -> None:
    # Item 6: asking for the logprobs of given ids asks for logprobs.
    body = {
        "text": "Once",
        "sampling_params": {"max_new_tokens": 3, "logprob_token_ids": [5, 9]},
    }
    meta = http.post("/generate", json=body).json()["meta_info"]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == 3 and all(sorted(e[1] for e in row) == [5, 9] for row in rows)
    assert len(meta["output_token_logprobs"]) == 3


def test_vllm_zero_and_minus_one_values(serve: Any, http: Any, server: Any) -> None:
    # Item 7: top_k=0 is no cap (as -1); logprobs=-1 / prompt_logprobs=-1 the whole vocabulary.
    def ids(params: dict[str, Any], client: Any = http) -> Any:
        body = {"text": "Once", "sampling_params": {"max_new_tokens": 4, "seed": 1, **params}}
        return client.post("/generate", json=body)

    assert ids({"top_k": 0}).json()["output_ids"] == ids({"top_k": -1}).json()["output_ids"]
    refused = ids({"logprobs": -1})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "sampling_params.logprobs" and "--max-logprobs" in error["message"]
    import httpx

    vocab = server.engine.model_info()["vocab_size"]
    unlimited = serve(max_logprobs=-1)
    with httpx.Client(base_url=unlimited.url, timeout=60) as other:
        meta = ids({"logprobs": -1, "prompt_logprobs": -1}, other).json()["meta_info"]
    assert all(len(row) == vocab for row in meta["output_top_logprobs"])
    assert all(len(row) == vocab for row in meta["input_top_logprobs"][1:])


def test_vllm_logprobs_within_the_limit_work(http: Any) -> None:
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 2, "logprobs": 20}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert [len(row) for row in meta["output_top_logprobs"]] == [20, 20]


CHOICES = ["red", "green", "blue"]
CONSTRAINT_BODIES: dict[str, Any] = {
    "choice": {"choice": CHOICES},
    "structured_outputs.choice": {"structured_outputs": {"choice": CHOICES}},
    "guided_choice": {"guided_choice": CHOICES},
    "structured_outputs.regex": {"structured_outputs": {"regex": "(red|green|blue)"}},
    "guided_regex": {"guided_regex": "(red|green|blue)"},
    "structured_outputs.json": {
        "structured_outputs": {"json": {"type": "string", "enum": CHOICES}}
    },
    "guided_json": {"guided_json": {"type": "string", "enum": CHOICES}},
    "structured_outputs.grammar": {
        "structured_outputs": {"grammar": 'root ::= "red" | "green" | "blue"'}
    },
    "guided_grammar": {"guided_grammar": 'root ::= "red" | "green" | "blue"'},
}


@pytest.mark.parametrize("name", list(CONSTRAINT_BODIES))
def test_vllm_and_sglang_constraint_fields_on_both_openai_routes(
    client: openai.OpenAI, name: str
) -> None:
    # Item 8: choice, structured_outputs and guided_* all map onto the one constraint.
    extra = CONSTRAINT_BODIES[name]
    chat = client.chat.completions.create(
        model="tiny-llama", messages=USER, max_tokens=12, extra_body=extra
    )
    text = chat.choices[0].message.content or ""
    completion = client.completions.create(
        model="tiny-llama", prompt="Colour:", max_tokens=12, extra_body=extra
    )
    for output in (text, completion.choices[0].text):
        value = json.loads(output) if name.endswith("json") else output
        assert value in CHOICES, (name, output)


def test_two_constraints_are_refused_naming_the_second(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model="tiny-llama",
            prompt="x",
            max_tokens=2,
            extra_body={"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}},
        )
    assert raised.value.param == "structured_outputs.choice"


def test_grammar_errors_name_the_field_the_client_sent(client: openai.OpenAI, http: Any) -> None:
    # Item 10: one naming: the request's own field, on every route.
    bad_regex = "(unclosed"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model="tiny-llama", prompt="x", max_tokens=2, extra_body={"guided_regex": bad_regex}
        )
    assert raised.value.param == "guided_regex"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="tiny-llama", messages=USER, max_tokens=2, extra_body={"regex": bad_regex}
        )
    assert raised.value.param == "regex"
    bad_schema = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="tiny-llama",
            messages=USER,
            max_tokens=2,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": bad_schema},
            },  # type: ignore[typeddict-item]
        )
    assert raised.value.param == "response_format"
    native = http.post(
        "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": bad_regex}},
    )
    assert native.status_code == 400
    assert native.json()["error"]["param"] == "sampling_params.regex"


def test_logprob_start_len_beyond_the_prompt_is_a_400(http: Any) -> None:
    # Item 11: not clamped silently.
    body = {
        "input_ids": [1, 2, 3],
        "return_logprob": True,
        "logprob_start_len": 3,
        "sampling_params": {"max_new_tokens": 1},
    }
    response = http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logprob_start_len" and "3 tokens" in error["message"]
    body["logprob_start_len"] = 2
    assert http.post("/generate", json=body).status_code == 200


def test_streamed_logprobs_are_the_new_tokens_only_with_a_running_length(http: Any) -> None:
    # Item 5: SGLang streams each chunk's new logprobs plus output_token_logprobs_length.
    body: dict[str, Any] = {
        "text": "Once",
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    whole = http.post("/generate", json=body).json()["meta_info"]
    assert whole["output_token_logprobs_length"] == 8
    entries: list[Any] = []
    tops: list[Any] = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            meta = json.loads(line[5:])["meta_info"]
            new = meta["output_token_logprobs"]
            assert meta["output_token_logprobs_length"] == len(entries) + len(new)
            assert len(meta["output_top_logprobs"]) == len(new)
            entries += new
            tops += meta["output_top_logprobs"]
    assert [e[1] for e in entries] == [e[1] for e in whole["output_token_logprobs"]]
    assert [e[0] for e in entries] == pytest.approx([e[0] for e in whole["output_token_logprobs"]])
    assert len(tops) == 8


def test_sglangs_documented_custom_logit_processor_example_runs(http: Any, serve: Any) -> None:
    # Item 12: SGLang's example, with radixlm's base class, the class defined right here (so
    # it travels by value, SGLang's dill form) and sent as SGLang's client sends it.
    from radixlm.sampling import CustomLogitProcessor

    class DeterministicLogitProcessor(CustomLogitProcessor):
        """A dummy logit processor that changes the logits to always sample the given token id."""

        def __call__(self, logits: Any, custom_param_list: Any) -> Any:
            # Check that the number of logits matches the number of custom parameters
            assert logits.shape[0] == len(custom_param_list)
            key = "token_id"
            for i, param_dict in enumerate(custom_param_list):
                # Mask all other tokens
                logits[i, :] = -float("inf")
                # Assign highest probability to the specified token
                logits[i, param_dict[key]] = 0.0
            return logits

    body = {
        "text": "The capital of France is",
        "custom_logit_processor": DeterministicLogitProcessor().to_str(),
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": 8,
            "custom_params": {"token_id": 5},
            "ignore_eos": True,
        },
    }
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["output_ids"] == [5] * 8
    import httpx

    locked = serve()  # custom logit processors not enabled: refused, as SGLang does
    with httpx.Client(base_url=locked.url, timeout=60) as other:
        refused = other.post("/generate", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "custom_logit_processor"


def _stream_chunks(http: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


def test_stream_interval_sends_n_tokens_per_chunk_first_and_last_at_once(
    http: Any, serve: Any
) -> None:
    # vLLM's stream_interval, per request and as the engine's default. A reader that falls
    # behind the engine gets the chunks that queued up merged into one (the engine's
    # `_stream_async`), so the sizes a chunk may have are checked, not how many arrive: a
    # tiny model on the CPU decode path outruns the HTTP reader.
    params = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0}
    body: dict[str, Any] = {"text": "Once", "sampling_params": {**params, "stream_interval": 4}}
    sizes = [len(c["output_ids"]) for c in _stream_chunks(http, body)]  # cumulative ids
    _assert_chunk_sizes(sizes, allowed={1, 5, 9, 10})
    every = [
        len(c["output_ids"]) for c in _stream_chunks(http, {**body, "sampling_params": params})
    ]
    _assert_chunk_sizes(every, allowed=set(range(1, 11)))
    import httpx

    served = serve(stream_interval=3)
    with httpx.Client(base_url=served.url, timeout=60) as other:
        sizes = [
            len(c["output_ids"])
            for c in _stream_chunks(other, {"text": "Once", "sampling_params": params})
        ]
    _assert_chunk_sizes(sizes, allowed={1, 4, 7, 10})


def _assert_chunk_sizes(sizes: list[int], allowed: set[int]) -> None:
    """Cumulative chunk sizes: growing, each one a size the interval allows, ending at all
    ten tokens."""
    assert sizes == sorted(set(sizes)) and set(sizes) <= allowed and sizes[-1] == 10, sizes


def test_detokenize_false_returns_token_ids_only(http: Any) -> None:
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 5, "detokenize": False}}
    out = http.post("/generate", json=body).json()
    assert out["text"] == "" and len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
    body["sampling_params"]["stop"] = ["x"]  # type: ignore[index]
    refused = http.post("/generate", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "sampling_params.stop"


def test_extra_args_reach_the_custom_logit_processor(http: Any) -> None:
    from radixlm.runtime.fixtures import ForceTokenProcessor

    body = {
        "text": "Once",
        "custom_logit_processor": ForceTokenProcessor.to_str(),
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "extra_args": {"token_id": 7}},
    }
    assert http.post("/generate", json=body).json()["output_ids"] == [7] * 4


def test_responses_api_through_the_official_client_on_the_engine(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny-llama", input="Say hi.", max_output_tokens=4)
    assert first.status in ("completed", "incomplete") and first.usage is not None
    assert 1 <= first.usage.output_tokens <= 4 and isinstance(first.output_text, str)
    second = client.responses.create(
        model="default", input="And again.", previous_response_id=first.id, max_output_tokens=2
    )
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens
    deltas: list[str] = []
    kinds: list[str] = []
    last: Any = None
    # The client's get_final_response() wants response.completed; a cut by
    # max_output_tokens ends in response.incomplete (as OpenAI's), so read the last event.
    with client.responses.stream(model="tiny-llama", input="Stream.", max_output_tokens=3) as s:
        for event in s:
            kinds.append(event.type)
            last = event
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == last.response.output_text
