"""KV pool sizing and slot hand-out, the request table, and the CUDA-graph guards."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixlm.runtime import (
    AttentionConfig,
    BatchEntry,
    ForwardBatch,
    KVPool,
    MemoryConfig,
    ModelRunner,
    ReqToTokenPool,
)
from radixlm.runtime.cuda_graph import bucket_for, cuda_graphs_usable
from radixlm.runtime.memory import kv_pool_capacity


def test_pool_tensors_have_one_row_per_slot_plus_padding() -> None:
    pool = KVPool(3, 10, 2, 8, torch.float32, "cpu")
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    assert pool.k_buffers[0].shape == (11, 2, 8)
    assert pool.padding_slot == 10
    assert pool.bytes_per_token == 2 * 3 * 2 * 8 * 4


def test_slots_come_from_the_token_slot_allocator_and_go_back() -> None:
    pool = KVPool(1, 8, 1, 4, torch.float32, "cpu")
    first = pool.alloc(5)
    assert first is not None and len(set(first)) == 5
    assert pool.available == 3
    assert pool.alloc(4) is None
    pool.free(first)
    assert pool.available == 8
    assert pool.padding_slot not in (pool.alloc(8) or [])


def test_paged_pool_hands_out_page_aligned_runs() -> None:
    pool = KVPool(1, 18, 1, 4, torch.float32, "cpu", page_size=4)
    assert pool.num_slots == 16  # rounded down to whole pages
    slots = pool.alloc_pages(2)
    assert slots is not None and len(slots) == 8
    for start in (0, 4):
        run = slots[start : start + 4]
        assert run[0] % 4 == 0 and run == list(range(run[0], run[0] + 4))
    assert pool.available == 8
    pool.free(slots)
    assert pool.available == 16
    with pytest.raises(RuntimeError, match="alloc_pages"):
        pool.alloc(3)


def test_cpu_budget_in_bytes_or_tokens_sizes_the_pool() -> None:
    cpu = torch.device("cpu")
    tokens, budget = kv_pool_capacity(1000, cpu, MemoryConfig(kv_cache_bytes=50_500))
    assert (tokens, budget) == (50, 50_500)
    tokens, _ = kv_pool_capacity(1000, cpu, MemoryConfig(kv_cache_bytes=50_500, page_size=16))
    assert tokens == 48
    tokens, _ = kv_pool_capacity(1000, cpu, MemoryConfig(max_total_tokens=20))
    assert tokens == 20
    with pytest.raises(MemoryError, match="raise kv_cache_bytes"):
        kv_pool_capacity(1000, cpu, MemoryConfig(kv_cache_bytes=999))


def test_request_table_rows_are_handed_out_and_written() -> None:
    table = ReqToTokenPool(2, 16, "cpu")
    a, b = table.alloc(), table.alloc()
    assert {a, b} == {0, 1} and table.alloc() is None
    table.write(a, 0, [7, 8, 9])  # type: ignore[arg-type]
    assert table.read(a, 3) == [7, 8, 9]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context length"):
        table.write(a, 14, [1, 2, 3])  # type: ignore[arg-type]
    table.free(a)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not in use"):
        table.free(a)  # type: ignore[arg-type]


def test_forward_batch_records_new_slots_after_the_cached_prefix() -> None:
    table = ReqToTokenPool(4, 32, "cpu")
    batch = ForwardBatch.build(
        [BatchEntry(2, [5, 6, 7], 4, [20, 21, 22]), BatchEntry(0, [9], 10, [30])],
        table.req_to_token,
    )
    assert batch.positions.tolist() == [4, 5, 6, 10]
    assert batch.seq_lens.tolist() == [7, 11]
    assert not batch.is_decode
    batch.write_req_to_token()
    assert table.read(2, 7)[4:] == [20, 21, 22]
    assert table.read(0, 11)[10] == 30


def test_forward_batch_rejects_inconsistent_entries() -> None:
    table = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="2 output slots for 3 new tokens"):
        ForwardBatch.build([BatchEntry(0, [1, 2, 3], 0, [0, 1])], table)
    with pytest.raises(ValueError, match="no new tokens"):
        ForwardBatch.build([BatchEntry(0, [], 0, [])], table)
    with pytest.raises(ValueError, match="input logprob positions"):
        ForwardBatch.build(
            [BatchEntry(0, [1, 2], 0, [0, 1], input_logprob_start=1, input_logprob_targets=[3, 4])],
            table,
        )


def test_runner_pool_honours_the_memory_config(runners: dict[str, ModelRunner]) -> None:
    runner = runners["qwen2"]
    assert runner.kv_pool.num_slots == 2048
    assert runner.req_to_token_pool.max_requests == 16
    assert runner.context_length == 512  # the model's max_position_embeddings


def test_cuda_graphs_are_never_used_on_cpu(runners: dict[str, ModelRunner]) -> None:
    runner = runners["qwen2"]
    assert runner.graph_runner is None
    assert not cuda_graphs_usable(torch.device("cpu"), True, runner.attention)

    class Graphable:
        supports_cuda_graph = True

    assert not cuda_graphs_usable(torch.device("cpu"), True, Graphable())


def test_decode_batches_pad_to_the_smallest_bucket() -> None:
    buckets = list(AttentionConfig(cuda_graph_max_batch_size=40).graph_batch_sizes())
    assert buckets == [1, 2, 4, 8, 16, 24, 32, 40]
    assert bucket_for(1, buckets) == 1
    assert bucket_for(3, buckets) == 4
    assert bucket_for(17, buckets) == 24
    assert bucket_for(40, buckets) == 40
    assert bucket_for(41, buckets) is None


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_decode(
    hf_checkpoints: dict[str, Any], driver_for: Any
) -> None:
    from radixlm.runtime import RunnerConfig
    from radixlm.runtime.config import ModelConfig

    path, _ = hf_checkpoints["llama3"]

    def make(graph: bool) -> ModelRunner:
        return ModelRunner(
            RunnerConfig(
                model=ModelConfig(str(path), device="cuda", show_progress=False),
                memory=MemoryConfig(max_total_tokens=4096, max_running_requests=16),
                attention=AttentionConfig(
                    backend="triton", cuda_graph=graph, cuda_graph_max_batch_size=8
                ),
            )
        )

    prompts = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6], [100, 3]]
    results = []
    for graph in (True, False):
        runner = make(graph)
        assert (runner.graph_runner is not None) == graph
        driver = driver_for(runner)
        seqs = [driver.start(p) for p in prompts[:3]]  # 3 rows: padded to the bucket of 4
        out = driver.forward([driver.entry(s, p) for s, p in zip(seqs, prompts, strict=False)])
        tokens = [[int(t)] for t in out.next_token_logits.argmax(-1)]
        for _ in range(6):
            out = driver.forward(
                [driver.entry(s, t[-1:]) for s, t in zip(seqs, tokens, strict=True)]
            )
            for t, nxt in zip(tokens, out.next_token_logits.argmax(-1), strict=True):
                t.append(int(nxt))
        if graph:
            assert runner.stats.graph_replays == 6
        results.append(tokens)
    assert results[0] == results[1]


def test_a_bfloat16_kv_cache_under_a_float32_model_stays_close(
    hf_checkpoints: dict[str, Any], runners: dict[str, ModelRunner], driver_for: Any
) -> None:
    from radixlm.runtime import ModelConfig, RunnerConfig

    path, _ = hf_checkpoints["qwen2"]
    runner = ModelRunner(
        RunnerConfig(
            model=ModelConfig(str(path), show_progress=False),
            memory=MemoryConfig(max_total_tokens=256, kv_cache_dtype="bf16"),
        )
    )
    assert runner.kv_pool.k_buffers[0].dtype == torch.bfloat16
    prompt = [5, 17, 99, 3, 250, 42, 7, 7]
    ours = driver_for(runner).prompt_logits(prompt)
    reference = driver_for(runners["qwen2"]).prompt_logits(prompt)
    assert (ours - reference).abs().max().item() < 0.05 * reference.abs().max().item()
