"""What the engine and runner benchmarks share: Qwen2.5-0.5B's shapes and a random-weight
transformers model of a given shape, written to a fresh directory."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

#: Qwen2.5-0.5B's architecture (24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151936,
#: tied embeddings), without token ids: each benchmark sets its own BOS / EOS.
QWEN25_05B_SHAPE: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "hidden_act": "silu",
}

#: Llama-3.1-8B's architecture (32 layers, hidden 4096, 32 heads / 8 KV heads, vocab 128256,
#: llama3 RoPE scaling): the larger shape the benchmarks use on a GPU.
LLAMA31_8B_SHAPE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def write_config(config: dict[str, Any], dtype: str, prefix: str) -> Path:
    """A new temporary model directory holding `config` (with `torch_dtype`) as config.json."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    (workdir / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}))
    return workdir


def random_hf_model(workdir: Path, dtype: str, device: str = "cpu") -> Any:
    """The transformers model of `workdir`'s config with random weights (seed 0), in eval mode,
    built directly on `device`."""
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.from_pretrained(str(workdir))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            hf_config, dtype=getattr(torch, dtype)
        )
    return model.eval()
