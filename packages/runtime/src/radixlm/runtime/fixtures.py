"""Tiny local models and tokenizers for tests, examples and benchmarks (nothing is downloaded).

`build_tiny_tokenizer(dir)` trains a small byte-level BPE tokenizer on built-in text and saves
it in the Hugging Face layout; `build_tiny_model(dir)` writes a randomly initialised causal LM
of a given architecture next to it (config.json, model.safetensors, generation_config.json,
tokenizer files), so `Engine(dir)` can load it like any checkpoint on disk.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from radixlm.runtime.config import LORA_TARGET_MODULES
from radixlm.sampling import CustomLogitProcessor

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "this",
    "be",
    "are",
    "or",
    "have",
    "not",
    "model",
    "token",
    "cache",
    "prefix",
    "radix",
    "tree",
    "request",
    "batch",
    "decode",
    "prefill",
    "engine",
    "server",
    "json",
    "name",
    "population",
    "city",
    "country",
    "France",
    "England",
    "Paris",
    "London",
    "answer",
    "question",
    "value",
    "true",
    "false",
    "null",
    "yes",
    "no",
    "hello",
    "world",
    "river",
    "mountain",
    "number",
    "list",
    "item",
    "first",
    "second",
    "third",
]
_EXTRA = (
    "café naïve résumé déjà vu — “quotes” 中文 字符 日本語 🙂 🚀 ✓ ü ö ä ß € £ ¥",
    '{"name": "Paris", "population": 2148000, "country": "France"}',
    '{"answer": true, "items": [1, 2, 3], "score": 0.5, "note": null}',
    "def f(x):\n    return x * 2\n\nprint(f(21))\n",
    "Q: What is 2 + 2?\nA: 4\nQ: What is the capital of France?\nA: Paris\n",
)


def _corpus(lines: int = 400, seed: int = 0) -> Iterator[str]:
    rng = random.Random(seed)
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        yield " ".join(words) + rng.choice([".", "!", "?", ",", ":", "\n"])
        if i % 8 == 0:
            yield _EXTRA[(i // 8) % len(_EXTRA)]
    yield "".join(chr(c) for c in range(32, 127))


def build_tiny_tokenizer(path: str | Path, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer on built-in text and save it to `path`.

    The vocabulary holds every byte, merges up to `vocab_size` and the special tokens
    `SPECIAL_TOKENS` (EOS first). Returns the `PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    Path(path).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return fast


def build_tiny_model(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    tokenizer_vocab_size: int = 512,
    generation_config: dict[str, Any] | None = None,
    init_std: float = 0.5,
) -> Path:
    """Write a random causal LM of `architecture` with a tiny tokenizer into `path`.

    `init_std` scales the random weights: a large value gives peaked, varied next-token
    distributions, so greedy outputs of the tiny model are not one token repeated.
    """
    import torch
    import transformers

    path = Path(path)
    tokenizer = build_tiny_tokenizer(path, tokenizer_vocab_size)
    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[architecture]
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=init_std,
        architectures=[architecture],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    model.save_pretrained(str(path))
    gen = {"eos_token_id": eos, **(generation_config or {})}
    (path / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    return path


def build_random_lora(
    model_dir: str | Path,
    path: str | Path,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES,
    seed: int = 0,
    scale: float = 0.1,
) -> Path:
    """Write a random LoRA adapter for the model at `model_dir` into `path`, in the layout
    `peft` saves (adapter_config.json, adapter_model.safetensors): A [rank, in] and B
    [out, rank] drawn from N(0, scale^2) for each target projection of every layer."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    config = getattr(config, "text_config", None) or config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "q_proj": ("self_attn", hidden, q),
        "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv),
        "o_proj": ("self_attn", q, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in target_modules:
            block, fan_in, fan_out = shapes[module]
            stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) * scale
            b = torch.randn(fan_out, rank, generator=generator) * scale
            tensors[f"{stem}.lora_A.weight"] = a
            tensors[f"{stem}.lora_B.weight"] = b
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config), encoding="utf-8")
    return path


def build_random_eagle_head(
    model_dir: str | Path,
    path: str | Path,
    kind: str = "EAGLE",
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    scale: float = 0.3,
) -> Path:
    """Write a random EAGLE (`kind="EAGLE"`) or EAGLE-3 head for the model at `model_dir`
    into `path`, with the published layouts' config.json and tensor names (EAGLE: `fc` with
    a bias, `layers.N.*` without the first input norm; EAGLE-3: `fc` over three hidden states,
    `midlayer.*`, `norm`, `lm_head` over `draft_vocab_size` tokens, `d2t`, `t2d`)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        drawn: torch.Tensor = torch.randn(*shape, generator=generator)
        factor = float(scale / max(shape[-1], 1) ** 0.5)
        return drawn.mul(factor)

    def layer(stem: str, fan_in: int) -> dict[str, torch.Tensor]:
        return {
            f"{stem}.self_attn.q_proj.weight": rand(q, fan_in),
            f"{stem}.self_attn.k_proj.weight": rand(kv, fan_in),
            f"{stem}.self_attn.v_proj.weight": rand(kv, fan_in),
            f"{stem}.self_attn.o_proj.weight": rand(hidden, q),
            f"{stem}.mlp.gate_proj.weight": rand(inter, hidden),
            f"{stem}.mlp.up_proj.weight": rand(inter, hidden),
            f"{stem}.mlp.down_proj.weight": rand(hidden, inter),
            f"{stem}.post_attention_layernorm.weight": 1 + rand(hidden) * 0.1,
        }

    vocab = config.vocab_size
    tensors: dict[str, torch.Tensor] = {"embed_tokens.weight": rand(vocab, hidden)}
    extra: dict[str, Any] = {}
    if kind == "EAGLE":
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
        tensors["fc.bias"] = rand(hidden) * 0.1
        for index in range(num_layers):
            tensors.update(layer(f"layers.{index}", hidden))
            if index:
                tensors[f"layers.{index}.input_layernorm.weight"] = torch.ones(hidden)
        architecture = "LlamaForCausalLMEagle"
    else:
        draft = draft_vocab_size or vocab
        tensors["fc.weight"] = rand(hidden, 3 * hidden)
        tensors.update(layer("midlayer", 2 * hidden))
        tensors["midlayer.input_layernorm.weight"] = torch.ones(hidden)
        tensors["midlayer.hidden_norm.weight"] = torch.ones(hidden)
        tensors["norm.weight"] = torch.ones(hidden)
        tensors["lm_head.weight"] = rand(draft, hidden)
        # The draft vocabulary: the first `draft` ids, spread over the target's.
        target_ids = torch.linspace(0, vocab - 1, draft).round().to(torch.int64)
        tensors["d2t"] = target_ids - torch.arange(draft)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        tensors["t2d"] = t2d
        architecture, num_layers = "LlamaForCausalLMEagle3", 1
        extra = {"draft_vocab_size": draft, "target_hidden_size": hidden}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    head_config = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": getattr(config, "rope_theta", 10000.0),
        "tie_word_embeddings": False,
        **extra,
    }
    (path / "config.json").write_text(json.dumps(head_config), encoding="utf-8")
    return path


def checkpoint_tensors(path: str | Path) -> list[tuple[str, Any]]:
    """Every tensor of a safetensors checkpoint directory as (name, tensor) pairs, in name
    order (a trainer's new policy to push into an engine, in tests)."""
    from safetensors.torch import load_file

    found: dict[str, Any] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        found.update(load_file(str(file)))
    return sorted(found.items())


def sample_texts(count: int, seed: int = 0, words: int = 12) -> list[str]:
    """`count` random sentences over the tiny tokenizer's training words."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(max(1, words // 2), words)))
        for _ in range(count)
    ]


def shared_prefix_prompts(
    count: int, prefix_words: int, suffix_words: int = 8, seed: int = 0
) -> list[str]:
    """`count` prompts sharing one random prefix of `prefix_words` words."""
    rng = random.Random(seed)
    prefix = " ".join(itertools.islice((rng.choice(_WORDS) for _ in iter(int, 1)), prefix_words))
    return [
        prefix + " " + " ".join(rng.choice(_WORDS) for _ in range(suffix_words))
        for _ in range(count)
    ]


class ForceTokenProcessor(CustomLogitProcessor):
    """A deterministic custom logit processor for tests: every row samples
    `custom_params["token_id"]` (rows without it are left alone)."""

    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        for row, params in enumerate(custom_param_list):
            if params and "token_id" in params:
                token = int(params["token_id"])
                logits[row, :] = float("-inf")
                logits[row, token] = 0.0
        return logits


class ScriptedTokensProcessor(CustomLogitProcessor):
    """A deterministic custom logit processor for tests: a request's rows sample the tokens of
    `custom_params["script"]` in order, one per call, then are left alone. The position in
    each script is kept per `custom_params["script_key"]` (the engine keeps one instance of a
    processor), so give each request its own key. Rows without a script are left alone."""

    def __init__(self) -> None:
        self._calls: dict[str, int] = {}

    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        for row, params in enumerate(custom_param_list):
            if not params or "script" not in params:
                continue
            key = str(params.get("script_key", ""))
            position = self._calls.get(key, 0)
            self._calls[key] = position + 1
            script = params["script"]
            if position < len(script):
                logits[row, :] = float("-inf")
                logits[row, int(script[position])] = 0.0
        return logits


def build_tiny_gguf(
    model_dir: str | Path, gguf_file: str | Path, linear_type: str = "Q4_0"
) -> Path:
    """Write the tiny model of `model_dir` (`build_tiny_model`) as a GGUF file, the way
    llama.cpp's converter does: its metadata and tokenizer (byte-level BPE, `gpt2`), q/k rows
    permuted for llama-family files, the linear weights in `linear_type` (Q4_0, Q4_1, Q8_0,
    F16 or F32), the embeddings in Q8_0 and the norms in F32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer

    model_dir, gguf_file = Path(model_dir), Path(gguf_file)
    config = AutoConfig.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[
        config.model_type
    ]
    writer = gguf.GGUFWriter(str(gguf_file), arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))))
    writer.add_vocab_size(config.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(config.bos_token_id))
    writer.add_eos_token_id(int(config.eos_token_id))
    writer.add_pad_token_id(int(config.pad_token_id))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    tensor_map = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers
    )
    weights: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    qtype = gguf.GGMLQuantizationType[linear_type]
    for name, array in weights.items():
        stem, _, leaf = name.rpartition(".")
        target = f"{tensor_map.get_name(stem)}.{leaf}"
        array = array.astype(np.float32)
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if "q_proj" in stem else config.num_key_value_heads
            rows = array.shape[0]
            array = (
                array.reshape(heads, 2, rows // heads // 2, *array.shape[1:])
                .swapaxes(1, 2)
                .reshape(array.shape)
            )
        if array.ndim == 1:
            writer.add_tensor(target, array)
            continue
        kind = gguf.GGMLQuantizationType.Q8_0 if "embed" in stem or "lm_head" in stem else qtype
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, array)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(target, array.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_file


class CorruptedOracle:
    """A drafter for speculative decoding's tests (set it as the scheduler's `drafter`):
    proposes what a reference run generated after the request's prompt, every third draft
    position (by output index) replaced by a wrong token, so that drafts are accepted in
    full, in part and not at all, step after step."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], max_draft: int = 4) -> None:
        self.references = references
        self.max_draft = max_draft
        self.disable_by_batch_size = None
        self.step_tokens = None

    def threshold(self, size: int) -> float:
        return 0.0  # drafts always worth it: every path is exercised

    def propose(self, asks: Sequence[tuple[Any, int]]) -> list[list[int]]:
        return [self._one(req, count) for req, count in asks]

    def accepted(self, req: Any, slots: Sequence[int]) -> None:
        pass

    def _one(self, req: Any, count: int) -> list[int]:
        reference = self.references.get(tuple(req.prompt_ids))
        if reference is None:
            return []
        done = len(req.output_ids)
        draft = list(reference[done : done + count])
        return [t if (done + i) % 3 != 2 else (t + 1) % 500 for i, t in enumerate(draft)]
