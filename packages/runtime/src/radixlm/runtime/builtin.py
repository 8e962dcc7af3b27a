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
