"""Deterministic (batch-invariant) inference: with `enable_deterministic_inference` a
request's tokens and logprobs are the same bits alone, among 1-31 random companions, after a
cache hit, under any prefill chunk size and with speculative drafts; requests without a seed
sample from the engine's;
what the mode does not cover is refused with a message."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm import kernels
from radixlm.runtime import Engine
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.fixtures import CorruptedOracle, build_tiny_model

pytestmark = pytest.mark.skipif(
    not kernels.cpu.available(), reason="radixlm's CPU kernels are not built here"
)

#: The request under test: sampled at temperature 1 (no seed: the engine's), with its
#: prompt's and its tokens' logprobs and their top alternatives.
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True}
ASKS: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}

#: (architecture, model kwargs, engine kwargs): head dim 64 (grouped attention on AVX-512)
#: in float32; head dim 16 with q/k norms in int4.
MODELS = {
    "llama-f32": ("LlamaForCausalLM", dict(hidden_size=128, num_heads=2, num_kv_heads=1), {}),
    "qwen3-int4": ("Qwen3ForCausalLM", {}, {"quantization": "int4"}),
}


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    architecture, model_kwargs, engine_kwargs = MODELS[request.param]
    path = build_tiny_model(
        tmp_path_factory.mktemp(request.param),
        architecture,
        intermediate_size=256,
        init_std=0.3,
        **model_kwargs,
    )
    return path, engine_kwargs


def _engine(model: tuple[Path, dict[str, Any]], **kwargs: Any) -> Engine:
    path, engine_kwargs = model
    settings = {"cpu_threads": 2, **engine_kwargs, **kwargs}
    return Engine(str(path), show_progress=False, enable_deterministic_inference=True, **settings)


@pytest.fixture(scope="module")
def engine(model: tuple[Path, dict[str, Any]]) -> Iterator[Engine]:
    with _engine(model) as engine:
        yield engine


@pytest.fixture(scope="module")
def target() -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, 500) for _ in range(45)]


def _result(out: dict[str, Any]) -> tuple[Any, ...]:
    meta = out["meta_info"]
    return (
        out["output_ids"],
        meta["output_token_logprobs"],
        meta["output_top_logprobs"],
        meta.get("input_token_logprobs"),
        meta.get("input_top_logprobs"),
    )


def _alone(engine: Engine, prompt: list[int]) -> tuple[Any, ...]:
    engine.flush_cache()
    return _result(engine.generate(input_ids=[prompt], sampling_params=SAMPLED, **ASKS)[0])


def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_companions(
    engine: Engine, target: list[int]
) -> None:
    expected = _alone(engine, target)
    rng = random.Random(1)
    for companions in (1, 3, 7, 15, 32):
        engine.flush_cache()
        others = [
            [rng.randrange(3, 500) for _ in range(rng.randrange(2, 90))] for _ in range(companions)
        ]
        place = rng.randrange(companions + 1)
        prompts = [*others[:place], target, *others[place:]]
        params = [
            SAMPLED
            if i == place
            else {
                "temperature": rng.choice([0.0, 0.7, 1.3]),
                "max_new_tokens": rng.randrange(1, 20),
            }
            for i in range(len(prompts))
        ]
        outs = engine.generate(input_ids=prompts, sampling_params=params, **ASKS)
        assert _result(outs[place]) == expected, f"among {companions} others, at {place}"
    engine.check_invariants()


def test_a_cache_hit_gives_the_same_bits_as_computing_the_prefix(
    engine: Engine, target: list[int]
) -> None:
    expected = _alone(engine, target)
    engine.flush_cache()
    # A request sharing the first 30 tokens caches them, in a prefill of its own.
    engine.generate(input_ids=[[*target[:30], 7, 8, 9]], sampling_params={"max_new_tokens": 1})
    # (Prompt logprobs from the first token would recompute the prompt: only the output's.)
    out = engine.generate(
        input_ids=[target], sampling_params=SAMPLED, return_logprob=True, top_logprobs_num=3
    )[0]
    assert out["meta_info"]["cached_tokens"] >= 30
    assert _result(out)[:3] == expected[:3]
    engine.check_invariants()


def test_any_prefill_chunk_size_gives_the_same_bits(
    model: tuple[Path, dict[str, Any]], engine: Engine, target: list[int]
) -> None:
    expected = _alone(engine, target)
    with _engine(model, chunked_prefill_size=8, cpu_threads=1) as chunked:
        got = _alone(chunked, target)
        # Mixed steps: the target's chunks ride beside other requests' decodes.
        outs = chunked.generate(
            input_ids=[[5, 6, 7], target, [9] * 20],
            sampling_params=[{"max_new_tokens": 30}, SAMPLED, {"max_new_tokens": 25}],
            **ASKS,
        )
    assert got == expected
    assert _result(outs[1]) == expected


def test_requests_without_a_seed_sample_from_the_engines_and_siblings_differ(
    engine: Engine, target: list[int]
) -> None:
    outs = engine.generate(input_ids=[target, target], sampling_params=SAMPLED)
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    pair = engine.generate(input_ids=[target], sampling_params={**SAMPLED, "n": 2})
    assert pair[0]["output_ids"] != pair[1]["output_ids"]  # seeds seed + 0 and seed + 1


def test_drafts_change_no_token_and_no_logprob(
    model: tuple[Path, dict[str, Any]], engine: Engine, target: list[int]
) -> None:
    """Speculative decoding (NGRAM) in the mode: a draft is accepted when it is the token the
    request draws at its position, and the verify step's rows are computed as a decode's, so
    greedy and sampled requests give the same tokens and logprob bits with drafts as
    without, alone and batched."""
    prompts = [[*target[:12]] * 4, target, [7, 8, 9, 7, 8, 9, 7, 8]]
    params = [{**SAMPLED, "temperature": 0.0}, SAMPLED, {**SAMPLED, "temperature": 0.0}]
    engine.flush_cache()
    outs = engine.generate(input_ids=prompts, sampling_params=params, **ASKS)
    plain = [_result(out) for out in outs]
    # Drafts of the answers without drafts, every third one wrong (a tiny random model
    # rarely repeats itself for NGRAM's own).
    oracle = CorruptedOracle(
        {tuple(p): out["output_ids"] for p, out in zip(prompts, outs, strict=True)}
    )
    with _engine(model, speculative_algorithm="NGRAM", cpu_threads=1) as spec:
        spec.run_in_loop(lambda core: setattr(core.scheduler, "drafter", oracle))
        batched = spec.generate(input_ids=prompts, sampling_params=params, **ASKS)
        assert [_result(out) for out in batched] == plain
        for prompt, param, expected in zip(prompts, params, plain, strict=True):
            spec.flush_cache()
            alone = spec.generate(input_ids=[prompt], sampling_params=param, **ASKS)[0]
            assert _result(alone) == expected
        info = spec.get_server_info()
        assert 0 < info["spec_accepted_tokens"] < info["spec_draft_tokens"]
        spec.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 2}, "tp_size"),
        ({"enable_lora": True, "max_lora_rank": 8}, "LoRA"),
    ],
)
def test_what_the_mode_does_not_cover_is_refused_in_the_config(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("m", enable_deterministic_inference=True, **kwargs)


def test_a_model_the_kernels_cannot_take_is_refused_at_start(
    model: tuple[Path, dict[str, Any]],
) -> None:
    path, _ = model
    with pytest.raises(ValueError, match="enable_deterministic_inference needs"):
        Engine(str(path), show_progress=False, enable_deterministic_inference=True,
               dtype="bfloat16")  # fmt: skip
