"""Bidirectional encoders (BERT, RoBERTa, XLM-RoBERTa) for pooling models: embeddings,
cross-encoder scores and sequence classification, run over packed sequences without padding."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.models.decoder import copy_weight
from radixlm.runtime.models.linear import LinearFactory, ReplicatedLinears, RowLinear

#: HF `architectures` names served as encoders -> whether the checkpoint has a classification
#: head (a `ForSequenceClassification` model: cross-encoders, classifiers).
ENCODER_ARCHITECTURES: dict[str, bool] = {
    "BertModel": False,
    "BertForSequenceClassification": True,
    "RobertaModel": False,
    "RobertaForSequenceClassification": True,
    "XLMRobertaModel": False,
    "XLMRobertaForSequenceClassification": True,
}

# model_type -> the prefix of the encoder's tensors in a classification checkpoint.
_ENCODER_PREFIXES = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta."}
_ROBERTA_TYPES = ("roberta", "xlm-roberta")

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # the exact (erf) GELU, as HF's "gelu"
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

# HF module names inside `encoder.layer.N` -> (this model's module in the layer, shard).
_LAYER_MODULES: dict[str, tuple[str, str | None]] = {
    "attention.self.query": ("qkv", "q"),
    "attention.self.key": ("qkv", "k"),
    "attention.self.value": ("qkv", "v"),
    "attention.output.dense": ("attention_out", None),
    "attention.output.LayerNorm": ("attention_norm", None),
    "intermediate.dense": ("intermediate", None),
    "output.dense": ("output", None),
    "output.LayerNorm": ("output_norm", None),
}
# Original BERT checkpoints name the LayerNorm parameters as TensorFlow did.
_LEAF_RENAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def _model_type(hf_config: Any) -> str:
    model_type = str(getattr(hf_config, "model_type", ""))
    if model_type not in _ENCODER_PREFIXES:
        raise ValueError(
            f"model_type {model_type!r} is not a supported encoder "
            f"(supported: {', '.join(sorted(_ENCODER_PREFIXES))})"
        )
    return model_type


def encoder_context_length(hf_config: Any) -> int:
    """The longest sequence the encoder takes, special tokens included. RoBERTa-family
    positions start after the padding id, so `padding_idx + 1` position rows are never used."""
    positions = int(hf_config.max_position_embeddings)
    if _model_type(hf_config) in _ROBERTA_TYPES:
        return positions - int(hf_config.pad_token_id) - 1
    return positions


class EncoderEmbeddings(nn.Module):
    """Word + token-type + absolute position embeddings, then LayerNorm."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = hf_config.hidden_size

        def table(rows: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)

        self.words = table(hf_config.vocab_size)
        self.positions = table(hf_config.max_position_embeddings)
        self.token_types = table(hf_config.type_vocab_size)
        self.norm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_eps, dtype=dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        summed = F.embedding(input_ids, self.words) + F.embedding(token_type_ids, self.token_types)
        normed: torch.Tensor = self.norm(summed + F.embedding(positions, self.positions))
        return normed


#: Tokens of the sequences run through the layers together: a big step's sequences go in
#: groups of about this many (whole sequences), so that a group's activations stay in the
#: CPU's caches from one operation to the next (a MiniLM-sized model ran 9-13 % faster on one
#: core than with a 9,000-token step at once). A sequence is never split: a group changes
#: only how many rows each matrix product takes.
GROUP_TOKENS = 2048


def _groups(seq_lens: list[int], limit: int) -> list[list[int]]:
    """`seq_lens` cut, in order, into runs of at most `limit` tokens (a longer sequence
    alone)."""
    groups: list[list[int]] = [[]]
    total = 0
    for length in seq_lens:
        if groups[-1] and total + length > limit:
            groups.append([])
            total = 0
        groups[-1].append(length)
        total += length
    return groups


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int], num_heads: int
) -> torch.Tensor:
    """Bidirectional self-attention over packed sequences ([T, heads * head_dim] each): a
    token attends to every token of its own sequence and to none of another's.

    One attention call per sequence: no padding and no mask, so the cost is the sum of the
    squared lengths, and a sequence's attention is computed just as when it runs alone. The
    calls take [1, heads, len, head_dim]: on a CPU only 4-D inputs reach torch's fused (flash)
    kernel; 3-D ones fall back to the unfused math, twice as slow on long sequences.
    """
    tokens, width = q.shape
    q, k, v = (x.view(1, tokens, num_heads, width // num_heads).transpose(1, 2) for x in (q, k, v))
    if len(seq_lens) == 1:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        q_parts, k_parts, v_parts = (torch.split(x, list(seq_lens), dim=2) for x in (q, k, v))
        out = torch.cat(
            [
                F.scaled_dot_product_attention(qs, ks, vs)
                for qs, ks, vs in zip(q_parts, k_parts, v_parts, strict=True)
            ],
            dim=2,
        )
    return out.transpose(1, 2).reshape(tokens, width)


class EncoderLayer(nn.Module):
    """Self-attention + dense + residual LayerNorm, then the feed-forward + residual LayerNorm
    (post-norm, as BERT)."""

    def __init__(self, hf_config: Any, linears: LinearFactory, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = hf_config.hidden_size, hf_config.intermediate_size
        eps = hf_config.layer_norm_eps
        self.hidden_size = hidden
        self.num_heads = hf_config.num_attention_heads
        self.qkv = linears.merged_column(hidden, {"q": hidden, "k": hidden, "v": hidden}, True)
        self.attention_out = linears.row(hidden, hidden, True)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.intermediate = linears.merged_column(hidden, {"up": inner}, True)
        self.output = linears.row(inner, hidden, True)
        self.output_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.act = _ACTIVATIONS[hf_config.hidden_act]

    def forward(self, hidden: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        q, k, v = torch.split(self.qkv(hidden), self.hidden_size, dim=-1)
        attended = packed_attention(q, k, v, seq_lens, self.num_heads)
        hidden = self.attention_norm(hidden + self.attention_out(attended))
        mixed = self.output(self.act(self.intermediate(hidden)))
        out: torch.Tensor = self.output_norm(hidden + mixed)
        return out


class EncoderModel(nn.Module):
    """A BERT / RoBERTa / XLM-RoBERTa encoder, with the classification head of a
    `ForSequenceClassification` checkpoint when its `architectures` names one.

    Built from the transformers config (`BertConfig`, `RobertaConfig`, `XLMRobertaConfig`);
    `linears` builds the linear layers (one device only: encoders are not split across ranks).
    """

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype = torch.float32,
        linears: LinearFactory | None = None,
    ) -> None:
        super().__init__()
        self.model_type = _model_type(hf_config)
        position_type = getattr(hf_config, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(
                f"position_embedding_type {position_type!r} is not supported (only 'absolute')"
            )
        if hf_config.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hf_config.hidden_act!r} is not supported "
                f"(supported: {', '.join(_ACTIVATIONS)})"
            )
        if hf_config.hidden_size % hf_config.num_attention_heads:
            raise ValueError(
                f"hidden_size ({hf_config.hidden_size}) must be divisible by "
                f"num_attention_heads ({hf_config.num_attention_heads})"
            )
        linears = linears or ReplicatedLinears(dtype)
        if linears.tp.enabled:
            raise ValueError("encoder models run on one device; use tp_size 1")
        self.dtype = dtype
        self.context_length = encoder_context_length(hf_config)
        # RoBERTa-family positions count from after the padding id.
        self.first_position = (
            int(hf_config.pad_token_id) + 1 if self.model_type in _ROBERTA_TYPES else 0
        )
        self.embeddings = EncoderEmbeddings(hf_config, dtype)
        self.layers = nn.ModuleList(
            EncoderLayer(hf_config, linears, dtype) for _ in range(hf_config.num_hidden_layers)
        )
        architectures = getattr(hf_config, "architectures", None) or []
        #: Whether the checkpoint has a classification head (`head`).
        self.has_head = any(ENCODER_ARCHITECTURES.get(name, False) for name in architectures)
        #: The head's output size (0 without a head).
        self.num_labels = int(hf_config.num_labels) if self.has_head else 0
        hidden = hf_config.hidden_size
        self.head_dense: RowLinear | None = None
        self.head_out: RowLinear | None = None
        if self.has_head:
            self.head_dense = RowLinear(hidden, hidden, True, dtype)
            self.head_out = RowLinear(hidden, self.num_labels, True, dtype)
        self._targets = self._checkpoint_targets(hf_config.num_hidden_layers)
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        seq_lens: Sequence[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last hidden states [T, hidden] of sequences packed one after another
        (`input_ids` [T], `sum(seq_lens) == T`); `token_type_ids` None means all zeros."""
        lens = list(seq_lens)
        if sum(lens) != input_ids.shape[0] or min(lens, default=0) < 1:
            raise ValueError(
                f"seq_lens {lens} must be positive and add up to the {input_ids.shape[0]} tokens"
            )
        if max(lens) > self.context_length:
            raise ValueError(
                f"a sequence of {max(lens)} tokens is longer than the model's context "
                f"({self.context_length})"
            )
        device = input_ids.device
        lengths = torch.tensor(lens, device=device)
        # Each token's index within its own sequence.
        sequence_start = torch.repeat_interleave(
            lengths.cumsum(0) - lengths, lengths, output_size=len(input_ids)
        )
        index = torch.arange(len(input_ids), device=device) - sequence_start
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden: torch.Tensor = self.embeddings(
            input_ids, index + self.first_position, token_type_ids
        )
        outputs = []
        start = 0
        for group in _groups(lens, GROUP_TOKENS):
            end = start + sum(group)
            rows = hidden[start:end]
            for layer in self.layers:
                rows = layer(rows, group)
            outputs.append(rows)
            start = end
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def head(self, first_rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, num_labels] of the classification head, from each sequence's
        first-token ([CLS] / <s>) hidden row [B, hidden]: dense + tanh, then the output
        projection (BERT's pooler + classifier, RoBERTa's classifier.dense + out_proj)."""
        if self.head_dense is None or self.head_out is None:
            raise ValueError("this checkpoint has no classification head")
        logits: torch.Tensor = self.head_out(torch.tanh(self.head_dense(first_rows)))
        return logits.float()

    # Weights -------------------------------------------------------------------------------

    def _checkpoint_targets(self, num_layers: int) -> dict[str, tuple[str, str | None, str]]:
        """Each checkpoint tensor name, without the `bert.` / `roberta.` prefix of a
        classification checkpoint -> (this model's module, shard, parameter)."""
        targets: dict[str, tuple[str, str | None, str]] = {
            "embeddings.word_embeddings.weight": ("embeddings", None, "words"),
            "embeddings.position_embeddings.weight": ("embeddings", None, "positions"),
            "embeddings.token_type_embeddings.weight": ("embeddings", None, "token_types"),
            "embeddings.LayerNorm.weight": ("embeddings.norm", None, "weight"),
            "embeddings.LayerNorm.bias": ("embeddings.norm", None, "bias"),
        }
        for index in range(num_layers):
            for stem, (module, shard) in _LAYER_MODULES.items():
                for leaf in ("weight", "bias"):
                    path = f"layers.{index}.{module}"
                    targets[f"encoder.layer.{index}.{stem}.{leaf}"] = (path, shard, leaf)
        if self.has_head:
            roberta = self.model_type in _ROBERTA_TYPES
            dense = "classifier.dense" if roberta else "pooler.dense"
            out = "classifier.out_proj" if roberta else "classifier"
            for leaf in ("weight", "bias"):
                targets[f"{dense}.{leaf}"] = ("head_dense", None, leaf)
                targets[f"{out}.{leaf}"] = ("head_out", None, leaf)
        return targets

    def _checkpoint_name(self, name: str) -> str:
        """A tensor's name in the layout `save_pretrained` writes for this architecture."""
        if self.has_head and not name.startswith("classifier"):
            return _ENCODER_PREFIXES[self.model_type] + name
        return name

    def checkpoint_names(self) -> set[str]:
        """The tensor names a checkpoint must provide, as `save_pretrained` of the
        architecture names them (`bert.` / `roberta.` prefixes with a classification head)."""
        return {self._checkpoint_name(name) for name in self._targets}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy checkpoint tensors (HF names, with or without the `bert.` / `roberta.` prefix)
        into the model, cast to its dtype; names it does not use (`embeddings.position_ids`,
        a bare model's pooler, an MLM head) are skipped. Returns the names loaded, as
        `checkpoint_names` spells them. Raises ValueError naming the required tensors the
        checkpoint lacks, or a tensor whose shape differs."""
        prefix = _ENCODER_PREFIXES[self.model_type]
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = raw_name.removeprefix(prefix)
            for old, new in _LEAF_RENAMES.items():
                if name.endswith(old):
                    name = name[: -len(old)] + new
            target = self._targets.get(name)
            if target is None:
                continue
            path, shard, leaf = target
            module: Any = self.get_submodule(path)
            if isinstance(module, (EncoderEmbeddings, nn.LayerNorm)):
                copy_weight(raw_name, getattr(module, leaf), tensor)
            else:
                try:
                    module.load_weight(shard, leaf, tensor)
                except ValueError as error:  # (the layer names only its own part)
                    raise ValueError(f"{raw_name}: {error}") from None
            loaded.add(self._checkpoint_name(name))
        missing = sorted(self.checkpoint_names() - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(
                f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}"
            )
        return loaded
