"""The decoder shared by the Llama-like families; they differ only by their ArchConfig."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.attention.base import AttentionBackend, AttentionLayer
from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.linear import (
    HeadLayout,
    LinearFactory,
    PackedWeight,
    ReplicatedLinears,
    VocabEmbedding,
    materialize,
)
from radixlm.runtime.models.moe import RoutedExperts, SparseMoeBlock, split_moe_weights
from radixlm.runtime.models.rope import RotaryEmbedding, apply_rotary

# Checkpoint projection name -> (merged module name, shard).
STACKED_PROJECTIONS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# Checkpoint tensors that carry nothing the model needs.
# (FP8 checkpoints' k_scale / v_scale are KV-cache scales; the fp8 KV pool uses a scale of 1.)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".k_scale", ".v_scale", ".kv_scale")


def copy_weight(name: str, param: torch.Tensor | None, tensor: Any) -> None:
    """Copy checkpoint tensor `name` into `param`; ValueError naming it when the model has no
    such parameter or its shape differs."""
    if param is None:
        raise ValueError(f"the checkpoint has a tensor the model does not know: {name}")
    if param.shape != tuple(tensor.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)}, model shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(materialize(tensor))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as transformers does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class DecoderAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_id: int, linears: LinearFactory, dtype: torch.dtype):
        super().__init__()
        head_dim = arch.head_dim
        # This rank's heads (all of them without tensor parallelism).
        heads = HeadLayout.of(arch.num_heads, arch.num_kv_heads, head_dim, linears.tp)
        self.q_size = heads.q.local
        self.kv_size = heads.kv.local
        self.qkv_proj = linears.merged_column(
            arch.hidden_size, {"q": heads.q, "k": heads.kv, "v": heads.kv}, bias=arch.qkv_bias
        )
        self.o_proj = linears.row(heads.q.size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = RMSNorm(head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.spec = AttentionLayer(
            layer_id=layer_id,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
            sliding_window=arch.sliding_windows[layer_id],
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        spec = self.spec
        qkv = self.qkv_proj(hidden)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, spec.num_heads, spec.head_dim)
        k = k.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = backend.forward(q, k, v, spec)
        return self.o_proj(out)


class DecoderMLP(nn.Module):
    def __init__(self, arch: ArchConfig, linears: LinearFactory):
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"hidden_act {arch.hidden_act!r} is not supported (only silu)")
        size = arch.intermediate_size
        if size % linears.tp.size:
            raise ValueError(
                f"intermediate_size ({size}) must be divisible by tp_size ({linears.tp.size})"
            )
        self.intermediate_size = size // linears.tp.size  # this rank's columns
        self.gate_up_proj = linears.merged_column(
            arch.hidden_size, {"gate": size, "up": size}, bias=arch.mlp_bias
        )
        self.down_proj = linears.row(size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.split(self.gate_up_proj(x), self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        layer_id: int,
        linears: LinearFactory,
        dtype: torch.dtype,
        routed: RoutedExperts | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = DecoderAttention(arch, layer_id, linears, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp: nn.Module
        if arch.moe is not None and layer_id in arch.moe.sparse_layers:
            self.mlp = SparseMoeBlock(
                arch.hidden_size, arch.moe, linears, dtype, routed or RoutedExperts()
            )
        else:
            self.mlp = DecoderMLP(arch, linears)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attended: torch.Tensor = self.self_attn(self.input_layernorm(hidden), cos, sin, backend)
        hidden = hidden + attended
        mixed: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + mixed


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig, linears: LinearFactory, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype, linears.tp)
        #: The experts each sparse layer chose at the last forward (when enabled).
        self.routed = RoutedExperts()
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, linears, dtype, self.routed) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope, arch.max_position_embeddings)
        #: The layers whose inputs a forward keeps in `captured` (EAGLE-3's features: the
        #: residual stream entering each), in order; () keeps none.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        input_embeds: torch.Tensor | None = None,
        input_embeds_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if input_embeds is not None and input_embeds_rows is not None:
            hidden[input_embeds_rows] = input_embeds.to(hidden.dtype)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        capture = self.capture_layers
        if capture:
            self.captured = []
        for index, layer in enumerate(self.layers):
            if index in capture:
                self.captured.extend([hidden] * capture.count(index))
            hidden = layer(hidden, cos, sin, backend)
        normed: torch.Tensor = self.norm(hidden)
        return normed


class DecoderForCausalLM(nn.Module):
    """A Llama-like causal LM whose parameter names follow the Hugging Face checkpoints,
    except that q/k/v and gate/up are merged (the loader splits the names accordingly)."""

    def __init__(
        self,
        arch: ArchConfig,
        dtype: torch.dtype = torch.float32,
        linears: LinearFactory | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        linears = linears or ReplicatedLinears(dtype)
        self.tp = linears.tp
        self.model = DecoderModel(arch, linears, dtype)
        self.lm_head: VocabEmbedding | None = None
        if not arch.tie_word_embeddings:
            self.lm_head = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype, linears.tp)
        # A tied head shares its weight with the embedding lookup, so the plain copy stays.
        self.head_packing = (
            PackedWeight(keep_plain=arch.tie_word_embeddings) if linears.packs_lm_head else None
        )
        #: A quantized copy of the LM head (`radixlm.runtime.quant.quantize_lm_head`), used by
        #: `compute_logits` when set.
        self.quantized_head: nn.Module | None = None

    @property
    def head(self) -> VocabEmbedding:
        """The LM head's table (the embedding table when tied)."""
        return self.lm_head if self.lm_head is not None else self.model.embed_tokens

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        input_embeds: torch.Tensor | None = None,
        input_embeds_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the new tokens, after the final norm (K/V go to
        the pool). Rows `input_embeds_rows` take `input_embeds` instead of their ids' lookup."""
        hidden: torch.Tensor = self.model(
            input_ids, positions, backend, input_embeds, input_embeds_rows
        )
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of the given hidden rows (gathered from every rank's
        part of the vocabulary under tensor parallelism)."""
        if self.quantized_head is not None:
            logits: torch.Tensor = self.quantized_head(hidden)
            return logits.float()
        if self.head_packing is not None:
            local = self.head_packing.linear(hidden, self.head.weight, None)
        else:
            local = F.linear(hidden, self.lm_head_weight)
        return self.head.gather_logits(local.float())

    # Weights -------------------------------------------------------------------------------

    def checkpoint_names(self) -> set[str]:
        """The tensor names a checkpoint must provide (Hugging Face naming)."""
        names: set[str] = set()
        reverse = {(module, shard): name for name, (module, shard) in STACKED_PROJECTIONS.items()}
        linear_paths: set[str] = set()
        for path, module in self.named_modules():
            leaves = getattr(module, "checkpoint_leaves", None)
            if leaves is None or path.startswith("quantized_head"):
                continue
            linear_paths.add(path)
            if path.rpartition(".")[0] in linear_paths:
                continue  # the layer a wrapper (a LoRA adapter's) holds: named by the wrapper
            module_path, _, module_name = path.rpartition(".")
            if module_name in ("qkv_proj", "gate_up_proj"):
                for shard in module.shard_ranges:
                    stem = f"{module_path}.{reverse[(module_name, shard)]}"
                    names.update(f"{stem}.{leaf}" for leaf in leaves())
            else:
                names.update(f"{path}.{leaf}" for leaf in leaves())
        moe = self._moe_blocks()
        for name, _param in self.named_parameters():
            owner, _, leaf = name.rpartition(".")
            if owner in moe and leaf in ("w13", "w2"):
                continue  # named per expert below
            if owner not in linear_paths:
                names.add(name)
        for prefix, block in moe.items():
            names.update(block.expert_names(prefix))
        if self.lm_head is None:
            names.discard("lm_head.weight")
        return names

    def _moe_blocks(self) -> dict[str, SparseMoeBlock]:
        return {
            path: module
            for path, module in self.named_modules()
            if isinstance(module, SparseMoeBlock)
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the model; returns the names used.

        Unknown names raise ValueError; `lm_head.weight` of a tied model is skipped.
        """
        if self.head_packing is not None:
            self.head_packing.unpack_for_load(self.head.weight)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        moe = self._moe_blocks()
        if moe:
            weights = split_moe_weights(weights, moe, loaded)
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            prefix, _, leaf = name.rpartition(".")
            module_path, _, module_name = prefix.rpartition(".")
            if module_name in STACKED_PROJECTIONS or module_name in ("o_proj", "down_proj"):
                merged, shard = STACKED_PROJECTIONS.get(module_name, (module_name, None))
                layer = self._linear(name, f"{module_path}.{merged}")
                try:
                    layer.load_weight(shard, leaf, tensor)
                except ValueError as error:  # (the layer names only its own part)
                    raise ValueError(f"{name}: {error}") from None
            elif name in params and isinstance(self._module(prefix), VocabEmbedding):
                try:
                    self._module(prefix).load_weight(None, leaf, tensor)
                except ValueError as error:
                    raise ValueError(f"{name}: {error}") from None
            elif name in params:
                copy_weight(name, params[name], tensor)
            else:
                raise ValueError(f"the checkpoint has a tensor the model does not know: {name}")
            loaded.add(name)
        return loaded

    def load_weights_beside(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        rename: Callable[[str], str],
        own: tuple[str, ...],
        skipped: tuple[str, ...] = (),
    ) -> set[str]:
        """`load_weights` for a model with parts beside the decoder (a vision tower): names
        are renamed, those under the `own` prefixes copied into this model's parameters
        (`skipped` prefixes dropped), the rest loaded into the decoder."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for raw, tensor in weights:
                name = rename(raw)
                if not name.startswith(own):
                    yield name, tensor
                elif not name.startswith(skipped):
                    copy_weight(raw, params.get(name), tensor)
                    loaded.add(name)

        return DecoderForCausalLM.load_weights(self, decoder_weights()) | loaded

    def _module(self, path: str) -> Any:
        return self.get_submodule(path) if path else self

    def _linear(self, name: str, path: str) -> Any:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise ValueError(
                f"the checkpoint has a tensor the model does not know: {name}"
            ) from None
