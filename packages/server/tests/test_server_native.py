"""The native routes against a live server on the toy engine, including SGLang's doc examples."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import server_fake_engine as fake  # loaded by conftest.py

from radixlm.server import ServerConfig

GREEDY = {"temperature": 0, "max_new_tokens": 32}


def sse_payloads(response: httpx.Response) -> list[Any]:
    """The data of each SSE event; the final `[DONE]` is kept as the string."""
    out: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_returns_text_ids_and_meta_info(http: httpx.Client) -> None:
    body = http.post("/generate", json={"text": "Hello", "sampling_params": GREEDY}).json()
    assert body["text"] == fake.DEFAULT_TEXT
    assert len(body["output_ids"]) == body["meta_info"]["completion_tokens"]
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "stop"
    assert meta["prompt_tokens"] > 0 and "cached_tokens" in meta and "id" in meta
    assert "index" not in body


def test_generate_batch_answers_each_prompt_in_order(http: httpx.Client) -> None:
    body = http.post(
        "/generate",
        json={
            "text": ["one <<say:first:say>>", "two <<say:second:say>>"],
            "rid": ["batch-a", "batch-b"],
            "sampling_params": GREEDY,
        },
    ).json()
    assert [item["text"] for item in body] == ["first", "second"]
    assert [item["meta_info"]["id"] for item in body] == ["batch-a", "batch-b"]
    assert [item["index"] for item in body] == [0, 1]


def test_generate_takes_token_ids(http: httpx.Client, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello <<say:ok:say>>")
    body = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert body["text"] == "ok"
    assert body["meta_info"]["prompt_tokens"] == len(ids)


def test_streamed_text_is_cumulative_and_ends_with_done(http: httpx.Client) -> None:
    # SGLang's documented client loop: print data["text"][prev:] for each chunk.
    request = {"text": "Hi", "sampling_params": GREEDY, "stream": True}
    with http.stream("POST", "/generate", json=request) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 3
    printed, prev = "", 0
    for chunk in chunks:
        assert chunk["text"].startswith(printed)
        printed += chunk["text"][prev:]
        prev = len(chunk["text"])
    assert printed == fake.DEFAULT_TEXT
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_streamed_batch_chunks_carry_their_index(http: httpx.Client) -> None:
    request = {
        "text": ["<<say:aa:say>>", "<<say:bbbb:say>>"],
        "sampling_params": GREEDY,
        "stream": True,
    }
    with http.stream("POST", "/generate", json=request) as response:
        chunks = sse_payloads(response)[:-1]
    last = {c["index"]: c["text"] for c in chunks}
    assert last == {0: "aa", 1: "bbbb"}


def test_generate_with_n_returns_n_sequences(http: httpx.Client) -> None:
    params = {**GREEDY, "n": 3, "max_new_tokens": 2}
    body = http.post("/generate", json={"text": "x", "sampling_params": params}).json()
    assert [item["index"] for item in body] == [0, 1, 2]
    assert len({item["text"] for item in body}) == 3


def test_logprobs_are_sglang_triples(http: httpx.Client) -> None:
    request = {
        "text": "Hi",
        "sampling_params": {**GREEDY, "max_new_tokens": 4},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = http.post("/generate", json=request).json()["meta_info"]
    triples = meta["output_token_logprobs"]
    assert len(triples) == 4
    for logprob, token_id, text in triples:
        assert isinstance(logprob, float) and isinstance(token_id, int) and isinstance(text, str)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_zero_new_tokens_scores_the_prompt(http: httpx.Client, tokenizer: Any) -> None:
    # What the DSL's select() relies on: prompt logprobs, no generation.
    request = {
        "text": "Paris is the capital of France",
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    body = http.post("/generate", json=request).json()
    prompt_ids = tokenizer.encode("Paris is the capital of France")
    scored = body["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scored] == prompt_ids
    assert scored[0][0] is None and all(isinstance(lp, float) for lp, _, _ in scored[1:])
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"]["type"] == "length"


def test_sglang_json_schema_example(http: httpx.Client, engine: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"],
    }
    params = {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(schema)}
    body = http.post(
        "/generate",
        json={"text": "Here is the capital of France in JSON:", "sampling_params": params},
    ).json()
    value = json.loads(body["text"])
    assert isinstance(value["name"], str) and isinstance(value["population"], int)
    assert json.loads(str(engine.received[-1].params.json_schema)) == schema


def test_sglang_regex_example(http: httpx.Client, engine: Any) -> None:
    params = {"temperature": 0, "max_new_tokens": 8, "regex": "(France|England)"}
    body = http.post(
        "/generate", json={"text": "Paris is the capital of", "sampling_params": params}
    ).json()
    assert body["text"] in ("France", "England")
    assert engine.received[-1].params.regex == "(France|England)"


def test_sglang_ebnf_example(http: httpx.Client, engine: Any) -> None:
    grammar = 'root ::= "Hello" | "Hi" | "Hey"'
    params = {"temperature": 0, "max_new_tokens": 8, "ebnf": grammar}
    body = http.post("/generate", json={"text": "Write a greeting.", "sampling_params": params})
    assert body.json()["text"] in ("Hello", "Hi", "Hey")
    assert engine.received[-1].params.ebnf == grammar


def test_custom_logit_processor_runs_when_enabled(http: httpx.Client) -> None:
    request = {
        "text": "anything",
        "sampling_params": {"max_new_tokens": 5, "custom_params": {"token_id": 42}},
        "custom_logit_processor": fake.ForceToken.to_str(),
    }
    body = http.post("/generate", json=request).json()
    assert body["output_ids"] == [42] * 5


def test_custom_logit_processor_is_refused_when_disabled(make_server: Any) -> None:
    live, engine = make_server(ServerConfig(), enable_custom_logit_processor=False)
    request = {
        "text": "anything",
        "sampling_params": {"custom_params": {"token_id": 42}},
        "custom_logit_processor": fake.ForceToken.to_str(),
    }
    response = httpx.post(f"{live.url}/generate", json=request)
    assert response.status_code == 400
    error = response.json()["error"]
    # The engine owns the check; its message reaches the client as it is.
    assert error["param"] == "custom_logit_processor"
    assert "custom logit processors are disabled on this engine" in error["message"]
    assert engine.active == {}


def test_a_rid_in_use_is_refused_by_the_engine_while_the_first_runs_on(
    http: httpx.Client, engine: Any
) -> None:
    first = {
        "text": "long",
        "rid": "twice",
        "stream": True,
        "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
    }
    with http.stream("POST", "/generate", json=first) as response:
        lines = response.iter_lines()
        next(line for line in lines if line)
        again = http.post("/generate", json={"text": "x", "rid": "twice"})
        assert again.status_code == 400
        assert again.json()["error"]["param"] == "rid"
        assert http.get("/get_server_info").json()["http_requests_in_flight"] == 1
        assert http.post("/abort_request", json={"rid": "twice"}).json()["aborted"] == 1
        last = [line for line in lines if line][-2]
    assert json.loads(last[6:])["meta_info"]["finish_reason"]["type"] == "abort"


def test_health_answers_200(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200


def test_health_generate_runs_one_token(http: httpx.Client, engine: Any) -> None:
    assert http.get("/health_generate").status_code == 200
    assert engine.received[-1].params.max_new_tokens == 1


def test_health_generate_is_503_when_the_engine_cannot_generate(make_server: Any) -> None:
    live, _ = make_server(ServerConfig(), max_queued=0)
    response = httpx.get(f"{live.url}/health_generate")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "unhealthy"


def test_model_info_describes_the_model(http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == "toy/fake-model"
    assert info["max_context_length"] == 512 and info["vocab_size"] > 0
    assert info["is_generation"] is True and info["chat_template"]


def test_server_info_has_engine_stats_and_server_config(http: httpx.Client) -> None:
    info = http.get("/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["cache_hit_rate"] == 0.25
    assert info["server_config"]["served_model_name"] == "toy"
    assert "version" in info


def test_server_info_masks_the_api_key(make_server: Any) -> None:
    live, _ = make_server(ServerConfig(api_key="secret"))
    headers = {"Authorization": "Bearer secret"}
    info = httpx.get(f"{live.url}/get_server_info", headers=headers).json()
    assert info["server_config"]["api_key"] == "***"


def test_flush_cache_succeeds_when_idle(http: httpx.Client) -> None:
    response = http.post("/flush_cache")
    assert response.status_code == 200 and response.json()["success"] is True


def test_abort_request_ends_a_stream_with_finish_reason_abort(
    http: httpx.Client, engine: Any
) -> None:
    request = {
        "text": "long",
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
    }
    aborted: list[Any] = []
    with http.stream("POST", "/generate", json=request) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["meta_info"]["finish_reason"] is None
        aborted.append(http.post("/abort_request", json={"rid": "abort-me"}).json())
        rest = [line[5:].strip() for line in lines if line.startswith("data:")]
    assert aborted == [{"success": True, "aborted": 1}]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    assert "abort-me" in engine.aborted


def test_abort_of_an_unknown_request_reports_failure(http: httpx.Client) -> None:
    assert http.post("/abort_request", json={"rid": "nope"}).json()["success"] is False


def test_abort_all_aborts_every_running_request(http: httpx.Client, engine: Any) -> None:
    results: list[Any] = []

    def run(rid: str) -> None:
        params = {"max_new_tokens": 100_000, "ignore_eos": True}
        body = {"text": "x", "rid": rid, "sampling_params": params}
        results.append(http.post("/generate", json=body).json())

    threads = [threading.Thread(target=run, args=(f"all-{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    while len(engine.active) < 3:
        threading.Event().wait(0.01)
    assert http.post("/abort_request", json={"abort_all": True}).json()["aborted"] == 3
    for thread in threads:
        thread.join()
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort"] * 3


def test_metrics_count_requests_and_tokens(http: httpx.Client) -> None:
    http.post("/generate", json={"text": "count me", "sampling_params": GREEDY})
    text = http.get("/metrics").text
    assert 'radixlm_requests_total{finish_reason="stop",route="/generate"}' in text
    assert 'sglang:generation_tokens_total{model_name="toy"}' in text
    assert "sglang:e2e_request_latency_seconds_bucket" in text
    assert "sglang:num_running_reqs{" in text and "sglang:cache_hit_rate{" in text


def test_metrics_route_is_absent_unless_enabled(make_server: Any) -> None:
    live, _ = make_server(ServerConfig())
    assert httpx.get(f"{live.url}/metrics").status_code == 404


def test_metrics_count_refused_requests(http: httpx.Client) -> None:
    http.post("/generate", json={"text": "a", "sampling_params": {"top_p": 0}})
    assert 'radixlm_request_errors_total{status="400"}' in http.get("/metrics").text


def test_infinite_logprobs_become_a_finite_floor(http: httpx.Client) -> None:
    request = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
               "top_logprobs_num": 3}  # fmt: skip
    for stream in (False, True):
        response = http.post("/generate", json={**request, "stream": stream})
        assert response.status_code == 200 and "Infinity" not in response.text
        assert "-9999.0" in response.text
