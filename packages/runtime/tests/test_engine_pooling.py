"""Pooling models on the engine: decoder embedders, classifiers and reward models against
transformers (within 1e-5 in float32), alone and batched, with the prefix cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model, sample_texts
from radixlm.runtime.fixtures_pooling import (
    build_tiny_bert,
    build_tiny_cross_encoder,
    build_tiny_xlm_roberta,
    write_sentence_transformers_config,
)
from radixlm.sampling import EmbeddingRequest, InvalidRequest

TOL = 1e-5


def _derive(causal: Path, target: Path, architecture: str, **config: Any) -> Path:
    """A pooling checkpoint from a tiny causal LM: its decoder's weights under
    `architecture` (`Qwen3Model`: the bare model; `*ForSequenceClassification`: with a
    random `score` head)."""
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(causal / name, target / name)
    lm = transformers.AutoModelForCausalLM.from_pretrained(causal, dtype=torch.float32)
    hf_config = lm.config
    hf_config.architectures = [architecture]
    for key, value in config.items():
        setattr(hf_config, key, value)
    torch.manual_seed(1)
    model = getattr(transformers, architecture)(hf_config).to(torch.float32)
    inner = model if architecture.endswith("Model") else model.model
    inner.load_state_dict(lm.model.state_dict())
    if hasattr(model, "score"):
        torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def causal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM", max_position_embeddings=256
    )


@pytest.fixture(scope="module")
def embedder(causal: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _derive(causal, tmp_path_factory.mktemp("emb") / "m", "Qwen3Model")


def _hidden(path: Path, texts: list[str]) -> list[torch.Tensor]:
    """transformers' final hidden states of each text, run alone (no padding)."""
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            out.append(model(input_ids=ids).last_hidden_state[0])
    return out


def _engine(path: Path, **kwargs: Any) -> Engine:
    return Engine(str(path), dtype="float32", device="cpu", **kwargs)


def _close(got: list[float], want: torch.Tensor) -> None:
    diff = (torch.tensor(got) - want).abs().max().item()
    assert diff < TOL, diff


@pytest.mark.parametrize("method", ["last", "mean"])
def test_decoder_embeddings_match_transformers_alone_and_batched(
    embedder: Path, method: str
) -> None:
    texts = sample_texts(5, seed=3, words=9)
    hidden = _hidden(embedder, texts)
    pool = (lambda h: h[-1]) if method == "last" else (lambda h: h.mean(dim=0))
    want = [torch.nn.functional.normalize(pool(h), dim=-1) for h in hidden]
    with _engine(embedder, pooling_method=method) as engine:
        info = engine.model_info()
        assert info["is_generation"] is False
        assert info["pooling"]["task"] == "embed" and info["pooling"]["method"] == method
        alone = [engine.encode(text)["embedding"] for text in texts]
        batched = engine.encode(texts)
    for one, row, ref in zip(alone, batched, want, strict=True):
        _close(one, ref)
        _close(row["embedding"], ref)


def test_shared_prefixes_come_from_the_cache_and_change_nothing(embedder: Path) -> None:
    instruction = "Instruct: find the passage that answers the question. Query: "
    queries = [instruction + text for text in sample_texts(4, seed=5, words=6)]
    want = [torch.nn.functional.normalize(h[-1], dim=-1) for h in _hidden(embedder, queries)]
    with _engine(embedder) as engine:
        first = engine.encode(queries[0])
        rest = engine.encode(queries[1:])
    _close(first["embedding"], want[0])
    for row, ref in zip(rest, want[1:], strict=True):
        _close(row["embedding"], ref)
        assert row["meta_info"]["cached_tokens"] > 0  # the instruction came from the cache


def test_dimensions_and_normalize(embedder: Path) -> None:
    text = "the quick brown fox"
    (hidden,) = _hidden(embedder, [text])
    with _engine(embedder) as engine:
        raw = engine.encode(text, normalize=False)["embedding"]
        short = engine.encode(text, dimensions=16)["embedding"]
        with pytest.raises(InvalidRequest, match="dimensions"):
            engine.encode(text, dimensions=10_000)
    _close(raw, hidden[-1])
    _close(short, torch.nn.functional.normalize(hidden[-1][:16], dim=-1))


def test_a_causal_lm_served_as_an_embedder(causal: Path) -> None:
    text = "a causal model's last hidden state"
    model = transformers.AutoModelForCausalLM.from_pretrained(causal, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(causal)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([tokenizer(text)["input_ids"]]), output_hidden_states=True
        )
    want = torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1)
    with _engine(causal, is_embedding=True) as engine:
        _close(engine.encode(text)["embedding"], want)


def test_generation_and_pooling_refuse_each_other(causal: Path, embedder: Path) -> None:
    with _engine(embedder) as engine, pytest.raises(InvalidRequest, match="pooling model"):
        engine.generate("hello", {"max_new_tokens": 2})
    with _engine(causal) as engine:
        assert engine.model_info()["pooling"] is None
        with pytest.raises(InvalidRequest, match="generates text"):
            engine.encode("hello")


def test_sequence_classifier_logits(causal: Path, tmp_path: Path) -> None:
    path = _derive(
        causal,
        tmp_path / "cls",
        "Qwen3ForSequenceClassification",
        num_labels=3,
        id2label={0: "neg", 1: "neu", 2: "pos"},
        label2id={"neg": 0, "neu": 1, "pos": 2},
    )
    texts = sample_texts(3, seed=7, words=8)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with _engine(path) as engine:
        pooling = engine.model_info()["pooling"]
        assert pooling["task"] == "classify" and pooling["num_labels"] == 3
        assert pooling["id2label"] == {"0": "neg", "1": "neu", "2": "pos"}
        got = engine.encode(texts)
    with torch.no_grad():
        for row, text in zip(got, texts, strict=True):
            logits = reference(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0]
            _close(row["embedding"], logits)


def test_qwen2_reward_model(tmp_path: Path) -> None:
    """Qwen2ForRewardModel (remote code upstream): the decoder, then Linear-ReLU-Linear over
    the last token; the reference is transformers' Qwen2Model and the same MLP in torch."""
    causal = build_tiny_model(tmp_path / "q2", "Qwen2ForCausalLM", max_position_embeddings=256)
    path = _derive(causal, tmp_path / "rm", "Qwen2Model")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen2ForRewardModel"]
    config["num_labels"] = 1
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(2)
    hidden_size = config["hidden_size"]
    head = {
        "score.0.weight": torch.randn(hidden_size, hidden_size) * 0.2,
        "score.0.bias": torch.randn(hidden_size) * 0.1,
        "score.2.weight": torch.randn(1, hidden_size) * 0.2,
        "score.2.bias": torch.randn(1) * 0.1,
    }
    save_file(head, str(path / "head.safetensors"))
    text = "a reward for this answer"
    (hidden,) = _hidden(path, [text])
    last = hidden[-1]
    mid = torch.relu(last @ head["score.0.weight"].T + head["score.0.bias"])
    want = mid @ head["score.2.weight"].T + head["score.2.bias"]
    with _engine(path) as engine:
        assert engine.model_info()["pooling"]["task"] == "reward"
        _close(engine.encode(text)["embedding"], want)


def test_the_engine_client_form(embedder: Path) -> None:
    import asyncio

    async def run(engine: Engine) -> Any:
        return await engine.encode(EmbeddingRequest(text="one input", rid="r1"))

    with _engine(embedder) as engine:
        out = asyncio.run(run(engine))
        assert out.rid == "r1" and out.prompt_tokens > 0
        assert len(out.embedding) == engine.model_info()["pooling"]["hidden_size"]
        nothing_left = engine.run_in_loop(lambda core: core.scheduler.pool.available)
        assert nothing_left == engine.run_in_loop(lambda core: core.pool_size) - engine.run_in_loop(
            lambda core: core.scheduler.cache.total_size
        )


# ------------------------------------------------------------------ encoders (BERT, XLM-R)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_encoder_embeddings_match_sentence_transformers(family: str, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    build = build_tiny_bert if family == "bert" else build_tiny_xlm_roberta
    path = build(tmp_path / family)
    write_sentence_transformers_config(path, pooling="mean", normalize=True)
    texts = [*sample_texts(6, seed=11, words=10), "short"]
    want = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True)
    with _engine(path) as engine:
        pooling = engine.model_info()["pooling"]
        assert (pooling["task"], pooling["method"], pooling["normalize"]) == ("embed", "mean", True)
        batched = engine.encode(texts)
        alone = [engine.encode(text) for text in texts]
    for row, one, ref in zip(batched, alone, want, strict=True):
        _close(row["embedding"], ref)
        _close(one["embedding"], ref)
        assert row["meta_info"]["cached_tokens"] == 0  # an encoder never reuses a prefix


def test_cross_encoder_scores_match_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    path = build_tiny_cross_encoder(tmp_path / "ce")
    query = "which word follows the fox"
    documents = sample_texts(4, seed=13, words=9)
    want = CrossEncoder(str(path), device="cpu").predict(
        [(query, d) for d in documents], convert_to_tensor=True
    )
    with _engine(path) as engine:
        assert engine.model_info()["pooling"]["task"] == "score"
        got = engine.encode([query] * len(documents), text_pair=documents)
        with pytest.raises(InvalidRequest, match="dimensions"):
            engine.encode(query, text_pair=documents[0], dimensions=2)
    for row, ref in zip(got, want.cpu(), strict=True):
        assert len(row["embedding"]) == 1
        _close([torch.sigmoid(torch.tensor(row["embedding"][0])).item()], ref)


def test_encoder_classifier_logits(tmp_path: Path) -> None:
    path = build_tiny_xlm_roberta(tmp_path / "xc", classifier=True, num_labels=3)
    texts = sample_texts(3, seed=17, words=7)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with _engine(path) as engine:
        assert engine.model_info()["pooling"]["task"] == "classify"
        with pytest.raises(InvalidRequest, match="text_pair"):
            engine.encode(texts[0], text_pair=texts[1])
        got = engine.encode(texts)
    with torch.no_grad():
        for row, text in zip(got, texts, strict=True):
            logits = reference(**tokenizer(text, return_tensors="pt")).logits[0]
            _close(row["embedding"], logits)


def test_an_encoder_input_longer_than_its_context_is_refused(tmp_path: Path) -> None:
    path = build_tiny_bert(tmp_path / "b")
    long_text = " ".join(sample_texts(40, seed=19, words=12))
    with _engine(path) as engine:
        with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
            engine.encode(long_text)
        kept = engine.encode(long_text, truncate_prompt_tokens=50)
        assert kept["meta_info"]["prompt_tokens"] == 50


@pytest.mark.slow  # two rank processes: in the workspace run, not the package's own
def test_a_decoder_embedder_under_tensor_parallelism(causal: Path, tmp_path: Path) -> None:
    path = _derive(causal, tmp_path / "cls", "Qwen3ForSequenceClassification", num_labels=2)
    texts = sample_texts(4, seed=23, words=8)
    with _engine(path) as engine:
        want = engine.encode(texts)
    with Engine(str(path), dtype="float32", device="cpu", tp_size=2, show_progress=False) as split:
        assert split.server_info()["tp_size"] == 2
        got = split.encode(texts)
    for row, ref in zip(got, want, strict=True):
        _close(row["embedding"], torch.tensor(ref["embedding"]))


def test_a_cross_encoder_names_its_activation(tmp_path: Path) -> None:
    path = build_tiny_cross_encoder(
        tmp_path / "ce", activation_fn="torch.nn.modules.linear.Identity"
    )
    with _engine(path) as engine:
        assert engine.model_info()["pooling"]["activation"] == "identity"


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_chunked_prefills_pool_as_one(embedder: Path, method: str) -> None:
    texts = [" ".join(sample_texts(3, seed=29, words=12)), "a short one"]
    pick = {"last": lambda h: h[-1], "mean": lambda h: h.mean(dim=0), "cls": lambda h: h[0]}
    want = [
        torch.nn.functional.normalize(pick[method](h), dim=-1) for h in _hidden(embedder, texts)
    ]
    with _engine(embedder, pooling_method=method, chunked_prefill_size=8) as engine:
        got = engine.encode(texts)
        assert engine.server_info()["forward_passes"] > 3  # the long text took several chunks
    for row, ref in zip(got, want, strict=True):
        _close(row["embedding"], ref)
