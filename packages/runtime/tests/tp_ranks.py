"""Run a tensor-parallel group of model runners in spawned processes (a helper of the TP tests;
spawned processes import it by name, so it is a plain module beside them)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime import BatchEntry, ForwardBatch, ModelRunner
from radixlm.runtime.config import (
    AttentionConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
)
from radixlm.runtime.distributed import (
    SINGLE,
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)


def runner_config(path: str | Path, tp_size: int = 1) -> RunnerConfig:
    return RunnerConfig(
        model=ModelConfig(str(path), show_progress=False),
        memory=MemoryConfig(max_total_tokens=2048, max_running_requests=16),
        attention=AttentionConfig(backend="torch_native"),
        parallel=ParallelConfig(tp_size=tp_size, timeout=60),
    )


def _forward(runner: ModelRunner, row: int, tokens: list[int], prefix: int) -> Any:
    slots = runner.kv_pool.alloc(len(tokens))
    assert slots is not None
    batch = ForwardBatch.build(
        [BatchEntry(row, tokens, prefix, slots)], runner.req_to_token_pool.req_to_token
    )
    return runner.forward(batch)


def all_position_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, from one prefill."""
    row = runner.req_to_token_pool.alloc()
    slots = runner.kv_pool.alloc(len(prompt))
    assert row is not None and slots is not None
    batch = ForwardBatch.build(
        [BatchEntry(row, prompt, 0, slots)], runner.req_to_token_pool.req_to_token
    )
    batch.write_req_to_token()
    runner.attention.prepare(batch)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.attention)
        logits = runner.model.compute_logits(hidden)
    runner.kv_pool.free(slots)
    runner.req_to_token_pool.free(row)
    return logits


def greedy(runner: ModelRunner, prompt: list[int], steps: int, tp: TensorParallel) -> list[int]:
    """Prefill then greedy decode steps (EOS id 1 banned); rank 0 picks each token and
    broadcasts it, as the engine does."""
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    generated: list[int] = []
    out = _forward(runner, row, prompt, 0)
    length = len(prompt)
    for _ in range(steps):
        logits = out.next_token_logits[0].clone()
        logits[1] = float("-inf")
        token = tp.broadcast(int(logits.argmax()) if tp.is_driver else None)
        generated.append(token)
        if len(generated) == steps:
            break
        out = _forward(runner, row, [token], length)
        length += 1
    runner.kv_pool.reset()
    runner.req_to_token_pool.free(row)
    return generated


def probe(
    paths: list[str], prompt: list[int], steps: int, tp: TensorParallel = SINGLE
) -> dict[str, Any]:
    """Per model: all-position logits, a greedy continuation, and every rank's weight bytes."""
    results: dict[str, Any] = {}
    for path in paths:
        runner = ModelRunner(runner_config(path, tp.size), tp=tp)
        results[path] = {
            "logits": all_position_logits(runner, prompt),
            "greedy": greedy(runner, prompt, steps, tp),
            "weight_bytes": tp.gather_objects(runner.weight_bytes),
            "kv_heads": runner.kv_pool.num_kv_heads,
        }
    return results


def _rank_main(rank: int, size: int, method: str, args: tuple[Any, ...], out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(
        ParallelConfig(tp_size=size, timeout=60), rank, method, torch.device("cpu")
    )
    result = probe(*args, tp=tp)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(result))
    tp.gather_objects(None)  # every rank is done before any leaves the group
    destroy_tensor_parallel()


def probe_on_ranks(size: int, workdir: Path, *args: Any) -> dict[str, Any]:
    """`probe(*args)` on a group of `size` spawned ranks; rank 0's result."""
    import torch.multiprocessing as mp

    out = workdir / f"probe-{size}.pkl"
    method = (workdir / f"rendezvous-{size}").as_uri()
    mp.start_processes(
        _rank_main, args=(size, method, args, str(out)), nprocs=size, start_method="spawn"
    )
    result: dict[str, Any] = pickle.loads(out.read_bytes())
    return result
