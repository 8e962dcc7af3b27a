"""Pooling models end to end: an embedder (engine in its own process) behind the official
`openai` client, a cross-encoder behind /v1/rerank and /v1/score, checked against
sentence-transformers, with nothing leaked."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Served, _engine
from uvicorn_thread import ThreadedServer

TOL = 1e-5


def _serve(model: Path, name: str, **engine_kwargs: Any) -> Served:
    from radixlm.server import ServerConfig, create_app

    engine = _engine(model, **engine_kwargs)
    app = create_app(engine, ServerConfig(served_model_name=name, log_requests=False))
    return Served(ThreadedServer(app, lifespan="off").start(), engine, name)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    from radixlm.runtime.fixtures_pooling import build_tiny_bert, write_sentence_transformers_config

    path = build_tiny_bert(tmp_path_factory.mktemp("bert-embed"))
    write_sentence_transformers_config(path, pooling="mean", normalize=True)
    served = _serve(path, "tiny-embed", engine_process=True, dtype="float32")
    yield served, path
    served.live.stop()
    served.engine.shutdown()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    from radixlm.runtime.fixtures_pooling import build_tiny_cross_encoder

    path = build_tiny_cross_encoder(tmp_path_factory.mktemp("bert-ce"))
    served = _serve(path, "tiny-rerank", dtype="float32")
    yield served, path
    served.live.stop()
    served.engine.shutdown()


def test_the_openai_client_embeds(embedder: tuple[Served, Path]) -> None:
    import openai
    from sentence_transformers import SentenceTransformer

    served, path = embedder
    texts = ["the radix tree", "keeps every prefix it has seen", "once"]
    want = SentenceTransformer(str(path), device="cpu").encode(texts)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    as_floats = client.embeddings.create(model="tiny-embed", input=texts, encoding_format="float")
    as_base64 = client.embeddings.create(model="tiny-embed", input=texts)  # the client's default
    for response in (as_floats, as_base64):
        assert [d.index for d in response.data] == [0, 1, 2]
        for item, ref in zip(response.data, want, strict=True):
            assert max(abs(a - float(b)) for a, b in zip(item.embedding, ref, strict=True)) < TOL
        assert response.usage.prompt_tokens > 0
    short = client.embeddings.create(model="tiny-embed", input="once", dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert abs(math.fsum(v * v for v in short.data[0].embedding) - 1.0) < 1e-5
    served.assert_no_leaks()


def test_a_pooling_model_refuses_to_chat(embedder: tuple[Served, Path]) -> None:
    served, _ = embedder
    with httpx.Client(base_url=served.url, timeout=60) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-embed", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 400
        assert "pooling model" in chat.json()["error"]["message"]
        encode = http.post("/encode", json={"text": ["a", "b"]})
        assert encode.status_code == 200 and len(encode.json()) == 2


def test_rerank_returns_documents_in_score_order(reranker: tuple[Served, Path]) -> None:
    from sentence_transformers import CrossEncoder

    served, path = reranker
    query = "which tree keeps the prefixes"
    documents = ["a radix tree", "the weather today", "prefix caching", "a list", "tokens"]
    want = CrossEncoder(str(path), device="cpu").predict([(query, d) for d in documents])
    with httpx.Client(base_url=served.url, timeout=60) as http:
        response = http.post(
            "/v1/rerank",
            json={"model": "tiny-rerank", "query": query, "documents": documents, "top_n": 3},
        )
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        order = sorted(range(len(documents)), key=lambda i: -float(want[i]))[:3]
        assert [r["index"] for r in results] == order
        for result in results:
            assert abs(result["relevance_score"] - float(want[result["index"]])) < TOL
            assert result["document"]["text"] == documents[result["index"]]
        scores = http.post(
            "/v1/score", json={"model": "tiny-rerank", "text_1": query, "text_2": documents}
        )
        assert scores.status_code == 200, scores.text
        got = [d["score"] for d in scores.json()["data"]]
        assert max(abs(a - float(b)) for a, b in zip(got, want, strict=True)) < TOL
    served.assert_no_leaks()
