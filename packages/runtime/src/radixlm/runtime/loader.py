"""Load a model: config, then safetensors (single or sharded), GGUF or dummy weights.

Where the files are (a directory, a GGUF file, a hub id to download, a built-in model) is
`model_files.resolve_model_path`'s job; this module reads what it found.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixlm import kernels
from radixlm.runtime import gguf_checkpoint
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.distributed import SINGLE, TensorParallel
from radixlm.runtime.model_files import ModelLoadError, ModelNotFoundError, resolve_model_path
from radixlm.runtime.models import ArchConfig, DecoderForCausalLM, resolve
from radixlm.runtime.models.bert import ENCODER_ARCHITECTURES, EncoderModel, encoder_context_length
from radixlm.runtime.models.decoder_pooling import DecoderForPooling
from radixlm.runtime.models.linear import (
    LinearFactory,
    PackedCPULinears,
    ReplicatedLinears,
    ShardedLinears,
    cpu_packing_available,
)
from radixlm.runtime.models.registry import ModelFamily, UnsupportedArchitecture
from radixlm.runtime.pooling import (
    PoolingConfig,
    PoolingConfigError,
    PoolingTask,
    cross_encoder_activation,
    pooling_config,
)
from radixlm.runtime.quant import (
    QuantConfig,
    QuantizationError,
    QuantizedLinears,
    finalize_quantized,
    gguf_file_quantization,
    resolve_quantization,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Quantized checkpoints' tensors that keep their stored dtype (the layers convert them exactly).
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_QUANT_SCALE_SUFFIXES = (".scales", ".weight_scale", ".input_scale")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


__all__ = ["ModelLoadError", "ModelNotFoundError", "resolve_model_path"]


@dataclass(frozen=True)
class ModelInfo:
    """What the runner and the engine need to know about a checkpoint."""

    path: Path
    arch: ArchConfig
    family: ModelFamily
    dtype: torch.dtype
    device: torch.device
    context_length: int
    eos_token_ids: tuple[int, ...]
    generation_config: Mapping[str, Any] = field(default_factory=dict)
    hf_config: Any = None
    #: Why `dtype` was chosen (logged at start-up, reported by /get_server_info).
    dtype_reason: str = ""
    #: The linear layers' quantized format (None: they hold `dtype` weights).
    quantization: QuantConfig | None = None
    #: The GGUF file the weights come from (None: safetensors in `path`).
    gguf_file: Path | None = None
    #: A pooling model's pooling (None: a generative model).
    pooling: PoolingConfig | None = None
    #: A bidirectional encoder (BERT, XLM-RoBERTa): no KV cache, no decode.
    encoder: bool = False

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size


def resolve_device(name: str) -> torch.device:
    """ "auto" -> CUDA when available, else CPU; anything else as torch understands it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def resolve_dtype(
    name: str, checkpoint_dtype: str | None, device: torch.device | None = None
) -> torch.dtype:
    """The compute dtype (see `choose_dtype`)."""
    return choose_dtype(name, checkpoint_dtype, device)[0]


def choose_dtype(
    name: str, checkpoint_dtype: str | None, device: torch.device | None = None
) -> tuple[torch.dtype, str]:
    """The compute dtype and why. An explicit name wins. "auto" keeps the checkpoint's dtype
    (float32 when the config names none) on GPUs, and on CPUs that compute it at a fast rate;
    on other CPUs a half-precision checkpoint runs in float32: without AVX512-BF16/FP16 or AMX
    torch multiplies bfloat16 several times slower than float32 (oneDNN cannot pack such
    weights, which the start-up probe finds out)."""
    if name != "auto":
        return _DTYPES[name], f"{name}, as asked"
    stored = _DTYPES.get(checkpoint_dtype or "", torch.float32)
    label = str(stored).removeprefix("torch.")
    if stored == torch.float32 or device is None or device.type != "cpu":
        return stored, f"the checkpoint's {label}"
    if cpu_packing_available(stored):
        return stored, f"the checkpoint's {label}: this CPU multiplies {label} at a fast rate"
    return torch.float32, (
        f"float32 for a {label} checkpoint: this CPU has no fast {label} matrix multiply "
        "(no AVX512-BF16/FP16 or AMX; oneDNN cannot pack such weights), and float32 runs "
        "several times faster here; --dtype bfloat16 keeps the checkpoint's dtype"
    )


def _c_kernels_take(quantization: QuantConfig, device: torch.device) -> bool:
    """Whether radixlm's C kernels multiply these weights here: int4 or weight-only int8
    (a GGUF file's Q4 / Q8_0 blocks, or load-time int4 / int8) on a CPU where they build."""
    return (
        device.type == "cpu"
        and quantization.source in ("gguf", "load_time")
        and quantization.format in ("int4", "int8")
        and not quantization.activations_int8
        and kernels.cpu.available()
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _eos_ids(*values: Any) -> tuple[int, ...]:
    for value in values:
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value:
            return tuple(int(v) for v in value)
    return ()


def read_model_info(config: ModelConfig) -> ModelInfo:
    """Read config.json and generation_config.json of a model (no weights)."""
    path = resolve_model_path(config.model_path, config.revision, config.download_dir)
    gguf_file = gguf_checkpoint.sidecar_source(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(
            f"{path} has no config.json; is it a Hugging Face model directory?"
        )
    raw = _read_json(config_file)
    encoder = next((a for a in raw.get("architectures") or [] if a in ENCODER_ARCHITECTURES), None)
    if encoder is not None:
        return _encoder_info(config, path, raw, encoder)
    try:
        family = resolve(raw.get("architectures"))
    except UnsupportedArchitecture as error:
        raise ModelLoadError(str(error)) from None
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [family.architecture]
    try:
        arch = family.arch_config(hf_config)
    except ValueError as error:
        raise ModelLoadError(f"{path}: {error}") from None
    if config.ep_size > 1:
        if arch.moe is None:
            raise ModelLoadError(
                f"{path}: ep_size applies to mixture-of-experts models; "
                f"{family.architecture} has no experts (drop --ep-size)"
            )
        arch = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, ep_size=config.ep_size))
    generation: dict[str, Any] = {}
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        generation = _read_json(generation_file)
    try:
        if gguf_file is not None:
            quantization = gguf_file_quantization(
                config.quantization, config.quantization_group_size
            )
        else:
            quantization = resolve_quantization(
                config.quantization, raw, config.quantization_group_size
            )
    except QuantizationError as error:
        raise ModelLoadError(f"{gguf_file or path}: {error}") from None
    context = config.context_length or arch.max_position_embeddings
    device = resolve_device(config.device)
    dtype, reason = choose_dtype(config.dtype, arch.torch_dtype, device)
    if (
        config.dtype == "auto"
        and dtype != torch.float32
        and quantization is not None
        and _c_kernels_take(quantization, device)
    ):
        dtype, reason = (
            torch.float32,
            (
                f"float32 for {quantization.describe()} on the CPU: radixlm's C kernels multiply "
                "them (and run whole decode steps) with float32 activations, several times faster "
                f"than {str(dtype).removeprefix('torch.')} here; --dtype "
                f"{str(dtype).removeprefix('torch.')} keeps it"
            ),
        )
    pooling = None
    if issubclass(family.model_class, DecoderForPooling) or config.is_embedding:
        task: PoolingTask = "embed"
        if arch.pooling_head is not None:
            kind, labels = arch.pooling_head
            task = "classify" if kind == "score" and labels > 1 else "reward"
        pooling = _pooling(config, path, task, "last", hf_config)
    return ModelInfo(
        path=path,
        arch=arch,
        family=family,
        dtype=dtype,
        dtype_reason=reason,
        device=device,
        context_length=context,
        eos_token_ids=_eos_ids(generation.get("eos_token_id"), raw.get("eos_token_id")),
        generation_config=generation,
        hf_config=hf_config,
        quantization=quantization,
        gguf_file=gguf_file,
        pooling=pooling,
    )


def _pooling(
    config: ModelConfig, path: Path, task: PoolingTask, method: str, hf_config: Any
) -> PoolingConfig:
    labels = int(getattr(hf_config, "num_labels", 0) or 0) if task != "embed" else 0
    try:
        return pooling_config(
            path,
            task,
            method,  # type: ignore[arg-type]
            method=config.pooling_method,
            normalize=config.normalize_embeddings,
            num_labels=labels,
            id2label=getattr(hf_config, "id2label", None) if labels else None,
            activation=cross_encoder_activation(path, hf_config) if task == "score" else None,
        )
    except PoolingConfigError as error:
        raise ModelLoadError(str(error)) from None


def _encoder_info(
    config: ModelConfig, path: Path, raw: dict[str, Any], architecture: str
) -> ModelInfo:
    """The info of a BERT-like encoder: served as a pooling model (an embedder, or a
    classifier / cross-encoder with its head), without a KV cache."""
    from transformers import AutoConfig

    if config.quantization not in (None, "none") or gguf_checkpoint.sidecar_source(path):
        raise ModelLoadError(
            f"{path}: encoder models ({architecture}) run unquantized; drop --quantization"
        )
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    try:
        context = encoder_context_length(hf_config)
    except ValueError as error:
        raise ModelLoadError(f"{path}: {error}") from None
    # The ArchConfig only sizes the runner's request table and token ledger: an encoder
    # keeps no K/V (one layer of one head of one element per token stands for it).
    arch = ArchConfig(
        architecture=architecture,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=int(hf_config.hidden_size),
        intermediate_size=int(hf_config.intermediate_size),
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        rms_norm_eps=float(getattr(hf_config, "layer_norm_eps", 1e-12)),
        max_position_embeddings=context,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )
    if ENCODER_ARCHITECTURES[architecture]:
        labels = int(hf_config.num_labels)
        task: PoolingTask = "score" if labels == 1 else "classify"
    else:
        task = "embed"
    device = resolve_device(config.device)
    dtype, reason = choose_dtype(config.dtype, arch.torch_dtype, device)
    return ModelInfo(
        path=path,
        arch=arch,
        family=ModelFamily(architecture, lambda _config: arch),
        dtype=dtype,
        dtype_reason=reason,
        device=device,
        context_length=min(config.context_length or context, context),
        eos_token_ids=_eos_ids(raw.get("eos_token_id"), raw.get("sep_token_id")),
        hf_config=hf_config,
        pooling=_pooling(config, path, task, "cls", hf_config),
        encoder=True,
    )


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, or every *.safetensors."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{path}: shards named in {SAFETENSORS_INDEX} are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(
            p.name for p in path.glob("*.pt")
        )
        hint = (
            f" (found {', '.join(others[:3])}: only safetensors are read; convert them, e.g. "
            "load with transformers and save_pretrained(..., safe_serialization=True))"
            if others
            else ""
        )
        raise ModelNotFoundError(
            f"{path} has no *.safetensors weights{hint}; use load_format='dummy' for random weights"
        )
    return files


def iter_safetensors(
    files: list[Path], device: torch.device, dtype: torch.dtype, show_progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the files, cast to `dtype`, with a progress bar."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    target = "cpu" if device.type == "cpu" else str(device)
    for file in tqdm(
        files, desc="Loading safetensors shards", unit="shard", disable=not show_progress
    ):
        with safe_open(str(file), framework="pt", device=target) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = handle.get_tensor(name)
                keep = tensor.dtype in _FP8_DTYPES or name.endswith(_QUANT_SCALE_SUFFIXES)
                yield name, tensor.to(dtype) if tensor.is_floating_point() and not keep else tensor


class CheckpointSlice:
    """A tensor of an open safetensors file that is read only where it is narrowed (a rank
    reads its own slice of each tensor, never the whole)."""

    def __init__(self, view: Any, dtype: torch.dtype, device: torch.device) -> None:
        self._view = view
        self.shape = tuple(view.get_shape())
        stored = view.get_dtype()
        # Quantized tensors keep their stored dtype; the loader refuses them under TP.
        self._dtype = dtype if stored in ("F32", "F16", "BF16", "F64") else None
        self._device = device

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._finish(self._view[tuple(index)])

    def read(self) -> torch.Tensor:
        return self._finish(self._view[:])

    def _finish(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._dtype is not None:
            tensor = tensor.to(self._dtype)
        return tensor.to(self._device)


def iter_safetensors_slices(
    files: list[Path], device: torch.device, dtype: torch.dtype, show_progress: bool = True
) -> Iterator[tuple[str, CheckpointSlice]]:
    """(name, lazy slice) of every tensor in the files; a slice is read when narrowed (or
    read whole), while the iteration is at it."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    for file in tqdm(
        files, desc="Loading safetensors shards", unit="shard", disable=not show_progress
    ):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, CheckpointSlice(handle.get_slice(name), dtype, device)


def init_dummy_weights(model: DecoderForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights with the real shapes: normal(0, std) matrices, unit norms, small biases.

    Each parameter draws from its own seed (from `seed` and its name), so a replicated
    parameter is the same on every tensor-parallel rank and a sharded one differs per rank."""
    rank = model.tp.rank
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            key = zlib.crc32(name.encode()) + (rank << 32 if getattr(param, "tp_sharded", 0) else 0)
            # Drawn on the parameter's device (an 8B model's weights drawn on a CPU take
            # minutes); as float32, then cast.
            generator = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + key)
            values = torch.randn(
                param.shape, generator=generator, dtype=torch.float32, device=param.device
            )
            param.copy_(values.mul_(std if param.dim() > 1 else std / 2))


def build_model(
    info: ModelInfo, cpu_weight_packing: bool = True, tp: TensorParallel = SINGLE
) -> DecoderForCausalLM:
    """An uninitialised model for the checkpoint, on its device, in its dtype (this rank's
    shard of it under tensor parallelism).

    On CPU the linear layers pack their weights for oneDNN at the first forward (unless
    `cpu_weight_packing` is False): load weights before running it. A quantized model's
    layers hold `info.quantization`'s format; `finalize_quantized` must run after loading.
    """
    pack = cpu_weight_packing and info.device.type == "cpu" and cpu_packing_available(info.dtype)
    linears: LinearFactory = ReplicatedLinears(info.dtype)
    if tp.enabled:
        if info.quantization is not None:
            raise ModelLoadError(
                f"quantization ({info.quantization.describe()}) does not run under tensor "
                "parallelism yet; use tp_size 1, or a full-precision checkpoint"
            )
        linears = ShardedLinears(tp, info.dtype, pack=pack)
    elif info.quantization is not None:
        linears = QuantizedLinears(info.quantization, info.dtype, packs_lm_head=pack)
    elif pack:
        linears = PackedCPULinears(info.dtype)
    with info.device:
        return info.family.model_class(info.arch, info.dtype, linears)


def _load_gguf_weights(model: DecoderForCausalLM, info: ModelInfo, show: bool) -> None:
    assert info.gguf_file is not None
    names = model.checkpoint_names()
    quant = info.quantization
    keep_int4 = (
        {n for n in names if n.endswith("proj.weight")}
        if quant is not None and quant.source == "gguf"
        else set()
    )
    # Packed rows travel where tensors do; GGUFLinear.load_weight takes them. Q8_0 stays
    # packed on CUDA (Triton) and on CPUs where radixlm's C kernels are built; without them
    # a float copy is faster.
    weights: Iterator[tuple[str, Any]] = gguf_checkpoint.iter_gguf_weights(
        info.gguf_file,
        names,
        info.hf_config,
        info.dtype,
        keep_int4,
        show,
        keep_int8=info.device.type == "cuda" or kernels.cpu.available(),
    )
    try:
        loaded = model.load_weights(weights)
    except ValueError as error:
        raise ModelLoadError(f"{info.gguf_file}: {error}") from None
    missing = sorted(names - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{info.gguf_file}: the file lacks {len(missing)} tensor(s) the model needs: {shown}"
        )


def _load_encoder(config: ModelConfig, info: ModelInfo, tp: TensorParallel) -> Any:
    if tp.enabled:
        raise ModelLoadError(
            f"{info.path}: encoder models ({info.arch.architecture}) do not run under tensor "
            "parallelism (they are small: serve them with tp_size 1, or several with dp_size)"
        )
    pack = config.cpu_weight_packing and info.device.type == "cpu"
    linears: LinearFactory = (
        PackedCPULinears(info.dtype)
        if pack and cpu_packing_available(info.dtype)
        else ReplicatedLinears(info.dtype)
    )
    with info.device:
        model = EncoderModel(info.hf_config, info.dtype, linears)
    if config.load_format == "dummy":
        generator = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "LayerNorm" in name or "layer_norm" in name:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    values = torch.randn(param.shape, generator=generator) * 0.02
                    param.copy_(values.to(param.dtype))
        return model.eval()
    files = safetensors_files(info.path)
    weights = iter_safetensors(files, info.device, info.dtype, config.show_progress)
    try:
        model.load_weights(weights)
    except ValueError as error:
        raise ModelLoadError(f"{info.path}: {error}") from None
    return model.eval()


def load_model(
    config: ModelConfig, tp: TensorParallel = SINGLE, info: ModelInfo | None = None
) -> tuple[DecoderForCausalLM, ModelInfo]:
    """Read the config, build the model and fill its weights (from files, or dummy); under
    tensor parallelism this rank's shard, read slice by slice."""
    info = info or read_model_info(config)
    use_dummy = config.load_format == "dummy"
    if info.encoder:
        return _load_encoder(config, info, tp), info
    if use_dummy and info.quantization is not None and info.quantization.source != "load_time":
        # Random weights for a pre-quantized checkpoint: quantized from random full-precision
        # ones into the same format, so the same kernels run.
        info = dataclasses.replace(
            info, quantization=dataclasses.replace(info.quantization, source="load_time")
        )
    try:
        model = build_model(info, config.cpu_weight_packing, tp)
    except ValueError as error:
        if not tp.enabled:
            raise
        # A shape that does not split across the ranks.
        raise ModelLoadError(f"{info.path}: {error} (tp_size {tp.size})") from None
    if use_dummy:
        init_dummy_weights(model, config.seed)
    elif info.gguf_file is not None:
        _load_gguf_weights(model, info, config.show_progress and tp.is_driver)
    else:
        files = safetensors_files(info.path)
        show = config.show_progress and tp.is_driver
        weights: Iterator[tuple[str, Any]] = (
            iter_safetensors_slices(files, info.device, info.dtype, show)
            if tp.enabled
            else iter_safetensors(files, info.device, info.dtype, show)
        )
        try:
            loaded = model.load_weights(weights)
        except ValueError as error:
            raise ModelLoadError(f"{info.path}: {error}") from None
        missing = sorted(model.checkpoint_names() - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(
                f"{info.path}: the checkpoint lacks {len(missing)} tensor(s) the model needs: "
                f"{shown}"
            )
    if info.quantization is not None:
        finalize_quantized(model)
    model.eval()
    return model, info
