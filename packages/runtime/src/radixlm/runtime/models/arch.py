"""ArchConfig: the shape of a decoder-only model, read once from a Hugging Face config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (HF `rope_parameters` / legacy `rope_scaling`)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, hf_config: Any) -> RopeConfig:
        """Read transformers 5 `rope_parameters` or transformers 4 `rope_theta`/`rope_scaling`."""
        params: dict[str, Any] = {}
        new_style = getattr(hf_config, "rope_parameters", None)
        if isinstance(new_style, Mapping):
            params.update(new_style)
        legacy = getattr(hf_config, "rope_scaling", None)
        if isinstance(legacy, Mapping):
            params = {**legacy, **params}
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None)) or 10000.0
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"

        def value(key: str, default: Any) -> Any:
            found = params.get(key)
            return default if found is None else found

        return cls(
            rope_type=str(rope_type),
            theta=float(theta),
            factor=float(value("factor", 1.0)),
            low_freq_factor=float(value("low_freq_factor", 1.0)),
            high_freq_factor=float(value("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
            beta_fast=float(value("beta_fast", 32.0)),
            beta_slow=float(value("beta_slow", 1.0)),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(value("truncate", True)),
        )


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a model's shape.

    - `num_experts`, `top_k`, `intermediate_size` (each expert's);
    - `normalize`: the top-k weights are divided by their sum (Mixtral always; Qwen's
      `norm_topk_prob`); `weights_in_float`: the weights stay float32 (Mixtral) instead of
      being cast to the activations' dtype (Qwen);
    - `shared_intermediate_size`: Qwen2-MoE's shared expert (0: none);
    - `sparse_layers`: the layers with experts (the others have a dense MLP of the model's
      `intermediate_size`);
    - `ep_size`: expert parallelism (1: every rank holds every expert, split by columns).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool
    weights_in_float: bool = False
    shared_intermediate_size: int = 0
    sparse_layers: frozenset[int] = frozenset()
    ep_size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of "
                f"experts ({self.num_experts})"
            )


@dataclass(frozen=True)
class ArchConfig:
    """Everything the shared decoder needs; families differ only in these values."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    rope: RopeConfig = field(default_factory=RopeConfig)
    #: Per layer: the sliding-window size (a query sees this many keys, itself included) or None.
    sliding_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None
    #: A vision-language model's whole Hugging Face config (its vision tower, projector and
    #: placeholder tokens); None for a text-only model.
    multimodal: Any = field(default=None, compare=False, repr=False)
    #: A mixture-of-experts model's experts (None: every layer has a dense MLP).
    moe: MoEConfig | None = None
    #: A pooling model's head over the pooled hidden state: ("score", num_labels) for a
    #: sequence classifier's linear layer, ("reward", num_labels) for Qwen2's reward MLP;
    #: None for an embedder (or a causal LM).
    pooling_head: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows must give one entry per layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V elements one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> ArchConfig:
        """The common fields of Llama-like configs; a family passes what differs as overrides."""
        num_heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        partial = getattr(hf_config, "partial_rotary_factor", None)
        if partial not in (None, 1.0):
            raise ValueError(f"partial_rotary_factor={partial} is not supported")
        fields: dict[str, Any] = dict(
            architecture=hf_config.architectures[0],
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            hidden_act=str(getattr(hf_config, "hidden_act", "silu")),
            rope=RopeConfig.from_hf(hf_config),
            torch_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )
        fields.update(overrides)
        return cls(**fields)


def layer_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer windows from `layer_types` ("sliding_attention" / "full_attention")."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    num_layers = int(hf_config.num_hidden_layers)
    if not window or not layer_types:
        return (None,) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
