"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers: prefill
logits, greedy continuations alone and batched, a cached prefix, and the stacked checkpoint
layout."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from radixlm.runtime import Engine, ModelRunner, RunnerConfig
from radixlm.runtime.fixtures import build_tiny_tokenizer
from radixlm.sampling import InvalidRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    eos_token_id=1,
    bos_token_id=0,
)
FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],  # a dense layer between two sparse ones
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=32,
        ),
    ),
}
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33, 2, 200, 11, 9, 180, 77, 4, 61, 19]


def make_moe(family: str, seed: int = 0) -> Any:
    config_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in FAMILIES:
        model = make_moe(family)
        path = root / family
        model.save_pretrained(path)
        build_tiny_tokenizer(path, vocab_size=300)
        out[family] = (path, model)
    return out


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([ids])).logits[0]
    return logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_transformers(
    family: str,
    checkpoints: dict[str, tuple[Path, Any]],
    runner_config_for: Callable[..., RunnerConfig],
    driver_for: Any,
) -> None:
    path, hf_model = checkpoints[family]
    runner = ModelRunner(runner_config_for(path))
    driver = driver_for(runner)
    expected = hf_logits(hf_model, PROMPT)
    ours = driver.prefill_logits(PROMPT)
    assert (ours - expected).abs().max().item() < 1e-4
    # Position by position (decode steps over the cached prefix).
    stepwise = driver.prompt_logits(PROMPT)
    assert (stepwise - expected).abs().max().item() < 1e-4


def hf_greedy(model: Any, ids: list[int], steps: int) -> list[int]:
    tokens = list(ids)
    for _ in range(steps):
        tokens.append(int(hf_logits(model, tokens)[-1].argmax()))
    return tokens[len(ids) :]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_alone_batched_and_cached_equal_transformers(
    family: str, checkpoints: dict[str, tuple[Path, Any]]
) -> None:
    path, hf_model = checkpoints[family]
    prompts = [PROMPT, PROMPT[:9], PROMPT[4:], [*PROMPT, 8, 9, 10]]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with Engine(str(path), show_progress=False, dtype="float32", max_total_tokens=2048) as engine:
        alone = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
        batched = engine.generate(input_ids=prompts, sampling_params=params)
        again = engine.generate(input_ids=prompts[3], sampling_params=params)
    assert [o["output_ids"] for o in alone] == expected
    assert [o["output_ids"] for o in batched] == expected
    assert again["meta_info"]["cached_tokens"] >= len(PROMPT)  # the prefix came from the cache
    assert again["output_ids"] == expected[3]


def test_stacked_expert_layout_loads_the_same(
    checkpoints: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    runner_config_for: Callable[..., RunnerConfig],
    driver_for: Any,
) -> None:
    # transformers 5's in-memory layout: experts.gate_up_proj [E, 2I, H], experts.down_proj.
    path, hf_model = checkpoints["qwen3_moe"]
    tensors = load_file(str(path / "model.safetensors"))
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            stacked[name] = tensor
    for name, param in hf_model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stacked[name] = param.clone()
    out = tmp_path / "stacked"
    out.mkdir()
    for file in path.iterdir():
        if file.name != "model.safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    save_file(stacked, str(out / "model.safetensors"))
    runner = ModelRunner(runner_config_for(out))
    ours = driver_for(runner).prefill_logits(PROMPT)
    assert (ours - hf_logits(hf_model, PROMPT)).abs().max().item() < 1e-4


def test_a_checkpoint_missing_an_expert_is_refused(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from radixlm.runtime.config import ModelConfig
    from radixlm.runtime.loader import ModelLoadError, load_model

    path, _ = checkpoints["mixtral"]
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    out = tmp_path / "broken"
    out.mkdir()
    (out / "config.json").write_bytes((path / "config.json").read_bytes())
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj"):
        load_model(ModelConfig(str(out), show_progress=False))


def hf_routed(model: Any, ids: list[int], num_layers: int, sparse: list[int]) -> torch.Tensor:
    """[tokens, layers, top_k]: the top k of transformers' router logits (-1: dense layer)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    rows = torch.full((len(ids), num_layers, top_k), -1, dtype=torch.int32)
    for layer, logits in zip(sparse, out.router_logits, strict=True):
        rows[:, layer] = torch.topk(logits.reshape(len(ids), -1), top_k, dim=-1).indices.int()
    return rows


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_routed_experts_equal_the_top_k_of_transformers_router(
    family: str, checkpoints: dict[str, tuple[Path, Any]]
) -> None:
    from radixlm.runtime.routed_experts import decode

    path, hf_model = checkpoints[family]
    layers = COMMON["num_hidden_layers"]
    sparse = [0, 2] if family == "qwen2_moe" else [0, 1, 2]  # qwen2_moe: layer 1 is dense
    top_k = hf_model.config.num_experts_per_tok
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(
        str(path),
        show_progress=False,
        dtype="float32",
        max_total_tokens=2048,
        enable_return_routed_experts=True,
    ) as engine:
        first = engine.generate(
            input_ids=PROMPT, sampling_params=params, return_routed_experts=True
        )
        # The same prompt again: its prefix comes from the cache, its routing from the slots.
        again = engine.generate(
            input_ids=PROMPT,
            sampling_params=params,
            return_routed_experts=True,
            routed_experts_start_len=5,
        )
        assert again["meta_info"]["cached_tokens"] > 0
        with pytest.raises(InvalidRequest) as error:
            engine.generate(
                input_ids=PROMPT,
                sampling_params=params,
                return_routed_experts=True,
                routed_experts_start_len=len(PROMPT) + 1,
            )
        assert error.value.field == "routed_experts_start_len"
        plain = engine.generate(input_ids=PROMPT, sampling_params=params)
        assert "routed_experts" not in plain["meta_info"]
    ids = PROMPT + first["output_ids"][:-1]  # every position the model ran on
    expected = hf_routed(hf_model, ids, layers, sparse)
    got = decode(first["meta_info"]["routed_experts"], layers, top_k)
    assert got.shape == (len(PROMPT) + 5, layers, top_k)
    assert torch.equal(got, expected)
    assert again["meta_info"]["routed_experts_start_len"] == 5
    assert torch.equal(decode(again["meta_info"]["routed_experts"], layers, top_k), expected[5:])


def test_routed_experts_need_the_flag_and_a_moe_model(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from radixlm.runtime.fixtures import build_tiny_model

    path, _ = checkpoints["qwen3_moe"]
    params = {"max_new_tokens": 2}
    with (
        Engine(str(path), show_progress=False, max_total_tokens=1024) as engine,
        pytest.raises(InvalidRequest, match="--enable-return-routed-experts"),
    ):
        engine.generate(input_ids=PROMPT, sampling_params=params, return_routed_experts=True)
    dense = build_tiny_model(tmp_path / "dense")
    with (
        Engine(
            str(dense),
            show_progress=False,
            max_total_tokens=1024,
            enable_return_routed_experts=True,
        ) as engine,
        pytest.raises(InvalidRequest, match="no experts"),
    ):
        engine.generate(input_ids=PROMPT, sampling_params=params, return_routed_experts=True)


def test_routed_experts_cross_the_engine_process(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    from radixlm.runtime.routed_experts import decode

    path, hf_model = checkpoints["qwen3_moe"]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    with Engine(
        str(path),
        show_progress=False,
        dtype="float32",
        max_total_tokens=1024,
        engine_process=True,
        enable_return_routed_experts=True,
    ) as engine:
        out = engine.generate(
            input_ids=PROMPT, sampling_params={**params, "n": 2}, return_routed_experts=True
        )
    layers, top_k = COMMON["num_hidden_layers"], hf_model.config.num_experts_per_tok
    for seq in out:  # n = 2: each sequence has its own rows
        ids = PROMPT + seq["output_ids"][:-1]
        got = decode(seq["meta_info"]["routed_experts"], layers, top_k)
        assert torch.equal(got, hf_routed(hf_model, ids, layers, [0, 1, 2]))
