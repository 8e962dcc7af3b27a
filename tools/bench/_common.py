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


#: Ids from here up are words (a space and letters) in the id tokenizer.
ID_TOKENS_FROM = 257

# Qwen2's pre-tokenizer split; transformers loads a qwen2 model directory's tokenizer as its
# Qwen2Tokenizer with this split, whatever tokenizer.json says, so the id tokenizer uses it too.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def id_tokenizer(directory: Path, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer in which token ids and text map one to one, saved into
    `directory`.

    Id 0 is `<|endoftext|>` (EOS), ids 1-256 the bytes (so any text, JSON included, can be
    written), and every id from ID_TOKENS_FROM up a word of its own: a space and one to four
    letters (" a", " b", ..., " ab", ...), built by merges from the space and its letters.
    Encoding the decoded text of ids >= ID_TOKENS_FROM gives those ids back, so benchmarks that
    speak text over HTTP send exactly the token sequences the in-process ones use. (A byte token
    next to a word can merge with it when re-encoded.) The pre-tokenizer is Qwen2's, so
    transformers' Qwen2Tokenizer, which it picks for a qwen2 model, reads it the same way. A
    completion-style chat template writes the messages' contents one after the other.
    """
    import itertools
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {"<|endoftext|>": 0}
    vocab.update({byte_chars[b]: 1 + b for b in range(256)})
    merges: list[tuple[str, str]] = []
    space = byte_chars[ord(" ")]
    lengths = itertools.count(1)
    while len(vocab) < vocab_size:
        for letters in itertools.product(string.ascii_lowercase, repeat=next(lengths)):
            if len(vocab) >= vocab_size:
                break
            word = "".join(letters)
            vocab[space + word] = len(vocab)
            merges.append((space + word[:-1], word[-1]))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def read_bandwidth_gbs(device: str = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth on `device` in GB/s, with torch's current thread count: the best
    of a few sums over a buffer much larger than the caches."""
    import time

    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        if buffer.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        buffer.sum()
        if buffer.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9
