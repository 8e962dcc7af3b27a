"""Read a PEFT LoRA adapter directory and check it against the base model.

`peft` saves an adapter as `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, `rank_pattern` / `alpha_pattern`, ...) and `adapter_model.safetensors` with
one `lora_A` ([r, in]) and one `lora_B` ([out, r]) matrix per adapted linear layer, named after
the layer (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`). The delta of a
layer is `scaling * x @ A.T @ B.T` with `scaling = alpha / r` (`alpha / sqrt(r)` with
rsLoRA); it is folded into B here, so the serving path only multiplies.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.config import LORA_TARGET_MODULES
from radixlm.runtime.models.arch import ArchConfig

#: The linear layers of the decoder an adapter may target (Hugging Face names).
TARGET_MODULES = LORA_TARGET_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    r"\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_VISION = ("vision_tower", "visual", "vision_model")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served on this model; the message names what to change.
    `field` is the request or route field the problem belongs to (`lora_path`)."""

    def __init__(self, message: str, field: str = "lora_path") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class LoraModuleWeights:
    """One adapted linear layer: A [rank, in] and B [out, rank] with the scaling folded in."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: its weights by (layer index, module name), float32 on the CPU."""

    name: str
    path: str
    weights: Mapping[tuple[int, str], LoraModuleWeights]

    @property
    def rank(self) -> int:
        """The largest rank of its layers."""
        return max((w.rank for w in self.weights.values()), default=0)

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)

    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable linear layer of the whole model."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter_config(path: Path) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, checked for what radixlm cannot serve."""
    if not path.is_dir():
        raise LoraAdapterError(f"LoRA adapter directory {str(path)!r} does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoraAdapterError(
            f"{str(path)!r} is not a PEFT adapter directory: it has no {CONFIG_FILE}"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoraAdapterError(f"{config_path}: unreadable adapter config ({error})") from None
    return check_adapter_config(config, str(config_path))


def check_adapter_config(config: Any, config_path: str, field: str = "lora_path") -> dict[str, Any]:
    """A PEFT adapter config (`adapter_config.json`'s object) checked for what radixlm cannot
    serve; `config_path` names where it comes from in the errors, `field` the request field
    they belong to."""
    try:
        return _check_config(config, config_path)
    except LoraAdapterError as error:
        raise LoraAdapterError(str(error), field=field) from None


def _check_config(config: Any, config_path: str) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{config_path}: the adapter config must be a JSON object")
    peft_type = config.get("peft_type", "LORA")
    peft_type = str(getattr(peft_type, "value", peft_type)).upper()  # (peft's PeftType enum)
    if peft_type != "LORA":
        raise LoraAdapterError(f"{config_path}: peft_type {peft_type!r} is not served (only LORA)")
    refusals = {
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2 style Conv1D layers) are not supported",
    }
    for key, message in refusals.items():
        if config.get(key):
            raise LoraAdapterError(f"{config_path}: {message}")
    if config.get("bias", "none") not in ("none", None):
        raise LoraAdapterError(
            f"{config_path}: bias={config['bias']!r} adapters are not supported (only 'none')"
        )
    if config.get("modules_to_save"):
        raise LoraAdapterError(
            f"{config_path}: modules_to_save {config['modules_to_save']} would replace base "
            "weights; only LoRA deltas on the attention and MLP projections are served"
        )
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, int | float) or value <= 0:
            raise LoraAdapterError(f"{config_path}: {key} must be a positive number, got {value!r}")
    return config


def _pattern_value(patterns: Any, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the
    module's name."""
    if not isinstance(patterns, Mapping):
        return default
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return float(value)
    return default


def load_adapter(name: str, path: str | Path, arch: ArchConfig) -> LoraAdapter:
    """Read and check an adapter for a model of shape `arch`; LoraAdapterError says why not."""
    directory = Path(path).expanduser()
    config = read_adapter_config(directory)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraAdapterError(f"{str(directory)!r} has no {WEIGHTS_FILE}")
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_path), device="cpu")
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise LoraAdapterError(
            f"{weights_path}: not a readable safetensors file ({error})"
        ) from None
    return _adapter(name, str(path), config, tensors, str(weights_path), arch)


#: The `path` of an adapter given as tensors (`adapter_from_tensors`): it has no directory.
FROM_TENSORS = "<tensors>"


def adapter_from_tensors(
    name: str, tensors: Mapping[str, Any], config: Any, arch: ArchConfig
) -> LoraAdapter:
    """Check an adapter given as PEFT-named tensors (what `adapter_model.safetensors` holds)
    and its PEFT config (what `adapter_config.json` holds), as `load_adapter` checks a
    directory; the tensors are copied. LoraAdapterError says what is wrong."""
    where = f"LoRA adapter {name!r} (from tensors)"
    checked = check_adapter_config(config, f"{where}: config_dict", field="config_dict")
    found: dict[str, torch.Tensor] = {}
    for tensor_name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise LoraAdapterError(
                f"{where}: {tensor_name} is a {type(tensor).__name__}, not a torch tensor",
                field="tensors",
            )
        # A copy: the trainer's own tensor goes on changing.
        found[str(tensor_name)] = tensor.detach().to("cpu", copy=True)
    try:
        return _adapter(name, FROM_TENSORS, checked, found, where, arch)
    except LoraAdapterError as error:
        raise LoraAdapterError(str(error), field="tensors") from None


def _adapter(
    name: str,
    path: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    weights_path: str,
    arch: ArchConfig,
) -> LoraAdapter:
    """The checked adapter of a config and its tensors (`weights_path` names them in errors)."""
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for tensor_name, tensor in tensors.items():
        if any(part in tensor_name for part in _VISION):
            raise LoraAdapterError(
                f"{weights_path}: {tensor_name} adapts the vision tower, which is not supported"
            )
        match = _TENSOR_NAME.search(tensor_name)
        if match is None:
            raise LoraAdapterError(
                f"{weights_path}: tensor {tensor_name} is not a LoRA matrix of one of the "
                f"layers radixlm adapts ({', '.join(TARGET_MODULES)})"
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = (tensor_name, tensor)
    if not pairs:
        raise LoraAdapterError(f"{weights_path}: the adapter has no LoRA weights")
    shapes = module_shapes(arch)
    rslora = bool(config.get("use_rslora", False))
    weights: dict[tuple[int, str], LoraModuleWeights] = {}
    for (layer, module), found in sorted(pairs.items()):
        where = f"{weights_path}: layer {layer} {module}"
        if layer >= arch.num_layers:
            raise LoraAdapterError(
                f"{where}: the base model has only {arch.num_layers} layers; "
                "the adapter was trained for another model"
            )
        if set(found) != {"A", "B"}:
            missing = "lora_B" if "A" in found else "lora_A"
            raise LoraAdapterError(f"{where}: {missing} is missing")
        a, b = found["A"][1], found["B"][1]
        fan_in, fan_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraAdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a "
                "[r, in] / [out, r] pair"
            )
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoraAdapterError(
                f"{where}: the adapter maps {a.shape[1]} -> {b.shape[0]} features, the base "
                f"model's {module} maps {fan_in} -> {fan_out}; the adapter was trained for "
                "another model"
            )
        key = f"layers.{layer}.{module}"
        rank = int(a.shape[0])
        alpha = _pattern_value(config.get("alpha_pattern"), key, float(config["lora_alpha"]))
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        weights[(layer, module)] = LoraModuleWeights(
            a=a.to(torch.float32).contiguous(), b=(b.to(torch.float32) * scaling).contiguous()
        )
    return LoraAdapter(name=name, path=path, weights=weights)
