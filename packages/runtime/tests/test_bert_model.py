"""The BERT / RoBERTa / XLM-RoBERTa encoder against transformers and sentence-transformers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from radixlm.runtime.fixtures import build_tiny_model, checkpoint_tensors, sample_texts
from radixlm.runtime.fixtures_pooling import (
    build_tiny_bert,
    build_tiny_cross_encoder,
    build_tiny_xlm_roberta,
    write_sentence_transformers_config,
)
from radixlm.runtime.models import bert
from radixlm.runtime.models.bert import EncoderModel, encoder_context_length
from radixlm.runtime.models.linear import PackedCPULinears, cpu_packing_available

FAMILIES = ("bert", "xlm-roberta")
BUILDERS = {"bert": build_tiny_bert, "xlm-roberta": build_tiny_xlm_roberta}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny(family, num_labels=0) -> the directory of a tiny model (built once per module);
    num_labels > 0 gives a sequence classifier."""
    built: dict[tuple[str, int], Path] = {}

    def get(family: str, num_labels: int = 0) -> Path:
        if (family, num_labels) not in built:
            path = tmp_path_factory.mktemp(f"{family}-{num_labels}")
            built[family, num_labels] = BUILDERS[family](
                path, classifier=num_labels > 0, num_labels=max(num_labels, 1)
            )
        return built[family, num_labels]

    return get


def load_ours(path: Path) -> EncoderModel:
    model = EncoderModel(transformers.AutoConfig.from_pretrained(str(path)), torch.float32)
    assert model.load_weights(checkpoint_tensors(path)) == model.checkpoint_names()
    return model


def encode(path: Path, texts: Sequence[str | tuple[str, str]]) -> list[dict[str, list[int]]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return [dict(tokenizer(*text if isinstance(text, tuple) else (text,))) for text in texts]


def packed(
    encodings: list[dict[str, list[int]]],
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """The sequences one after another: ids [T], lengths, token types [T] (None without)."""
    ids = torch.tensor([i for e in encodings for i in e["input_ids"]])
    lens = [len(e["input_ids"]) for e in encodings]
    if "token_type_ids" not in encodings[0]:
        return ids, lens, None
    return ids, lens, torch.tensor([t for e in encodings for t in e["token_type_ids"]])


def first_rows(hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    return hidden[starts]


def run_alone(hf: Any, encoding: dict[str, list[int]]) -> Any:
    """transformers' output for one sequence, unpadded."""
    keys = [key for key in ("input_ids", "token_type_ids") if key in encoding]
    return hf(**{key: torch.tensor([encoding[key]]) for key in keys})


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_one_sequence_matches_transformers(tiny: Callable[..., Path], family: str) -> None:
    path = tiny(family)
    encodings = encode(path, sample_texts(1, seed=1))
    hf = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ours = load_ours(path)(*packed(encodings))
        reference = run_alone(hf, encodings[0]).last_hidden_state[0]
    assert_close(ours, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_match_each_run_alone(tiny: Callable[..., Path], family: str) -> None:
    path = tiny(family)
    texts = [sample_texts(1, seed=2, words=words)[0] for words in (3, 10, 24)]
    encodings = encode(path, texts)
    ids, lens, _ = packed(encodings)
    assert len(set(lens)) == 3
    hf = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ours = load_ours(path)(ids, lens)
        reference = torch.cat([run_alone(hf, e).last_hidden_state[0] for e in encodings])
    assert_close(ours, reference)


def test_a_big_step_runs_in_groups_of_whole_sequences_with_the_same_rows(
    tiny: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny("bert")
    texts = [sample_texts(1, seed=3, words=words)[0] for words in (4, 6, 30, 5, 8, 7)]
    ids, lens, _ = packed(encode(path, texts))
    model = load_ours(path)
    with torch.no_grad():
        whole = model(ids, lens)
        # Groups of up to 16 tokens: several sequences share one, the longest runs alone.
        monkeypatch.setattr(bert, "GROUP_TOKENS", 16)
        assert len(bert._groups(lens, 16)) >= 3 and max(lens) > 16
        grouped = model(ids, lens)
    assert_close(grouped, whole)


def test_bert_pairs_use_token_types(tiny: Callable[..., Path]) -> None:
    path = tiny("bert")
    pairs = list(zip(sample_texts(2, seed=3), sample_texts(2, seed=4), strict=True))
    encodings = encode(path, pairs)
    ids, lens, types = packed(encodings)
    assert types is not None and types.sum() > 0
    model = load_ours(path)
    hf = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ours = model(ids, lens, types)
        reference = torch.cat([run_alone(hf, e).last_hidden_state[0] for e in encodings])
        without_types = model(ids, lens)
    assert_close(ours, reference)
    assert (without_types - reference).abs().max().item() > 1e-2


@pytest.mark.parametrize("num_labels", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_head_matches_sequence_classification_logits(
    tiny: Callable[..., Path], family: str, num_labels: int
) -> None:
    path = tiny(family, num_labels)
    encodings = encode(path, sample_texts(3, seed=5))
    ids, lens, types = packed(encodings)
    model = load_ours(path)
    assert model.has_head and model.num_labels == num_labels
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        logits = model.head(first_rows(model(ids, lens, types), lens))
        reference = torch.cat([run_alone(hf, e).logits for e in encodings])
    assert_close(logits, reference)


def test_bare_model_has_no_head(tiny: Callable[..., Path]) -> None:
    model = load_ours(tiny("bert"))
    assert not model.has_head and model.num_labels == 0
    with pytest.raises(ValueError, match="no classification head"):
        model.head(torch.zeros(1, 64))


@pytest.mark.parametrize("family", FAMILIES)
def test_sentence_transformer_embeddings_are_normalized_mean_pooling(
    tiny: Callable[..., Path], family: str
) -> None:
    from sentence_transformers import SentenceTransformer

    path = tiny(family)
    write_sentence_transformers_config(path, pooling="mean", normalize=True)
    texts = [sample_texts(1, seed=6, words=words)[0] for words in (2, 9, 17, 30)]
    expected = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True)
    ids, lens, types = packed(encode(path, texts))
    with torch.no_grad():
        hidden = load_ours(path)(ids, lens, types)
    means = torch.stack([rows.mean(0) for rows in hidden.split(lens)])
    assert_close(F.normalize(means, dim=-1), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_scores_are_sigmoid_of_head(tmp_path: Path, family: str) -> None:
    from sentence_transformers import CrossEncoder

    path = build_tiny_cross_encoder(tmp_path, family=family)
    pairs = list(zip(sample_texts(3, seed=7), sample_texts(3, seed=8, words=20), strict=True))
    scores = CrossEncoder(str(path), device="cpu").predict(pairs, convert_to_tensor=True)
    ids, lens, types = packed(encode(path, pairs))
    model = load_ours(path)
    with torch.no_grad():
        logits = model.head(first_rows(model(ids, lens, types), lens))
    assert_close(torch.sigmoid(logits[:, 0]), scores)


def test_cross_encoder_takes_its_activation_from_config(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    path = build_tiny_cross_encoder(tmp_path, activation_fn="torch.nn.modules.linear.Identity")
    pairs = [("the cache", "a radix tree of the cache")]
    scores = CrossEncoder(str(path), device="cpu").predict(pairs, convert_to_tensor=True)
    ids, lens, types = packed(encode(path, pairs))
    model = load_ours(path)
    with torch.no_grad():
        logits = model.head(first_rows(model(ids, lens, types), lens))
    assert_close(logits[:, 0], scores)


@pytest.mark.parametrize(
    ("config_class", "hidden_act"),
    [
        (transformers.RobertaConfig, "gelu"),
        (transformers.BertConfig, "gelu_new"),
        (transformers.BertConfig, "gelu_pytorch_tanh"),
        (transformers.BertConfig, "relu"),
    ],
)
def test_config_variants_match_transformers(config_class: Any, hidden_act: str) -> None:
    config = config_class(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        hidden_act=hidden_act,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModel.from_config(config).eval()  # type: ignore[no-untyped-call]
    model = EncoderModel(config, torch.float32)
    model.load_weights(hf.state_dict().items())
    lens = [5, 11, 2]
    ids = torch.randint(3, 50, (sum(lens),))
    with torch.no_grad():
        ours = model(ids, lens)
        reference = torch.cat(
            [hf(input_ids=part[None]).last_hidden_state[0] for part in torch.split(ids, lens)]
        )
    assert_close(ours, reference)


def test_missing_weight_is_named(tiny: Callable[..., Path]) -> None:
    path = tiny("bert", 3)
    model = EncoderModel(transformers.AutoConfig.from_pretrained(str(path)))
    dropped = {"bert.encoder.layer.1.attention.self.key.bias", "classifier.weight"}
    weights = [(name, t) for name, t in checkpoint_tensors(path) if name not in dropped]
    with pytest.raises(ValueError, match="lacks 2 tensor") as error:
        model.load_weights(weights)
    assert all(name in str(error.value) for name in dropped)


def test_tensorflow_layernorm_names_load(tiny: Callable[..., Path]) -> None:
    path = tiny("bert")
    model = EncoderModel(transformers.AutoConfig.from_pretrained(str(path)))
    renamed = [
        (
            name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
                "LayerNorm.bias", "LayerNorm.beta"
            ),
            t,
        )
        for name, t in checkpoint_tensors(path)
    ]
    assert any(name.endswith("gamma") for name, _ in renamed)
    assert model.load_weights(renamed) == model.checkpoint_names()


@pytest.mark.skipif(not cpu_packing_available(), reason="oneDNN cannot pack weights here")
def test_packed_cpu_linears_give_the_same_hidden_states(tiny: Callable[..., Path]) -> None:
    path = tiny("xlm-roberta")
    config = transformers.AutoConfig.from_pretrained(str(path))
    model = EncoderModel(config, torch.float32, PackedCPULinears(torch.float32))
    model.load_weights(checkpoint_tensors(path))
    ids, lens, _ = packed(encode(path, sample_texts(2, seed=10)))
    with torch.no_grad():
        assert_close(model(ids, lens), load_ours(path)(ids, lens))


def test_relative_position_embeddings_are_rejected() -> None:
    config = transformers.BertConfig(position_embedding_type="relative_key")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="position_embedding_type"):
        EncoderModel(config)


@pytest.mark.parametrize(("family", "context"), [("bert", 128), ("xlm-roberta", 126)])
def test_context_length(tiny: Callable[..., Path], family: str, context: int) -> None:
    path = tiny(family)
    assert encoder_context_length(transformers.AutoConfig.from_pretrained(str(path))) == context
    model = load_ours(path)
    model(torch.full((context,), 5), [context])
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(torch.full((context + 1,), 5), [context + 1])


def test_sentence_transformers_config_on_a_decoder(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    path = build_tiny_model(tmp_path, "Qwen3ForCausalLM")
    write_sentence_transformers_config(path, pooling="lasttoken", max_seq_length=64)
    texts = [sample_texts(1, seed=9, words=words)[0] for words in (3, 12)]
    st = SentenceTransformer(str(path), device="cpu")
    assert st.max_seq_length == 64
    expected = st.encode(texts, convert_to_tensor=True)
    hf = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        last = [run_alone(hf, e).last_hidden_state[0, -1] for e in encode(path, texts)]
    assert_close(F.normalize(torch.stack(last), dim=-1), expected)
