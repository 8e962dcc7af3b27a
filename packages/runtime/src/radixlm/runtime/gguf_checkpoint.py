"""GGUF checkpoints (llama.cpp's files): config, tokenizer and weights, read with `gguf` and
transformers' GGUF support.

A GGUF file holds everything a Hugging Face directory holds. The first time a file is used,
its config, tokenizer (with the chat template) and generation config are written out by
transformers into a small directory of the radixlm cache (`gguf_sidecar`), keyed by the
file's path, size and modification time; everything that reads a model directory then reads
that one, and `radixlm_gguf.json` in it names the file the weights come from.

Weights are read by `gguf.GGUFReader` (memory-mapped). Q4_0, Q4_1 and Q4_K linear weights are
converted exactly into the runtime's int4 layout (groups of 32, a float scale and zero point
each) and stay 4-bit; Q8_0 ones stay int8 with their block scales where the device has a
grouped int8 kernel (Triton on CUDA, radixlm's C kernels on the CPU); every other type is dequantized by `gguf` into the compute dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.runtime.quant.gguf_linear import Int4Rows, Int8GroupRows

logger = logging.getLogger("radixlm.runtime.gguf")

SIDECAR_MARKER = "radixlm_gguf.json"
#: Part of a sidecar's cache key: a new layout of the sidecar writes new ones.
_SIDECAR_VERSION = 2
#: llama.cpp's architecture names -> the Hugging Face class radixlm serves them with.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: Architectures whose converter permutes the rows of q and k (llama.cpp's rope layout).
_PERMUTED_QK = ("llama", "mistral")
#: GGUF types kept 4-bit (converted exactly into the int4 layout, groups of 32).
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: GGUF types kept 8-bit (int8 values with a scale per block of 32), where a kernel runs them.
INT8_TYPES = ("Q8_0",)
_GROUP = 32


class GGUFError(ValueError):
    """The GGUF file cannot be served; the message says why and what to do."""


def cache_root() -> Path:
    """radixlm's cache: `$RADIXLM_CACHE_DIR`, else `$XDG_CACHE_HOME/radixlm`, else
    `~/.cache/radixlm`."""
    explicit = os.environ.get("RADIXLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "radixlm"


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one GGUF file of a directory that
    has no config.json. None when `path` is neither; GGUFError for a directory with several
    (naming them: pass one)."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise GGUFError(
            f"{path} holds several GGUF files ({names}); pass the one to serve as the model path"
        )
    return files[0] if files else None


def sidecar_source(directory: Path) -> Path | None:
    """The GGUF file a sidecar directory stands for (None for any other directory)."""
    marker = directory / SIDECAR_MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text(encoding="utf-8"))["gguf_file"])


def _architecture(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFError("the GGUF file has no general.architecture; is it a model file?")
    arch = str(field.contents())
    name = str(reader.fields["general.name"].contents()) if "general.name" in reader.fields else ""
    if arch == "llama" and "mistral" in name.lower():
        return "mistral"  # llama.cpp files Mistral under the llama architecture
    return arch


def gguf_sidecar(gguf_file: Path) -> Path:
    """A model directory (config, tokenizer, generation config) for `gguf_file`, written by
    transformers the first time and reused while the file is unchanged."""
    gguf_file = gguf_file.resolve()
    stat = gguf_file.stat()
    stamp = f"{_SIDECAR_VERSION}|{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(stamp.encode()).hexdigest()
    directory = cache_root() / "gguf" / f"{gguf_file.stem}-{key[:16]}"
    if (directory / SIDECAR_MARKER).is_file():
        return directory
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        reader = GGUFReader(str(gguf_file))
    except (ValueError, OSError) as error:
        raise GGUFError(f"{gguf_file.name} is not a readable GGUF file: {error}") from None
    arch = _architecture(reader)
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf_file.name}: GGUF architecture {arch!r} is not served; radixlm reads "
            f"{', '.join(sorted(ARCHITECTURES))} GGUF files (or convert the model to a Hugging "
            "Face directory)"
        )
    logger.info("reading the config and tokenizer of %s (once per file)", gguf_file)
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError) as error:
        raise GGUFError(f"{gguf_file.name}: transformers cannot read it: {error}") from None
    config.architectures = [ARCHITECTURES[arch]]
    # The dtype the dequantized tensors compute in by default: bfloat16 on GPUs and on CPUs
    # that multiply it fast, float32 on other CPUs (`loader.choose_dtype`) and wherever
    # radixlm's C kernels multiply the file's int4 / int8 blocks (`loader.read_model_info`).
    config.dtype = "bfloat16"
    staging = directory.with_name(directory.name + f".tmp{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    marker = {"gguf_file": str(gguf_file), "architecture": arch}
    (staging / SIDECAR_MARKER).write_text(json.dumps(marker), encoding="utf-8")
    try:
        staging.rename(directory)
    except OSError:  # another process wrote it first
        if not (directory / SIDECAR_MARKER).is_file():
            raise
    return directory


# Reading the weights ------------------------------------------------------------------------


def _name_map(arch: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for the names the model expects."""
    import gguf

    arch_ids = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    gguf_arch = "llama" if arch == "mistral" else arch
    tensor_map = gguf.get_tensor_name_map(arch_ids[gguf_arch], num_layers)
    mapping: dict[str, str] = {}
    for hf_name in hf_names:
        stem, _, leaf = hf_name.rpartition(".")
        mapped = tensor_map.get_name(stem)
        if mapped is not None:
            mapping[f"{mapped}.{leaf}"] = hf_name
    return mapping


def _qk_row_order(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (rows[i] of the HF tensor is
    row order[i] of the GGUF one)."""
    half = rows // heads // 2
    order: np.ndarray = np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)
    return order


def _int4_codes(packed: np.ndarray) -> np.ndarray:
    """Blocks of 16 bytes -> 32 codes: element j in byte j's low nibble, 16 + j in its high."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def int4_rows(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Int4Rows:
    """A Q4_0 / Q4_1 / Q4_K tensor's bytes ([rows, bytes per row]) in the int4 layout, exact:
    value = (code - zero) * scale per group of 32."""
    from radixlm import kernels

    data = np.ascontiguousarray(raw).reshape(rows, -1)
    groups = cols // _GROUP
    if type_name == "Q4_0":
        blocks = data.reshape(rows, groups, 18)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = _int4_codes(blocks[..., 2:])
        zero = np.full_like(scale, 8.0)
    elif type_name == "Q4_1":
        blocks = data.reshape(rows, groups, 20)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = _int4_codes(blocks[..., 4:])
        flat = d == 0  # a constant block: its value is m whatever its codes
        codes = np.where(flat[..., None], 0, codes)
        scale = np.where(flat, m, d)
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.where(flat, -1.0, -m / np.where(flat, 1.0, d)).astype(np.float32)
    elif type_name == "Q4_K":
        from gguf.quants import Q4_K

        supers = data.reshape(rows * cols // 256, 144)
        d = supers[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mins = Q4_K.get_scale_min(supers[:, 4:16].copy())
        scale = d * sc.astype(np.float32)  # [superblocks, 8]
        offset = dmin * mins.astype(np.float32)
        # 128 bytes: four runs of 32, each holding two sub-blocks (low nibbles, then high).
        packed = supers[:, 16:].reshape(-1, 4, 1, 32)
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(-1, 8, 32)
        flat = scale == 0
        codes = np.where(flat[..., None], 0, codes)
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.where(flat, -1.0, offset / np.where(flat, 1.0, scale)).astype(np.float32)
        scale = np.where(flat, -offset, scale)
        scale, zero = scale.reshape(rows, groups), zero.reshape(rows, groups)
        codes = codes.reshape(rows, groups, _GROUP)
    else:
        raise GGUFError(f"{type_name} has no int4 conversion")
    codes_t = torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols)).astype(np.uint8))
    return Int4Rows(
        qweight=kernels.pack_int4(codes_t),
        scales=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
        zeros=torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)),
        group_size=_GROUP,
    )


def int8_rows(raw: np.ndarray, rows: int, cols: int) -> Int8GroupRows:
    """A Q8_0 tensor's bytes ([rows, bytes per row]: blocks of a float16 scale and 32 int8
    values) as int8 values and float32 scales, exact."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // _GROUP, 2 + _GROUP)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    values = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return Int8GroupRows(torch.from_numpy(values), torch.from_numpy(scales), _GROUP)


Packed = Int4Rows | Int8GroupRows


def _reorder(tensor: torch.Tensor | Packed, order: np.ndarray) -> torch.Tensor | Packed:
    index = torch.from_numpy(order)
    if isinstance(tensor, Int8GroupRows):
        return Int8GroupRows(tensor.values[index], tensor.scales[index], tensor.group_size)
    if isinstance(tensor, Int4Rows):
        return Int4Rows(
            tensor.qweight[index], tensor.scales[index], tensor.zeros[index], tensor.group_size
        )
    return tensor[index]


def iter_gguf_weights(
    gguf_file: Path,
    hf_names: Iterable[str],
    hf_config: Any,
    dtype: torch.dtype,
    keep_int4: Iterable[str] = (),
    show_progress: bool = True,
    keep_int8: bool = False,
) -> Iterator[tuple[str, torch.Tensor | Packed]]:
    """(Hugging Face name, tensor) of every tensor of the file the model expects: the names
    in `keep_int4` (linear weights) as `Int4Rows` where their type allows (and as
    `Int8GroupRows` for Q8_0 when `keep_int8`), everything else dequantized into `dtype`.
    Logs how many tensors of each type were kept and dequantized."""
    import gguf
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(str(gguf_file))
    arch = _architecture(reader)
    mapping = _name_map(arch, int(hf_config.num_hidden_layers), hf_names)
    int4_names = set(keep_int4)
    dequantized: Counter[str] = Counter()
    embeddings: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    for tensor in tqdm(
        reader.tensors, desc="Loading GGUF tensors", unit="tensor", disable=not show_progress
    ):
        name = mapping.get(tensor.name)
        if name is None:
            continue  # rope frequency tables and other tensors the model computes itself
        type_name = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape))
        value: torch.Tensor | Packed
        packable = name in int4_names and len(shape) == 2
        if packable and type_name in INT4_TYPES:
            value = int4_rows(tensor.data, type_name, shape[0], shape[1])
            kept[type_name] += 1
        elif packable and keep_int8 and type_name in INT8_TYPES:
            value = int8_rows(tensor.data, shape[0], shape[1])
            kept[type_name] += 1
        else:
            array = np.array(gguf.dequantize(tensor.data, tensor.tensor_type), copy=True)
            value = torch.from_numpy(array.reshape(shape)).to(dtype)
            if type_name not in ("F32", "F16", "BF16", "F64"):
                # Linear weights the kernels could not take, or embeddings (always looked up
                # in the compute dtype).
                (dequantized if name in int4_names or not int4_names else embeddings)[
                    type_name
                ] += 1
        if arch in _PERMUTED_QK and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hf_config.num_attention_heads
            if ".attn_k." in tensor.name:
                heads = hf_config.num_key_value_heads
            value = _reorder(value, _qk_row_order(shape[0], heads))
        yield name, value
    if kept:
        logger.info(
            "GGUF: %s kept packed (int4 / grouped int8 kernels, groups of 32)",
            ", ".join(f"{n} {t}" for t, n in sorted(kept.items())),
        )
    if embeddings:
        logger.info(
            "GGUF: the embeddings (%s) dequantized to %s",
            ", ".join(f"{n} {t}" for t, n in sorted(embeddings.items())),
            str(dtype).removeprefix("torch."),
        )
    if dequantized:
        why = "no kernel for their type on this device" if int4_names else "as asked"
        logger.warning(
            "GGUF: %s tensor(s) dequantized to %s (%s: %s)",
            sum(dequantized.values()),
            str(dtype).removeprefix("torch."),
            why,
            ", ".join(f"{n} {t}" for t, n in sorted(dequantized.items())),
        )
