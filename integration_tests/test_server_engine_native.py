"""SGLang's native API on the real engine: the examples of SGLang's documentation, prompt
scoring, custom logit processors, and the control routes.

The model has random weights, so tests assert what the server and engine guarantee (shapes,
constraints, determinism, accounting), never what the text says.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest

from radixlm.runtime.fixtures import ForceTokenProcessor

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


def _sse_payloads(response: httpx.Response) -> list[str]:
    return [
        line[len("data:") :].strip() for line in response.iter_lines() if line.startswith("data:")
    ]


def test_plain_generate_answers_sglang_shape(http: httpx.Client) -> None:
    response = http.post(
        "/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
        },
    )
    assert response.status_code == 200
    body = response.json()
    assert isinstance(body["text"], str)
    assert len(body["output_ids"]) == 16
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 16
    assert meta["prompt_tokens"] > 0
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert "index" not in body


def test_greedy_generate_is_deterministic_and_reuses_the_prefix(http: httpx.Client) -> None:
    body = {
        "text": "radix attention reuses the cache of a shared prefix",
        "sampling_params": GREEDY,
    }
    first = http.post("/generate", json=body).json()
    second = http.post("/generate", json=body).json()
    assert first["output_ids"] == second["output_ids"]
    assert second["meta_info"]["cached_tokens"] == second["meta_info"]["prompt_tokens"] - 1


def test_streaming_loop_of_the_sglang_docs_rebuilds_the_text(http: httpx.Client) -> None:
    # 64 tokens: a reader slower than the decode gets the chunks that queued up merged into
    # one (12 tokens on the tiny model could all arrive as a single chunk on a loaded machine).
    request = {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
        "stream": True,
    }
    printed = ""
    prev = 0
    seen_done = False
    texts: list[str] = []
    with http.stream("POST", "/generate", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.iter_lines():  # SGLang's documented client loop
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    seen_done = True
                    break
                data = json.loads(chunk[5:].strip("\n"))
                output = data["text"]
                printed += output[prev:]
                prev = len(output)
                texts.append(output)
    assert seen_done
    assert len(texts) > 1
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    final = http.post("/generate", json={**request, "stream": False}).json()
    assert printed == final["text"]


def test_batch_generate_answers_one_output_per_prompt_with_indexes(http: httpx.Client) -> None:
    body = {"text": ["one prompt", "another prompt"], "sampling_params": {**GREEDY, "n": 2}}
    outputs = http.post("/generate", json=body).json()
    assert [o["index"] for o in outputs] == [0, 1, 2, 3]
    assert all(o["meta_info"]["finish_reason"] is not None for o in outputs)


def test_json_schema_output_validates(http: httpx.Client) -> None:
    # SGLang's documented example, with bounds so that a random model must finish in time.
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[\\w]{1,8}$"},
            "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        },
        "required": ["name", "population"],
        "additionalProperties": False,
    }
    body = {
        "text": "Here is the information of the capital of France in the JSON format.\n",
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 96,
            "json_schema": json.dumps(schema),
        },
    }
    out = http.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_matches(http: httpx.Client, temperature: float) -> None:
    body = {
        "text": "Paris is the capital of",
        "sampling_params": {
            "temperature": temperature,
            "max_new_tokens": 16,
            "regex": "(France|England)",
        },
    }
    out = http.post("/generate", json=body).json()
    assert re.fullmatch("(France|England)", out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ebnf_output_is_a_sentence_of_the_grammar(http: httpx.Client, temperature: float) -> None:
    body = {
        "text": "Write a greeting.",
        "sampling_params": {
            "temperature": temperature,
            "max_new_tokens": 16,
            "ebnf": 'root ::= "Hello" | "Hi" | "Hey"',
        },
    }
    out = http.post("/generate", json=body).json()
    assert out["text"] in ("Hello", "Hi", "Hey")


def test_streamed_regex_output_matches(http: httpx.Client) -> None:
    body = {
        "text": "London is the capital of",
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 16, "regex": "(France|England)"},
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body) as response:
        payloads = _sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    last = json.loads(payloads[-2])
    assert re.fullmatch("(France|England)", last["text"])


def test_prompt_scoring_returns_the_logprobs_generation_gave(http: httpx.Client) -> None:
    prompt = "Q: What is the capital of France?\nA:"
    generated = http.post(
        "/generate",
        json={
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "return_logprob": True,
        },
    ).json()
    prompt_len = generated["meta_info"]["prompt_tokens"]
    prompt_ids = http.post(
        "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
              "logprob_start_len": 0},
    ).json()["meta_info"]["input_token_logprobs"]  # fmt: skip
    ids = [entry[1] for entry in prompt_ids] + generated["output_ids"]
    scored = http.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": prompt_len,
        },
    ).json()
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["completion_tokens"] == 0
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == generated["output_ids"]
    expected = [e[0] for e in generated["meta_info"]["output_token_logprobs"]]
    assert [e[0] for e in entries] == pytest.approx(expected, abs=1e-3)


def test_prompt_scoring_from_the_start_has_no_logprob_for_the_first_token(
    http: httpx.Client,
) -> None:
    out = http.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7, 8, 9],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [5, 6, 7, 8, 9]
    assert entries[0][0] is None
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in entries[1:])
    tops = out["meta_info"]["input_top_logprobs"]
    assert tops[0] is None and all(len(t) == 2 for t in tops[1:])


def test_output_logprobs_are_triples_one_per_token(http: httpx.Client) -> None:
    out = http.post(
        "/generate",
        json={
            "text": "logprobs please",
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    ).json()
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    assert all(len(e) == 3 and e[0] <= 0 for e in entries)
    assert [len(t) for t in meta["output_top_logprobs"]] == [3] * 5
    # Greedy: the chosen token is the most likely one.
    assert all(t[0][1] == e[1] for t, e in zip(meta["output_top_logprobs"], entries, strict=True))
    assert all(
        sum(math.exp(t[0]) for t in top) <= 1.0 + 1e-4 for top in meta["output_top_logprobs"]
    )


def test_custom_logit_processor_forces_its_token(http: httpx.Client) -> None:
    token = 42
    out = http.post(
        "/generate",
        json={
            "text": "The capital of France is",
            "custom_logit_processor": ForceTokenProcessor.to_str(),
            "sampling_params": {
                "temperature": 1.0,
                "max_new_tokens": 6,
                "custom_params": {"token_id": token},
            },
        },
    ).json()
    assert out["output_ids"] == [token] * 6


def test_custom_logit_processor_is_refused_when_disabled(serve: Callable[..., Any]) -> None:
    served = serve({"enable_custom_logit_processor": False})
    with httpx.Client(base_url=served.url, timeout=30) as http:
        response = http.post(
            "/generate",
            json={
                "text": "x",
                "custom_logit_processor": ForceTokenProcessor.to_str(),
                "sampling_params": {"max_new_tokens": 2, "custom_params": {"token_id": 3}},
            },
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "custom_logit_processor"
        # The engine's own check and message, the same as its Python API gives.
        assert "custom logit processors are disabled on this engine" in error["message"]
        assert http.get("/health_generate").status_code == 200


def test_model_info_reports_the_engine_model(http: httpx.Client, server: Any) -> None:
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True
    assert info["max_context_length"] == server.engine.context_length
    assert info["vocab_size"] == server.engine.info.vocab_size
    assert info["served_model_name"] == server.model_name


def test_server_info_reports_cache_and_scheduler_stats(http: httpx.Client) -> None:
    http.post("/generate", json={"text": "stats", "sampling_params": GREEDY})
    info = http.get("/get_server_info").json()
    for key in ("num_running_reqs", "num_queued_reqs", "cache_hit_rate", "token_usage"):
        assert key in info
    assert info["server_config"]["served_model_name"] == "tiny-llama"
    assert info["prompt_tokens"] > 0


def test_flush_cache_drops_cached_prefixes(http: httpx.Client, server: Any) -> None:
    body = {"text": "flush me please, the cache holds this", "sampling_params": GREEDY}
    http.post("/generate", json=body)
    server.wait_idle()
    assert http.post("/flush_cache").status_code == 200
    assert server.engine.server_info()["cache_size"] == 0
    again = http.post("/generate", json=body).json()
    assert again["meta_info"]["cached_tokens"] == 0


def test_flush_cache_is_refused_while_a_request_runs(http: httpx.Client, server: Any) -> None:
    body = {
        "text": "keep running",
        "sampling_params": {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True},
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)
        with httpx.Client(base_url=server.url) as other:
            refused = other.post("/flush_cache")
        assert server.engine.server_info()["num_running_reqs"] == 1
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "busy"
    server.assert_no_leaks()


def test_abort_request_ends_a_running_stream_with_abort(http: httpx.Client, server: Any) -> None:
    body = {
        "text": "a long answer",
        "rid": "to-abort",
        "sampling_params": {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True},
        "stream": True,
    }
    last: dict[str, Any] = {}
    aborted = False
    with http.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            last = json.loads(line[5:])
            # (at least 2: chunks that queue up behind a slow reader arrive merged)
            if len(last["output_ids"]) >= 2 and not aborted:
                aborted = True
                with httpx.Client(base_url=server.url) as other:
                    answer = other.post("/abort_request", json={"rid": "to-abort"}).json()
                assert answer["success"] is True
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 1000
    server.assert_no_leaks()


def test_metrics_count_requests_and_tokens(http: httpx.Client) -> None:
    http.post("/generate", json={"text": "metrics", "sampling_params": GREEDY})
    text = http.get("/metrics").text
    assert "radixlm" in text
    counts = re.findall(
        r'^radixlm\S*requests\S*_total\{[^}]*route="/generate"[^}]*\} (\S+)$', text, re.M
    )
    assert counts and sum(float(c) for c in counts) >= 1
    # SGLang's names, the engine's gauges among them, labelled with the served model.
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:num_used_tokens", "sglang:max_total_num_tokens",
                 "sglang:cache_hit_rate", "sglang:gen_throughput",
                 "sglang:num_retracted_requests_total", "sglang:generation_tokens_total"):  # fmt: skip
        assert re.search(rf'^{name}\{{[^}}]*model_name="tiny-llama"', text, re.M), name
    # Queue time from the real engine's timestamps: one observation per finished request.
    queued = re.search(r"^sglang:queue_time_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert queued and float(queued.group(1)) >= 1
