"""`input_embeds`: prompts given as embeddings, their own cache keys, no leaked KV slots."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import (
    BatchEntry,
    Engine,
    ForwardBatch,
    MemoryConfig,
    ModelConfig,
    ModelRunner,
    RunnerConfig,
)
from radixlm.runtime.config import AttentionConfig
from radixlm.runtime.fixtures import build_tiny_model
from radixlm.runtime.input_embeds import input_embeds_cache_ids
from radixlm.sampling import InvalidRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Thread mode only: the runner's embedding table and the pool.
pytestmark = pytest.mark.thread_only("the runner's embedding table and the pool")

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), show_progress=False, max_total_tokens=4096) as eng:
        yield eng


def table(engine: Engine) -> torch.Tensor:
    return engine.runner.model.model.embed_tokens.weight.detach().float().cpu()


def no_leak(engine: Engine) -> None:
    engine.check_invariants()
    stats = engine.server_info()
    assert stats["num_running_reqs"] == stats["num_queued_reqs"] == 0
    pool = engine.runner.kv_pool
    assert pool.available + engine.cache.total_size == pool.num_slots


def test_embeddings_of_ids_generate_what_the_ids_generate(engine: Engine) -> None:
    engine.flush_cache().result()
    ids = engine.tokenizer.encode("the radix tree caches the prefix")
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    by_embeds = engine.generate(input_embeds=table(engine)[ids].tolist(), sampling_params=GREEDY)
    assert by_embeds["output_ids"] == by_ids["output_ids"]
    assert by_embeds["text"] == by_ids["text"]
    assert by_embeds["meta_info"]["prompt_tokens"] == len(ids)
    no_leak(engine)


def test_a_tensor_is_taken_and_hidden_states_agree_with_the_ids_prompt(engine: Engine) -> None:
    ids = engine.tokenizer.encode("embeddings in, hidden states out")
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY, return_hidden_states=True)
    by_embeds = engine.generate(
        input_embeds=table(engine)[ids], sampling_params=GREEDY, return_hidden_states=True
    )
    assert by_embeds["output_ids"] == by_ids["output_ids"]
    ours, theirs = by_embeds["meta_info"]["hidden_states"], by_ids["meta_info"]["hidden_states"]
    assert torch.allclose(torch.tensor(ours[0]), torch.tensor(theirs[0]), atol=1e-5)
    assert torch.allclose(torch.tensor(ours[1:]), torch.tensor(theirs[1:]), atol=1e-5)


def test_two_embeddings_prompts_of_the_same_length_share_no_cache(engine: Engine) -> None:
    engine.flush_cache().result()
    generator = torch.Generator().manual_seed(0)
    first = torch.randn(10, table(engine).shape[1], generator=generator)
    second = torch.randn(10, table(engine).shape[1], generator=generator)
    a = engine.generate(input_embeds=first.tolist(), sampling_params=GREEDY)
    b = engine.generate(input_embeds=second.tolist(), sampling_params=GREEDY)
    assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_embeds=first.tolist(), sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 9  # every position but the last is reused
    assert again["output_ids"] == a["output_ids"]
    no_leak(engine)


def test_prompts_with_equal_leading_rows_share_exactly_those_positions(engine: Engine) -> None:
    engine.flush_cache().result()
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(12, table(engine).shape[1], generator=generator)
    other = rows.clone()
    other[5:] = torch.randn(7, rows.shape[1], generator=generator)
    engine.generate(input_embeds=rows.tolist(), sampling_params=GREEDY)
    out = engine.generate(input_embeds=other.tolist(), sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 5
    no_leak(engine)


def test_a_token_prompt_never_reuses_an_embeddings_prompt_of_its_ids(engine: Engine) -> None:
    engine.flush_cache().result()
    ids = engine.tokenizer.encode("a token prompt stays a token prompt")
    before = engine.generate(input_ids=ids, sampling_params=GREEDY)
    engine.flush_cache().result()
    engine.generate(input_embeds=table(engine)[ids].tolist(), sampling_params=GREEDY)
    after = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["output_ids"] == before["output_ids"]
    assert all(i < 0 for i in input_embeds_cache_ids(table(engine)[ids]))
    no_leak(engine)


def test_a_batch_mixes_embeddings_and_n_copies(engine: Engine) -> None:
    ids = [engine.tokenizer.encode(t) for t in ("hello world", "the cache")]
    embeds = [table(engine)[i].tolist() for i in ids]
    outs = engine.generate(input_embeds=embeds, sampling_params={**GREEDY, "n": 2})
    alone = [engine.generate(input_ids=i, sampling_params=GREEDY)["output_ids"] for i in ids]
    assert [o["output_ids"] for o in outs] == [alone[0], alone[0], alone[1], alone[1]]
    no_leak(engine)


def test_a_chunked_prefill_of_embeddings_equals_the_ids_prompt(model_dir: Path) -> None:
    with Engine(
        str(model_dir), show_progress=False, max_total_tokens=4096, chunked_prefill_size=4
    ) as eng:
        ids = eng.tokenizer.encode("a longer prompt that the scheduler splits into chunks of four")
        by_ids = eng.generate(input_ids=ids, sampling_params=GREEDY)
        by_embeds = eng.generate(input_embeds=table(eng)[ids].tolist(), sampling_params=GREEDY)
        assert by_embeds["output_ids"] == by_ids["output_ids"]
        no_leak(eng)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"input_embeds": [[0.0, 1.0]]}, "input_embeds", "[seq, 64]"),
        ({"input_embeds": [[0.0] * 64, [0.0] * 63]}, "input_embeds", "same length"),
        ({"input_embeds": [[float("nan")] * 64]}, "input_embeds", "NaN"),
        (
            {"input_embeds": [[0.0] * 64] * 3, "return_logprob": True, "logprob_start_len": 0},
            "logprob_start_len",
            "token ids",
        ),
    ],
)
def test_bad_embeddings_are_refused_naming_the_field(
    engine: Engine, body: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidRequest) as error:
        engine.generate(**body, sampling_params=GREEDY)
    assert error.value.field == field and words in str(error.value)


@pytest.mark.usefixtures("torch_kernels")  # both runs on the same (torch) kernels
def test_the_runner_takes_embeddings_rows_and_returns_only_the_hidden_states_asked(
    model_dir: Path,
) -> None:
    runner = ModelRunner(
        RunnerConfig(
            model=ModelConfig(str(model_dir), show_progress=False),
            memory=MemoryConfig(max_total_tokens=512, max_running_requests=4),
            attention=AttentionConfig(backend="torch_native"),
        )
    )
    lookup = runner.model.model.embed_tokens.weight.detach()
    prompts = [[5, 17, 99, 3], [42, 7, 7, 128, 64]]

    def run(embeds: bool) -> Any:
        entries = []
        for k, prompt in enumerate(prompts):
            row = runner.req_to_token_pool.alloc()
            slots = runner.kv_pool.alloc(len(prompt))
            assert row is not None and slots is not None
            entries.append(
                BatchEntry(
                    row,
                    [-7] * len(prompt) if embeds and k == 0 else prompt,
                    0,
                    slots,
                    input_embeds=lookup[prompt] if embeds and k == 0 else None,
                    return_hidden_states=k == 1,
                )
            )
        out = runner.forward(ForwardBatch.build(entries, runner.req_to_token_pool.req_to_token))
        for entry in entries:
            runner.kv_pool.free(entry.out_slots)
            runner.req_to_token_pool.free(entry.req_pool_index)
        return out

    plain, given = run(False), run(True)
    assert torch.equal(plain.next_token_logits, given.next_token_logits)
    assert given.hidden_states is not None and given.hidden_states[0] is None
    assert given.hidden_states[1].shape == (len(prompts[1]), lookup.shape[1])
    assert runner.kv_pool.available == runner.kv_pool.num_slots


def test_retracted_embeddings_prompts_resume_with_the_same_tokens_and_hidden_states(
    model_dir: Path,
) -> None:
    import dataclasses

    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.fixtures import sample_texts

    base = EngineConfig.from_kwargs(
        str(model_dir), show_progress=False, max_total_tokens=192, max_running_requests=16
    )
    # Admit optimistically so that decode runs out of slots and must retract.
    scheduler = dataclasses.replace(
        base.scheduler, init_new_token_ratio=0.02, min_new_token_ratio=0.0
    )
    params = {**GREEDY, "max_new_tokens": 20}
    with Engine(config=dataclasses.replace(base, scheduler=scheduler)) as eng:
        ids = [eng.tokenizer.encode(t) for t in sample_texts(8, seed=3)]
        outs = eng.generate(
            input_embeds=[table(eng)[i].tolist() for i in ids],
            sampling_params=params,
            return_hidden_states=True,
        )
        assert eng.server_info()["num_retractions"] > 0
        for prompt, out in zip(ids, outs, strict=True):
            alone = eng.generate(
                input_ids=prompt, sampling_params=params, return_hidden_states=True
            )
            assert out["output_ids"] == alone["output_ids"]
            ours, theirs = out["meta_info"]["hidden_states"], alone["meta_info"]["hidden_states"]
            assert len(ours) == len(theirs) == params["max_new_tokens"]
            assert torch.allclose(torch.tensor(ours[0]), torch.tensor(theirs[0]), atol=1e-4)
            assert torch.allclose(torch.tensor(ours[1:]), torch.tensor(theirs[1:]), atol=1e-4)
        no_leak(eng)
