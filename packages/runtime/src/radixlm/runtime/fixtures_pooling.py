"""Tiny local pooling models for tests (nothing is downloaded): BERT and XLM-RoBERTa encoders,
bare or with a classification head, their tokenizers trained on built-in text, and the files
that make a model directory a sentence-transformers model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from radixlm.runtime.fixtures import _corpus

_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
_ALL_POOLING_KEYS = (
    "pooling_mode_cls_token",
    "pooling_mode_mean_tokens",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)
_SIZES: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=128,
    # Large random weights: attention is peaked, so a token's output depends on which
    # tokens it sees (a wrong mask shows).
    initializer_range=0.2,
)


def _train_bert_tokenizer(max_length: int) -> Any:
    """A lowercasing WordPiece tokenizer ([PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4).

    transformers 5's `BertTokenizer` is the tokenizers-backed one (`BertTokenizerFast` is an
    alias); it adds BERT's normalizer, pre-tokenizer and pair template to the trained vocab."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizer

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=500,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return BertTokenizer(vocab=tokenizer.get_vocab(), model_max_length=max_length)


def _train_xlm_roberta_tokenizer(max_length: int) -> Any:
    """A SentencePiece-style Unigram tokenizer with XLM-R's ids (<s> 0, <pad> 1, </s> 2,
    <unk> 3, <mask> 4) and its post-processor (`<s> a </s></s> b </s>`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import XLMRobertaTokenizer

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=500,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    pieces = [(piece, score) for piece, score in json.loads(tokenizer.to_str())["model"]["vocab"]]
    return XLMRobertaTokenizer(vocab=pieces, model_max_length=max_length)


def _save_random_encoder(
    path: Path, config: Any, architecture: str, tokenizer: Any, seed: int
) -> Path:
    """Save a random `architecture` model of `config` and its tokenizer into `path`.

    Biases and LayerNorm parameters are drawn at random too (transformers starts them at
    0 and 1), so a bias or norm loaded into the wrong place changes the output."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def _head_fields(classifier: bool, num_labels: int) -> dict[str, Any]:
    if not classifier:
        return {}
    return {"id2label": {i: f"LABEL_{i}" for i in range(num_labels)}}


def build_tiny_bert(
    path: str | Path, *, classifier: bool = False, num_labels: int = 1, seed: int = 0
) -> Path:
    """Write a random tiny BERT into `path`: `BertModel`, or with `classifier` a
    `BertForSequenceClassification` of `num_labels` outputs, and a WordPiece tokenizer that
    encodes pairs as `[CLS] a [SEP] b [SEP]` with token types 0 / 1. Returns `path`."""
    import transformers

    tokenizer = _train_bert_tokenizer(_SIZES["max_position_embeddings"])
    architecture = "BertForSequenceClassification" if classifier else "BertModel"
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        type_vocab_size=2,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[architecture],
        **_SIZES,
        **_head_fields(classifier, num_labels),
    )
    return _save_random_encoder(Path(path), config, architecture, tokenizer, seed)


def build_tiny_xlm_roberta(
    path: str | Path, *, classifier: bool = False, num_labels: int = 1, seed: int = 0
) -> Path:
    """Write a random tiny XLM-RoBERTa into `path`: `XLMRobertaModel`, or with `classifier`
    an `XLMRobertaForSequenceClassification` of `num_labels` outputs, and a Unigram tokenizer
    with XLM-R's special tokens and pair template. Returns `path`."""
    import transformers

    positions = _SIZES["max_position_embeddings"]
    pad = 1
    # Positions start after the padding id, so the tokenizer stops that much earlier.
    tokenizer = _train_xlm_roberta_tokenizer(positions - pad - 1)
    architecture = "XLMRobertaForSequenceClassification" if classifier else "XLMRobertaModel"
    config = transformers.XLMRobertaConfig(
        vocab_size=len(tokenizer),
        type_vocab_size=1,
        pad_token_id=pad,
        bos_token_id=0,
        eos_token_id=2,
        architectures=[architecture],
        **_SIZES,
        **_head_fields(classifier, num_labels),
    )
    return _save_random_encoder(Path(path), config, architecture, tokenizer, seed)


def build_tiny_cross_encoder(
    path: str | Path,
    *,
    family: str = "bert",
    seed: int = 0,
    activation_fn: str | None = None,
) -> Path:
    """Write a random tiny reranker into `path`: a one-label sequence classifier of `family`
    ("bert" or "xlm-roberta") that sentence-transformers' `CrossEncoder(path)` loads.

    `CrossEncoder` applies a sigmoid to a one-label model's logit unless config.json names
    another activation under `sentence_transformers.activation_fn` (`activation_fn` here,
    e.g. "torch.nn.modules.linear.Identity"). Returns `path`."""
    builders = {"bert": build_tiny_bert, "xlm-roberta": build_tiny_xlm_roberta}
    if family not in builders:
        raise ValueError(f"family {family!r} is not one of {sorted(builders)}")
    path = builders[family](path, classifier=True, num_labels=1, seed=seed)
    if activation_fn is not None:
        config_file = path / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["sentence_transformers"] = {"activation_fn": activation_fn}
        config_file.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def write_sentence_transformers_config(
    path: str | Path,
    *,
    pooling: str = "mean",
    normalize: bool = True,
    max_seq_length: int | None = None,
) -> None:
    """Make the model directory `path` (any architecture with a config.json) a
    sentence-transformers model: modules.json (Transformer at the root, Pooling in
    1_Pooling, Normalize in 2_Normalize when `normalize`), the pooling config (`pooling`:
    "cls", "mean" or "lasttoken") and sentence_bert_config.json (`max_seq_length` None keeps
    the tokenizer's limit), in the layout of models on the Hugging Face Hub."""
    if pooling not in _POOLING_KEYS:
        raise ValueError(f"pooling {pooling!r} is not one of {sorted(_POOLING_KEYS)}")
    path = Path(path)
    hidden_size = json.loads((path / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (path / "2_Normalize").mkdir(exist_ok=True)
    pooling_config: dict[str, Any] = {"word_embedding_dimension": hidden_size}
    pooling_config.update({key: key == _POOLING_KEYS[pooling] for key in _ALL_POOLING_KEYS})
    pooling_config["include_prompt"] = True
    transformer_config: dict[str, Any] = {"do_lower_case": False}
    if max_seq_length is not None:
        transformer_config["max_seq_length"] = max_seq_length
    files = {
        "modules.json": modules,
        "1_Pooling/config.json": pooling_config,
        "sentence_bert_config.json": transformer_config,
        "config_sentence_transformers.json": {
            "model_type": "SentenceTransformer",
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    }
    (path / "1_Pooling").mkdir(exist_ok=True)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2), encoding="utf-8")
