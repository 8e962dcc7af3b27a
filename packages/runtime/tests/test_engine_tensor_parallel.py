"""The engine under tensor parallelism (TP=2, gloo on CPU) answers as the unsplit engine does,
and a rank that dies or hangs takes it down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.fixtures import build_tiny_model, sample_texts, shared_prefix_prompts
from radixlm.sampling import EngineUnavailable, GenerateRequest

#: Slow (rank processes per engine): in the workspace run, not the package's own
#: environment's (`hatch run alone.runtime:test` deselects `slow`).
pytestmark = pytest.mark.slow

GREEDY: dict[str, Any] = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
# Small prefill chunks: long prompts are prefilled over several steps, mixed with decodes.
OPTIONS: dict[str, Any] = {
    "show_progress": False,
    "max_total_tokens": 4096,
    "chunked_prefill_size": 24,
    "enable_mixed_chunk": True,
}
CITY = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Paris", "London"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen2: q/k/v biases; 4 query heads and 2 K/V heads, split over 2 ranks.
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def single(model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), **OPTIONS) as eng:
        yield eng


@pytest.fixture(scope="module")
def split(model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), tp_size=2, dist_timeout=30, **OPTIONS) as eng:
        yield eng


def _ids(outputs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def test_the_ranks_run_in_processes_of_their_own(split: Engine) -> None:
    pids = split.rank_pids
    assert len(pids) == 2 and os.getpid() not in pids and None not in pids
    info = split.server_info()
    assert info["tp_size"] == 2 and info["engine_mode"] == "process"
    assert [r["rank"] for r in info["tp_ranks"]] == [0, 1]
    assert all(r["kv_heads"] == 1 for r in info["tp_ranks"])  # 2 K/V heads, one per rank


def test_greedy_continuations_equal_the_unsplit_engine(single: Engine, split: Engine) -> None:
    prompts = sample_texts(6, seed=11, words=20)
    theirs = single.generate(prompts, GREEDY)
    ours = split.generate(prompts, GREEDY)
    assert all(len(ids) == 32 for ids in _ids(theirs))
    assert _ids(ours) == _ids(theirs)


def test_a_mixed_batch_of_cached_prefixes_equals_the_unsplit_engine(
    single: Engine, split: Engine
) -> None:
    prompts = shared_prefix_prompts(4, prefix_words=30, suffix_words=6, seed=1)
    prompts += shared_prefix_prompts(4, prefix_words=30, suffix_words=6, seed=2)
    results = {}
    for name, eng in (("single", single), ("split", split)):
        eng.flush_cache().result(10)
        eng.generate(prompts[0], GREEDY)  # the first prefix is cached, the second is not
        outs = eng.generate(prompts, GREEDY)
        results[name] = outs
        # The warmed prefix is reused by its group (how much the second group reuses of its
        # own prefix depends on which steps its requests arrive in).
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs[:4])
        eng.check_invariants()
    assert _ids(results["split"]) == _ids(results["single"])


def test_logprobs_sampling_and_n_equal_the_unsplit_engine(single: Engine, split: Engine) -> None:
    params = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "n": 3, "sampling_seed": 7}
    kwargs = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    theirs = single.generate("the radix tree", params, **kwargs)
    ours = split.generate("the radix tree", params, **kwargs)
    assert len(ours) == 3
    assert _ids(ours) == _ids(theirs)
    for a, b in zip(ours, theirs, strict=True):
        for key in ("output_token_logprobs", "input_token_logprobs"):
            mine, ref = a["meta_info"][key], b["meta_info"][key]
            assert [e[1] for e in mine] == [e[1] for e in ref]
            assert all(
                (x[0] is None and y[0] is None) or abs(x[0] - y[0]) < 1e-4
                for x, y in zip(mine, ref, strict=True)
            )
        tops = a["meta_info"]["output_top_logprobs"]
        assert [[t[1] for t in step] for step in tops] == [
            [t[1] for t in step] for step in b["meta_info"]["output_top_logprobs"]
        ]


def test_constrained_output_and_jump_forward_equal_the_unsplit_engine(
    single: Engine, split: Engine
) -> None:
    params = {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(CITY)}
    theirs = single.generate("the answer", params)
    ours = split.generate("the answer", params)
    assert ours["text"] == theirs["text"]
    value = json.loads(ours["text"])
    assert value["name"] in ("Paris", "London")
    regex = {"temperature": 0, "max_new_tokens": 16, "regex": r"(yes|no), [0-9]{3}"}
    assert split.generate("say", regex)["text"] == single.generate("say", regex)["text"]


def test_abort_mid_generation_leaves_nothing_behind(split: Engine) -> None:
    stream = split.generate("a long one", {**GREEDY, "max_new_tokens": 400}, stream=True, rid="tp")
    next(stream)
    assert split.abort("tp").result(10)
    final = list(stream)[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert split.generate("after", GREEDY)["meta_info"]["completion_tokens"] == 32
    split.check_invariants()


def test_retraction_under_a_small_pool_equals_the_unsplit_engine(model_dir: Path) -> None:
    outputs = {}
    for tp_size in (1, 2):
        base = EngineConfig.from_kwargs(
            str(model_dir),
            show_progress=False,
            max_total_tokens=192,
            max_running_requests=16,
            tp_size=tp_size,
        )
        # Admit optimistically so that decode runs out of slots and must retract.
        scheduler = dataclasses.replace(
            base.scheduler, init_new_token_ratio=0.02, min_new_token_ratio=0.0
        )
        with Engine(config=dataclasses.replace(base, scheduler=scheduler)) as eng:
            outs = eng.generate(sample_texts(8, seed=3), {**GREEDY, "max_new_tokens": 20})
            assert eng.server_info(fresh=True)["num_retractions"] > 0
            outputs[tp_size] = _ids(outs)
            eng.check_invariants()
    assert outputs[2] == outputs[1]


def _stream_until_error(eng: Engine, count: int, act: Any) -> tuple[list[Any], float]:
    """Open `count` long streams, call `act()` once they run; (their errors, when it acted)."""
    ended: dict[int, float] = {}

    async def one(k: int) -> BaseException | None:
        request = GenerateRequest(
            text=f"stream {k}", sampling_params={**GREEDY, "max_new_tokens": 3000}, stream=True
        )
        try:
            async for _chunk in eng.generate(request):
                pass
        except Exception as error:
            return error
        finally:
            ended[k] = time.monotonic()
        return None

    async def main() -> tuple[list[BaseException | None], float]:
        tasks = [asyncio.create_task(one(k)) for k in range(count)]
        await asyncio.sleep(1.0)
        act()
        acted = time.monotonic()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 60)), acted

    errors, acted = asyncio.run(main())
    assert ended
    return [errors, max(ended.values()) - acted], acted


def test_a_killed_rank_ends_every_open_request_and_the_engine_reports_down(
    model_dir: Path,
) -> None:
    with Engine(str(model_dir), tp_size=2, dist_timeout=20, **OPTIONS) as eng:
        eng.generate("warm up", GREEDY)
        worker = eng.rank_pids[1]
        assert worker is not None
        (errors, took), _ = _stream_until_error(eng, 8, lambda: os.kill(worker, signal.SIGKILL))
        assert all(isinstance(e, EngineUnavailable) for e in errors), errors
        assert took < 20  # well within the collective timeout
        assert "tensor-parallel rank" in str(errors[0])
        deadline = time.monotonic() + 10
        while not eng.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.failed and not eng.healthy
        assert eng.server_info()["healthy"] is False
        with pytest.raises(EngineUnavailable):
            eng.generate("nobody serves", GREEDY)


def test_a_hung_rank_times_out_and_takes_the_engine_down(model_dir: Path) -> None:
    timeout = 4.0
    with Engine(str(model_dir), tp_size=2, dist_timeout=timeout, **OPTIONS) as eng:
        eng.generate("warm up", GREEDY)
        worker = eng.rank_pids[1]
        assert worker is not None
        try:
            (errors, took), _ = _stream_until_error(eng, 4, lambda: os.kill(worker, signal.SIGSTOP))
        finally:
            # The engine may have ended the hung rank already (a loaded machine is slow to
            # get here): then there is nothing left to kill.
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        assert all(isinstance(e, EngineUnavailable) for e in errors), errors
        # The collective waits out its timeout, then every request is answered.
        assert timeout * 0.5 < took < timeout + 15
        deadline = time.monotonic() + 10
        while not eng.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.failed


def test_a_vision_model_under_tp_answers_as_the_unsplit_engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from radixlm.runtime.fixtures_vision import build_tiny_llava, make_image

    # The vision tower is replicated; rank 0 encodes and the step carries the embeddings.
    path = build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    prompts = ["<image> what is it? <image>", "plain text", "<image> again"]
    images: list[Any] = [[make_image(1), make_image(2)], None, [make_image(1)]]
    with Engine(str(path), **OPTIONS) as one:
        theirs = one.generate(prompts, GREEDY, image_data=images)
    with Engine(str(path), tp_size=2, dist_timeout=30, **OPTIONS) as two:
        ours = two.generate(prompts, GREEDY, image_data=images)
        again = two.generate(prompts[2], GREEDY, image_data=images[2])
    assert _ids(ours) == _ids(theirs)
    assert again["output_ids"] == theirs[2]["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 16  # the image, from the cache


def test_lora_adapters_under_tp_answer_as_the_unsplit_engine(
    model_dir: Path, tmp_path: Path
) -> None:
    from radixlm.runtime.fixtures import build_random_lora

    # Column layers hold each rank's rows of B, row layers each rank's columns of A; one
    # adapter slot for two adapters, and one adapter loaded at run time: the other rank reads
    # it from its directory when its slot first holds it.
    first = build_random_lora(model_dir, tmp_path / "first", rank=8, seed=1, scale=0.3)
    second = build_random_lora(model_dir, tmp_path / "second", rank=4, seed=2, scale=0.3)
    prompts = sample_texts(4, seed=5)
    names: list[str | None] = ["first", "second", None, "first"]
    outputs = {}
    for tp_size in (1, 2):
        options = {**OPTIONS, "lora_paths": {"first": str(first)}, "max_loras_per_batch": 1}
        extra = {"tp_size": 2, "dist_timeout": 30} if tp_size == 2 else {}
        with Engine(str(model_dir), max_lora_rank=8, **options, **extra) as eng:
            eng.load_lora_adapter("second", str(second)).result(60)
            outputs[tp_size] = _ids(eng.generate(prompts, GREEDY, lora_path=names))
            base = _ids(eng.generate(prompts, GREEDY))
    assert outputs[2] == outputs[1]
    assert outputs[1][0] != base[0] and outputs[1][1] != base[1]  # the adapters matter
    assert outputs[1][2] == base[2]


MOE_SMALL: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
    initializer_range=0.15, eos_token_id=1, bos_token_id=0,
)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "ep_size"),
    [("qwen2_moe", 1), ("qwen2_moe", 2), ("mixtral", 2), ("qwen3_moe", 1)],
)
def test_a_mixture_of_experts_under_tp_answers_as_the_unsplit_engine(
    tmp_path: Path, family: str, ep_size: int
) -> None:
    import torch
    import transformers

    from radixlm.runtime.fixtures import build_tiny_tokenizer

    # 4 experts, top 2. ep_size 1 splits every expert's columns across the 2 ranks; ep_size 2
    # puts 2 whole experts on each rank and exchanges the tokens' rows with all-to-all.
    # Qwen2-MoE adds a shared expert and a dense layer.
    config = {
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **MOE_SMALL, num_experts=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[1],
        ),
        "mixtral": lambda: transformers.MixtralConfig(
            **{**MOE_SMALL, "intermediate_size": 32}, num_local_experts=4
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **MOE_SMALL, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True
        ),
    }[family]()  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_tiny_tokenizer(tmp_path, vocab_size=300)
    prompts = sample_texts(3, seed=2)
    options = {**OPTIONS, "dtype": "float32", "enable_return_routed_experts": True}
    asks = {"return_routed_experts": True}
    with Engine(str(tmp_path), **options) as one:
        theirs = one.generate(prompts, GREEDY, **asks)
        alone = one.generate(prompts[0], GREEDY, **asks)
    with Engine(str(tmp_path), tp_size=2, ep_size=ep_size, dist_timeout=30, **options) as two:
        ours = two.generate(prompts, GREEDY, **asks)
        # One request: a decode step of one token, so one rank has no token to dispatch.
        single = two.generate(prompts[0], GREEDY, **asks)
        assert two.server_info()["moe"]["ep_size"] == ep_size
    assert _ids(ours) == _ids(theirs)
    assert single["output_ids"] == alone["output_ids"]
    assert [o["meta_info"]["routed_experts"] for o in ours] == [
        o["meta_info"]["routed_experts"] for o in theirs
    ]
