"""Tiny random models of every supported family, saved as HF checkpoints, and a step driver."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from radixlm.runtime import (
    BatchEntry,
    ForwardBatch,
    MemoryConfig,
    ModelConfig,
    ModelRunner,
    RunnerConfig,
)
from radixlm.runtime.config import AttentionConfig

torch.set_num_threads(min(2, torch.get_num_threads()))

VOCAB = 256
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=512,
    initializer_range=0.15,  # peaked logits: greedy ties are unlikely
    eos_token_id=1,
    bos_token_id=0,
)

# name -> (config class, extra config fields)
ARCHS: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama3": (
        transformers.LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            tie_word_embeddings=True,
        ),
    ),
    "mistral": (transformers.MistralConfig, dict(sliding_window=6)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
}


def make_hf_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    config_class, extra = ARCHS[name]
    config = config_class(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (saved checkpoint directory, the transformers model) for every family."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in ARCHS:
        model = make_hf_model(name)
        path = root / name
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


def runner_config(path: Path | str, **model_fields: Any) -> RunnerConfig:
    backend = model_fields.pop("backend", "torch_native")
    return RunnerConfig(
        model=ModelConfig(str(path), show_progress=False, **model_fields),
        memory=MemoryConfig(max_total_tokens=2048, max_running_requests=16),
        attention=AttentionConfig(backend=backend),
    )


@pytest.fixture(scope="session")
def runners(hf_checkpoints: dict[str, tuple[Path, Any]]) -> dict[str, ModelRunner]:
    return {name: ModelRunner(runner_config(path)) for name, (path, _) in hf_checkpoints.items()}


@dataclass
class Sequence_:
    """A request the driver tracks: its row, the slots of its tokens, its tokens."""

    row: int
    tokens: list[int]
    slots: list[int] = field(default_factory=list)


class Driver:
    """A minimal scheduler stand-in: allocates rows and slots, builds batches, frees."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def start(self, tokens: Sequence[int]) -> Sequence_:
        row = self.runner.req_to_token_pool.alloc()
        assert row is not None
        return Sequence_(row, list(tokens))

    def entry(self, seq: Sequence_, new_tokens: Sequence[int], **extra: Any) -> BatchEntry:
        slots = self.runner.kv_pool.alloc(len(new_tokens))
        assert slots is not None
        prefix = len(seq.slots)
        seq.slots.extend(slots)
        return BatchEntry(seq.row, list(new_tokens), prefix, slots, **extra)

    def forward(self, entries: Sequence[BatchEntry]) -> Any:
        batch = ForwardBatch.build(entries, self.runner.req_to_token_pool.req_to_token)
        return self.runner.forward(batch)

    def release(self, seq: Sequence_) -> None:
        self.runner.kv_pool.free(seq.slots)
        self.runner.req_to_token_pool.free(seq.row)

    def greedy(self, prompt: Sequence[int], steps: int, banned: Sequence[int] = ()) -> list[int]:
        """Prefill then `steps` greedy decode steps; returns the generated tokens."""

        def pick(logits: torch.Tensor) -> int:
            logits = logits.clone()
            logits[list(banned)] = float("-inf")
            return int(logits.argmax())

        seq = self.start(prompt)
        try:
            out = self.forward([self.entry(seq, prompt)])
            generated = [pick(out.next_token_logits[0])]
            for _ in range(steps - 1):
                out = self.forward([self.entry(seq, generated[-1:])])
                generated.append(pick(out.next_token_logits[0]))
            return generated
        finally:
            self.release(seq)

    def prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits at every prompt position from one prefill forward."""
        runner = self.runner
        seq = self.start(prompt)
        try:
            batch = ForwardBatch.build(
                [self.entry(seq, prompt)], runner.req_to_token_pool.req_to_token
            )
            batch.write_req_to_token()
            runner.attention.prepare(batch)
            with torch.inference_mode():
                hidden = runner.model(batch.input_ids, batch.positions, runner.attention)
                logits: torch.Tensor = runner.model.compute_logits(hidden)
                return logits
        finally:
            self.release(seq)

    def prompt_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits at every prompt position (prefill, one position kept per forward)."""
        seq = self.start(prompt)
        try:
            rows = []
            for token in prompt:
                rows.append(self.forward([self.entry(seq, [token])]).next_token_logits[0])
            return torch.stack(rows)
        finally:
            self.release(seq)


@pytest.fixture
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """radixlm's C CPU kernels off for the test (as `RADIXLM_CPU_KERNELS=0`): runners built in
    it take torch's kernels, so the C paths (activations rounded to int8, other float32
    kernels) stay out of what it compares."""
    from radixlm import kernels

    monkeypatch.setattr(kernels.cpu, "available", lambda: False)


@pytest.fixture
def driver_for() -> Callable[[ModelRunner], Driver]:
    return Driver


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_model_factory() -> Callable[..., Any]:
    """`make_hf_model` for test modules (importlib mode cannot import this conftest)."""
    return make_hf_model


@pytest.fixture(scope="session")
def runner_config_for() -> Callable[..., RunnerConfig]:
    """`runner_config` for test modules."""
    return runner_config
