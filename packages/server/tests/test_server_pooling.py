"""The pooling routes (`/v1/embeddings`, `/v1/rerank`, `/v1/score`, `/v1/classify`, `/encode`)
over an engine's `encode`, SGLang's generative `/v1/score`, and the refusals between pooling
and generative models. The fake pooling engine computes its outputs from the prompt's tokens,
so the expected values are computed here the same way."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import openai
import pytest
import server_fake_engine as fake  # loaded by conftest.py
from starlette.testclient import TestClient

from radixlm.sampling import EmbeddingRequest
from radixlm.server import ServerConfig, create_app

CONFIG = ServerConfig(served_model_name="toy", enable_metrics=True)
DOCS = ["lazy dog sleeps", "a quick brown fox", "the fox by the river bank"]
QUERY = "fox near the river"


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v - max(values)) for v in values]
    return [e / sum(exps) for e in exps]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def overlap(a: str, b: str) -> float:
    """The fake cross-encoder's logit for a pair."""
    return len(set(a.split()) & set(b.split())) - 1.0


class Served:
    """An app around one engine, reached through starlette's TestClient."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.http = TestClient(create_app(engine, CONFIG))

    def post(self, path: str, body: Any) -> Any:
        return self.http.post(path, json=body)

    def ok(self, path: str, body: Any) -> Any:
        response = self.post(path, body)
        assert response.status_code == 200, response.text
        return response.json()

    def error(self, path: str, body: Any, status: int = 400) -> dict[str, Any]:
        response = self.post(path, body)
        assert response.status_code == status, response.text
        error: dict[str, Any] = response.json()["error"]
        return error

    def vector(self, text: str, **fields: Any) -> list[float]:
        """What the fake embedder returns for `text`."""
        request = EmbeddingRequest(text=text, **fields)
        return list(self.engine.pooled(request, self.engine.prompt_of(request)))

    def tokens(self, text: str) -> int:
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))


class NoEncodeEngine(fake.FakeEngine):
    """Says it serves an embedding model but has no `encode`."""

    def model_info(self) -> dict[str, Any]:
        return {**super().model_info(), "is_generation": False, "pooling": {"task": "embed"}}


@pytest.fixture(scope="module")
def serve(tokenizer: Any) -> Iterator[Callable[..., Served]]:
    made: dict[str, Served] = {}

    def get(task: str) -> Served:
        if task not in made:
            if task == "generate":
                engine = fake.FakeEngine(tokenizer)
            elif task == "no-encode":
                engine = NoEncodeEngine(tokenizer)
            else:
                engine = fake.PoolingFakeEngine(tokenizer, task=task, max_context_length=64)
            made[task] = Served(engine)
            made[task].http.__enter__()
        return made[task]

    yield get
    for served in made.values():
        served.http.__exit__(None, None, None)


@pytest.fixture
def embedder(serve: Callable[..., Served]) -> Served:
    return serve("embed")


@pytest.fixture
def cross_encoder(serve: Callable[..., Served]) -> Served:
    return serve("score")


# /v1/embeddings


def test_embeddings_answer_openais_shape_with_one_vector_per_input_in_order(
    embedder: Served,
) -> None:
    texts = ["Hello", "the quick brown fox", "Hi"]
    body = embedder.ok("/v1/embeddings", {"model": "toy", "input": texts})
    assert body["object"] == "list" and body["model"] == "toy"
    assert body["id"].startswith("embd-") and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"embedding"}
    for item, text in zip(body["data"], texts, strict=True):
        assert item["embedding"] == pytest.approx(embedder.vector(text))
    tokens = sum(embedder.tokens(t) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_embeddings_take_a_single_text_and_token_ids(embedder: Served) -> None:
    single = embedder.ok("/v1/embeddings", {"input": "Hello"})
    assert len(single["data"]) == 1
    ids = embedder.ok("/v1/embeddings", {"input": [5, 6, 7]})
    assert len(ids["data"]) == 1 and ids["usage"]["prompt_tokens"] == 3
    assert embedder.engine.encoded[-1].input_ids == [5, 6, 7]
    lists = embedder.ok("/v1/embeddings", {"input": [[5, 6], [7]]})
    assert [d["index"] for d in lists["data"]] == [0, 1]
    assert lists["usage"]["prompt_tokens"] == 3


def test_base64_embeddings_are_little_endian_float32(embedder: Served) -> None:
    body = embedder.ok("/v1/embeddings", {"input": ["Hello", "Hi"], "encoding_format": "base64"})
    for item, text in zip(body["data"], ["Hello", "Hi"], strict=True):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(embedder.vector(text), abs=1e-6)


def test_dimensions_normalize_and_truncation_reach_the_engine(embedder: Served) -> None:
    body = embedder.ok(
        "/v1/embeddings",
        {"input": "the quick brown fox", "dimensions": 4, "normalize": False,
         "truncate_prompt_tokens": 2},
    )  # fmt: skip
    sent = embedder.engine.encoded[-1]
    assert (sent.dimensions, sent.normalize, sent.truncate_prompt_tokens) == (4, False, 2)
    assert len(body["data"][0]["embedding"]) == 4
    assert body["usage"]["prompt_tokens"] == 2


def test_truncation_minus_one_keeps_what_the_context_holds(embedder: Served) -> None:
    embedder.ok("/v1/embeddings", {"input": "Hello", "truncate_prompt_tokens": -1})
    assert embedder.engine.encoded[-1].truncate_prompt_tokens == 64


def test_the_inputs_of_a_call_run_at_once(embedder: Served) -> None:
    embedder.engine.peak = 0
    embedder.ok("/v1/embeddings", {"input": ["a", "b", "c", "d"]})
    assert embedder.engine.peak == 4


def test_the_openai_client_creates_embeddings(embedder: Served) -> None:
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=embedder.http, max_retries=0
    )
    # The client asks for base64 unless told otherwise, and decodes it.
    result = client.embeddings.create(model="toy", input=["Hello", "Hi there"])
    assert [d.index for d in result.data] == [0, 1]
    assert result.data[1].embedding == pytest.approx(embedder.vector("Hi there"), abs=1e-6)
    assert result.usage.prompt_tokens == embedder.tokens("Hello") + embedder.tokens("Hi there")
    short = client.embeddings.create(
        model="toy", input="Hello", dimensions=3, encoding_format="float"
    )
    assert short.data[0].embedding == pytest.approx(embedder.vector("Hello", dimensions=3))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "Hello", "dimensions": 0}, "dimensions"),
        ({"input": "Hello", "dimensions": 99}, "dimensions"),
        ({"input": "Hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "Hello", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "Hello", "stream": True}, "stream"),
        ({"input": ["fine", "<<fail>>"]}, "input"),
        ({"input": "word " * 100}, "input"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(
    embedder: Served, body: dict[str, Any], param: str
) -> None:
    assert embedder.error("/v1/embeddings", body)["param"] == param


def test_one_failing_input_cancels_the_others(embedder: Served) -> None:
    closed = len(embedder.engine.closed_early)
    embedder.error("/v1/embeddings", {"input": ["a", "<<fail>>", "b"]})
    assert len(embedder.engine.closed_early) == closed + 2


def test_an_unknown_model_is_a_404(embedder: Served) -> None:
    assert (
        embedder.error("/v1/embeddings", {"model": "nope", "input": "a"}, 404)["param"] == "model"
    )


# /v1/rerank


def test_rerank_orders_documents_by_a_cross_encoders_sigmoid(cross_encoder: Served) -> None:
    body = cross_encoder.ok("/v1/rerank", {"model": "toy", "query": QUERY, "documents": DOCS})
    assert body["id"].startswith("rerank-") and body["model"] == "toy"
    expected = {i: sigmoid(overlap(QUERY, d)) for i, d in enumerate(DOCS)}
    assert [r["index"] for r in body["results"]] == [2, 1, 0]
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]])
        assert result["document"] == {"text": DOCS[result["index"]]}
    pairs = [(r.text, r.text_pair) for r in cross_encoder.engine.encoded[-3:]]
    assert sorted(pairs) == sorted((QUERY, d) for d in DOCS)
    tokens = sum(cross_encoder.tokens(QUERY) + cross_encoder.tokens(d) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_cuts_to_top_n_and_may_leave_documents_out(cross_encoder: Served) -> None:
    body = cross_encoder.ok(
        "/rerank",
        {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
         "return_documents": False},
    )  # fmt: skip
    assert [r["index"] for r in body["results"]] == [2, 1]
    assert all("document" not in r for r in body["results"])


def test_rerank_on_an_embedding_model_scores_by_cosine(embedder: Served) -> None:
    body = embedder.ok("/v1/rerank", {"query": QUERY, "documents": DOCS})
    query = embedder.vector(QUERY)
    scores = {i: cosine(query, embedder.vector(d)) for i, d in enumerate(DOCS)}
    assert [r["index"] for r in body["results"]] == sorted(scores, key=lambda i: -scores[i])
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(scores[result["index"]])
    # The query is embedded once, each document once.
    assert [r.text for r in embedder.engine.encoded[-4:]] == [QUERY, *DOCS]


def test_rerank_names_the_field_of_a_bad_document(cross_encoder: Served) -> None:
    error = cross_encoder.error("/v1/rerank", {"query": "q", "documents": ["a", "<<fail>>"]})
    assert error["param"] == "documents"
    assert (
        cross_encoder.error("/v1/rerank", {"query": "<<fail>>", "documents": ["a"]})["param"]
        == "query"
    )
    assert cross_encoder.error("/v1/rerank", {"query": "q", "documents": []})["param"] == (
        "documents"
    )


# /v1/score


def test_score_pairs_one_text_with_many(cross_encoder: Served) -> None:
    body = cross_encoder.ok("/v1/score", {"model": "toy", "text_1": QUERY, "text_2": DOCS})
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"score"}
    for item, doc in zip(body["data"], DOCS, strict=True):
        assert item["score"] == pytest.approx(sigmoid(overlap(QUERY, doc)))


def test_score_pairs_texts_one_to_one(cross_encoder: Served) -> None:
    firsts = ["fox river", "lazy dog"]
    body = cross_encoder.ok("/score", {"text_1": firsts, "text_2": DOCS[1:]})
    expected = [sigmoid(overlap(a, b)) for a, b in zip(firsts, DOCS[1:], strict=True)]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected)


def test_score_on_an_embedding_model_is_the_cosine(embedder: Served) -> None:
    body = embedder.ok("/v1/score", {"text_1": "fox", "text_2": ["fox", "dog"]})
    scores = [d["score"] for d in body["data"]]
    assert scores[0] == pytest.approx(1.0)
    assert scores[1] == pytest.approx(cosine(embedder.vector("fox"), embedder.vector("dog")))


def test_score_refuses_mismatched_lengths(cross_encoder: Served) -> None:
    error = cross_encoder.error("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert error["param"] == "text_2" and "1 to N" in error["message"]
    assert cross_encoder.error("/v1/score", {"text_1": "a", "text_2": []})["param"] == "text_2"


# SGLang's /v1/score (label_token_ids) on a generative model


def test_generative_score_reads_the_label_tokens_logprobs(serve: Callable[..., Served]) -> None:
    served = serve("generate")
    labels = [5, 6]
    body = served.ok(
        "/v1/score",
        {"query": "Is this a fox? ", "items": ["yes", "no way"], "label_token_ids": labels},
    )
    assert body["object"] == "scoring" and body["model"] == "toy"
    sent = served.engine.received[-2:]
    assert sorted(r.text for r in sent) == ["Is this a fox? no way", "Is this a fox? yes"]
    for request in sent:
        assert request.return_logprob and request.token_ids_logprob == labels
        assert request.params.max_new_tokens == 1 and request.params.temperature == 0
    for scores, item in zip(body["scores"], ["yes", "no way"], strict=True):
        length = served.tokens("Is this a fox? " + item)
        expected = [math.exp(fake.FakeEngine.token_id_logprob(t, length)) for t in labels]
        assert scores == pytest.approx(expected)
    assert body["usage"]["prompt_tokens"] == sum(
        served.tokens("Is this a fox? " + i) for i in ["yes", "no way"]
    )


def test_generative_score_softmax_item_first_and_token_ids(serve: Callable[..., Served]) -> None:
    served = serve("generate")
    body = served.ok(
        "/score",
        {"query": [10, 11], "items": [[20], [21, 22]], "label_token_ids": [3, 4, 5],
         "apply_softmax": True, "item_first": True},
    )  # fmt: skip
    assert sorted(r.input_ids for r in served.engine.received[-2:]) == [[20, 10, 11],
                                                                       [21, 22, 10, 11]]  # fmt: skip
    for scores, length in zip(body["scores"], [3, 4], strict=True):
        logprobs = [fake.FakeEngine.token_id_logprob(t, length) for t in [3, 4, 5]]
        assert scores == pytest.approx(softmax(logprobs))
        assert sum(scores) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": "q", "items": [[1]], "label_token_ids": [1]}, "items"),
        ({"query": [1], "items": ["a"], "label_token_ids": [1]}, "items"),
        ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": [-1]}, "label_token_ids"),
        ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
    ],
)
def test_bad_generative_score_requests_are_400s(
    serve: Callable[..., Served], body: dict[str, Any], param: str
) -> None:
    assert serve("generate").error("/v1/score", body)["param"] == param


def test_generative_score_needs_a_generative_model(embedder: Served) -> None:
    error = embedder.error("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1]})
    assert "generative model" in error["message"] and "text_1" in error["message"]


# /v1/classify


def test_classify_answers_softmax_probabilities_and_the_argmax_label(
    serve: Callable[..., Served],
) -> None:
    served = serve("classify")
    texts = ["Hello", "the quick brown fox jumps"]
    body = served.ok("/v1/classify", {"model": "toy", "input": texts})
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for item, text in zip(body["data"], texts, strict=True):
        logits = served.vector(text)
        probs = softmax(logits)
        assert item["probs"] == pytest.approx(probs)
        assert item["num_classes"] == 3
        assert item["label"] == fake.CLASS_LABELS[str(probs.index(max(probs)))]
    assert [d["index"] for d in body["data"]] == [0, 1]


def test_classify_reports_a_reward_models_raw_score(serve: Callable[..., Served]) -> None:
    served = serve("reward")
    body = served.ok("/classify", {"input": "the quick brown fox"})
    item = body["data"][0]
    assert item["probs"] == pytest.approx([0.5 * served.tokens("the quick brown fox")])
    assert (item["label"], item["num_classes"]) == ("LABEL_0", 1)


def test_classify_on_a_cross_encoder_is_the_sigmoid(cross_encoder: Served) -> None:
    body = cross_encoder.ok("/v1/classify", {"input": ["Hello"]})
    assert body["data"][0]["probs"] == pytest.approx([sigmoid(0.1 * cross_encoder.tokens("Hello"))])


# /encode


def test_encode_answers_sglangs_shape_single_and_batch(serve: Callable[..., Served]) -> None:
    served = serve("classify")
    single = served.ok("/encode", {"text": "Hello", "rid": "mine"})
    assert single["embedding"] == pytest.approx(served.vector("Hello"))
    assert single["meta_info"]["id"] == "mine"
    assert single["meta_info"]["prompt_tokens"] == served.tokens("Hello")
    batch = served.ok("/encode", {"input_ids": [[5, 6], [7]]})
    assert [len(b["embedding"]) for b in batch] == [3, 3]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 1]


def test_encode_refuses_a_bad_body(embedder: Served) -> None:
    assert embedder.error("/encode", {"text": ["a"], "rid": "one"})["param"] == "rid"


# What fits which model.


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "Hi"}),
        ("/v1/completions", {"model": "toy", "prompt": "Hi"}),
        ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"model": "toy", "input": "Hi"}),
    ],
)
def test_a_pooling_model_refuses_generation(embedder: Served, path: str, body: Any) -> None:
    error = embedder.error(path, body)
    assert "pooling model (task embed)" in error["message"]
    assert "/v1/embeddings" in error["message"]
    assert embedder.engine.received == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": "Hi"}),
        ("/v1/rerank", {"query": "q", "documents": ["a"]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/classify", {"input": "Hi"}),
        ("/encode", {"text": "Hi"}),
    ],
)
def test_a_generative_model_refuses_pooling(
    serve: Callable[..., Served], path: str, body: Any
) -> None:
    error = serve("generate").error(path, body)
    assert error["message"].startswith("this model generates text")
    assert error["code"] == "not_a_pooling_model"


@pytest.mark.parametrize(
    ("task", "path", "body", "fits"),
    [
        ("classify", "/v1/embeddings", {"input": "Hi"}, "/v1/classify"),
        ("score", "/v1/embeddings", {"input": "Hi"}, "/v1/rerank"),
        ("reward", "/v1/rerank", {"query": "q", "documents": ["a"]}, "/v1/classify"),
        ("embed", "/v1/classify", {"input": "Hi"}, "/v1/embeddings"),
    ],
)
def test_a_route_refuses_a_model_of_another_task_naming_the_routes_that_fit(
    serve: Callable[..., Served], task: str, path: str, body: Any, fits: str
) -> None:
    error = serve(task).error(path, body)
    assert error["code"] == "wrong_task" and fits in error["message"]


def test_an_engine_without_encode_does_not_serve_pooling(serve: Callable[..., Served]) -> None:
    error = serve("no-encode").error("/v1/embeddings", {"input": "Hi"})
    assert error["message"] == "this engine does not serve pooling models"


def test_health_generate_probes_a_pooling_model_with_encode(embedder: Served) -> None:
    assert embedder.http.get("/health_generate").status_code == 200
    assert embedder.engine.encoded[-1].input_ids == [0]


def test_pooling_requests_are_counted_in_the_metrics(embedder: Served) -> None:
    embedder.ok("/v1/embeddings", {"input": "Hello"})
    text = embedder.http.get("/metrics").text
    assert 'radixlm_requests_total{finish_reason="stop",route="/v1/embeddings"}' in text


def test_a_cross_encoder_with_an_identity_activation_scores_its_raw_logit() -> None:
    from radixlm.server.score_math import relevance

    assert relevance([2.5], "identity") == 2.5
    assert relevance([2.5]) == pytest.approx(sigmoid(2.5))
    assert relevance([0.0, 1.0], "identity") == pytest.approx(softmax([0.0, 1.0])[-1])
