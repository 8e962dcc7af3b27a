"""A rollout engine gives its memory to the trainer and takes it back (SGLang's
`release_memory_occupation` / `resume_memory_occupation`): the process's resident memory
really drops, nothing runs on memory that is gone (requests wait, updates of released weights
are refused), the radix cache starts empty after it, and verl's order — release both, resume
the weights, update them, resume the KV cache — serves the new policy."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model, checkpoint_tensors
from radixlm.runtime.models.linear import cpu_packing_available
from radixlm.sampling import InvalidRequest

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43, 44]]
MiB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    """Engines with `cpu_threads` set this process's torch threads: put them back after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The policy before and after a training step: same shapes, other weights."""
    root = tmp_path_factory.mktemp("policies")
    return (
        build_tiny_model(root / "before", seed=0, init_std=0.3),
        build_tiny_model(root / "after", seed=1, init_std=0.3),
    )


def _engine(path: Path, kv_bytes: int = 4 * MiB, **kwargs: Any) -> Engine:
    kwargs.setdefault("cpu_threads", 1)
    return Engine(str(path), show_progress=False, kv_cache_bytes=kv_bytes, **kwargs)


def _outputs(engine: Engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def expected(models: tuple[Path, Path]) -> tuple[list[list[int]], list[list[int]]]:
    before, after = models
    with _engine(before) as engine:
        old = _outputs(engine)
    with _engine(after) as engine:
        new = _outputs(engine)
    assert old != new  # the two policies differ
    return old, new


def _rss(pid: int | None = None) -> int:
    return int(psutil.Process(pid).memory_info().rss)


class _Background:
    """A blocking generate call on a thread: whether it ended, and its outputs."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: dict[str, Any]):
        self.result: Any = None
        self._thread = threading.Thread(
            target=self._run, args=(engine, prompts, params), daemon=True
        )
        self._thread.start()

    def _run(self, engine: Engine, prompts: list[list[int]], params: dict[str, Any]) -> None:
        self.result = engine.generate(input_ids=prompts, sampling_params=params)

    def done(self, timeout: float = 0.0) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _wait_queued(engine: Engine, count: int) -> None:
    deadline = time.monotonic() + 10
    while engine.server_info(fresh=True)["num_queued_reqs"] < count:
        assert time.monotonic() < deadline, "the request never reached the queue"
        time.sleep(0.01)


def _pool_bytes(engine: Engine) -> int:
    """The bytes the KV pool's buffers hold now (thread mode)."""

    def count(core: Any) -> int:
        pool = core.executor.runner.kv_pool
        buffers = [*pool.k_buffers, *pool.v_buffers]
        return sum(buffer.untyped_storage().nbytes() for buffer in buffers)

    return engine.run_in_loop(count)


def test_releasing_the_kv_cache_frees_its_buffers_and_resuming_allocates_them_again(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """A 64 MiB KV pool on a thread engine: each release frees its buffers (all of them, twice:
    a second release must free as well) and each resume allocates them again; after a resume
    the pool is empty, the cache reuses nothing, and the outputs are what they were. (The
    resident memory is checked on a core in its own process, below: this pytest process's
    2 GB resident set moves by tens of MiB with whatever else it does.)"""
    before, _after = models
    old, _new = expected
    with _engine(before, kv_bytes=64 * MiB) as engine:
        assert _outputs(engine) == old
        full = _pool_bytes(engine)
        assert full > 60 * MiB, full
        for _round in range(2):
            answer = engine.release_memory_occupation(["kv_cache"]).result()
            assert answer["success"] is True and "kv_cache" in answer["message"], answer
            assert _pool_bytes(engine) == 0
            info = engine.server_info(fresh=True)
            assert info["memory_released"] == ["kv_cache"] and info["cache_size"] == 0
            assert engine.resume_memory_occupation(["kv_cache"]).result()["success"] is True
            assert _pool_bytes(engine) == full
            info = engine.server_info(fresh=True)
            assert info["memory_released"] == [] and info["token_usage"] == 0.0  # all free
            engine.check_invariants()
            outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == old
            assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)  # flushed
        engine.check_invariants()


def test_verls_order_release_both_then_resume_weights_update_resume_kv_serves_the_new_policy(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    before, after = models
    _old, new = expected
    with _engine(before) as engine:
        _outputs(engine)
        released = engine.release_memory_occupation(["kv_cache", "weights"]).result()
        assert released["success"] is True, released
        resumed = engine.resume_memory_occupation(["weights"]).result()
        info = engine.server_info(fresh=True)
        assert "zeros" in resumed["message"] and info["weights_unwritten"] > 0
        update = engine.update_weights_from_disk(str(after), weight_version="step-1").result()
        assert update["success"] is True, update
        assert engine.server_info(fresh=True)["weights_unwritten"] == 0
        assert engine.resume_memory_occupation(["kv_cache"]).result()["success"] is True
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        engine.check_invariants()
    assert [o["output_ids"] for o in outs] == new
    assert all(o["meta_info"]["weight_version"] == "step-1" for o in outs)


@pytest.mark.thread_only("reads the model's parameters")
def test_releasing_the_weights_frees_every_parameters_storage_and_keeps_its_shape(
    models: tuple[Path, Path],
) -> None:
    """(On one thread the CPU decode path holds float32 projections in panels and releases
    their plain weights: released, those come back plain first; resumed, the path lays the
    zeros out again, so the weights are checked as the runner reads them.)"""
    before, _after = models
    with _engine(before) as engine:

        def weights(core: Any) -> dict[str, torch.Tensor]:
            runner = core.executor.runner
            return {name: runner.weight(name).clone() for name in runner.checkpoint_names()}

        params = engine.run_in_loop(lambda core: list(core.executor.runner.model.parameters()))
        loaded = engine.run_in_loop(weights)
        assert engine.release_memory_occupation(["weights"]).result()["success"] is True
        assert all(p.untyped_storage().nbytes() == 0 for p in params)
        assert engine.resume_memory_occupation(["weights"]).result()["success"] is True
        resumed = engine.run_in_loop(weights)
        assert resumed.keys() == loaded.keys()
        for name, tensor in resumed.items():
            assert tensor.shape == loaded[name].shape and not tensor.any(), name


def test_a_request_sent_while_the_kv_cache_is_released_waits_for_the_resume(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    before, _after = models
    old, _new = expected
    with _engine(before) as engine:
        assert engine.release_memory_occupation(["kv_cache"]).result()["success"] is True
        call = _Background(engine, PROMPTS, GREEDY)
        _wait_queued(engine, 2)
        assert not call.done(0.3)  # no step runs on the released pool
        assert engine.server_info(fresh=True)["generated_tokens"] == 0
        assert engine.resume_memory_occupation(["kv_cache"]).result()["success"] is True
        assert call.done(30)
        engine.check_invariants()
    assert [o["output_ids"] for o in call.result] == old


def test_resumed_weights_hold_requests_until_updates_have_written_every_one(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """After `resume(["weights"])` the weights are zeros: a request waits through a partial
    update and runs once the rest is written, on the new policy."""
    before, after = models
    _old, new = expected
    tensors = checkpoint_tensors(after)
    with _engine(before) as engine:
        assert engine.release_memory_occupation("weights").result()["success"] is True
        assert engine.resume_memory_occupation("weights").result()["success"] is True
        norm = engine.get_weights_by_name("model.norm.weight", truncate_size=4)
        assert norm == [0.0, 0.0, 0.0, 0.0]
        call = _Background(engine, PROMPTS, GREEDY)
        _wait_queued(engine, 2)
        mlp = [(n, t) for n, t in tensors if ".mlp." in n]
        assert engine.update_weights_from_tensor(mlp).result()["success"] is True
        unwritten = engine.server_info(fresh=True)["weights_unwritten"]
        assert unwritten == len(tensors) - len(mlp)
        assert not call.done(0.3)
        rest = [(n, t) for n, t in tensors if ".mlp." not in n]
        assert engine.update_weights_from_tensor(rest).result()["success"] is True
        assert call.done(30)
        engine.check_invariants()
    assert [o["output_ids"] for o in call.result] == new


def test_a_release_while_a_request_runs_is_refused_until_it_is_retracted(
    models: tuple[Path, Path],
) -> None:
    """SGLang releases only an idle engine: a running request is refused with what to do;
    retracted by a pause, it waits through the release and finishes after the resume with
    the output it would have had."""
    before, _after = models
    long = {**GREEDY, "max_new_tokens": 40}
    with _engine(before) as engine:
        whole = engine.generate(input_ids=PROMPTS[0], sampling_params=long)["output_ids"]
        engine.flush_cache()
        stream = iter(engine.generate(input_ids=PROMPTS[0], sampling_params=long, stream=True))
        next(stream)
        assert engine.pause_generation("in_place").result() is True
        refused = engine.release_memory_occupation().result()
        assert refused["success"] is False and "pause_generation('retract')" in refused["message"]
        assert engine.server_info(fresh=True)["memory_released"] == []
        assert engine.pause_generation("retract").result() is True
        assert engine.release_memory_occupation(["kv_cache"]).result()["success"] is True
        assert engine.continue_generation().result() is True  # still held: kv_cache is gone
        assert engine.resume_memory_occupation().result()["success"] is True
        *_, last = stream
        engine.check_invariants()
    assert last["output_ids"] == whole and last["meta_info"]["finish_reason"]["type"] == "length"


def test_bad_memory_calls_say_what_is_wrong(models: tuple[Path, Path]) -> None:
    before, after = models
    with _engine(before) as engine:
        with pytest.raises(InvalidRequest, match="unknown memory tag 'gpu'") as error:
            engine.release_memory_occupation(["gpu"]).result()
        assert error.value.field == "tags"
        assert engine.release_memory_occupation(["weights"]).result()["success"] is True
        update = engine.update_weights_from_disk(str(after)).result()
        assert update["success"] is False and "resume_memory_occupation" in update["message"]
        with pytest.raises(InvalidRequest, match="weights are released"):
            engine.get_weights_by_name("model.norm.weight")
        again = engine.resume_memory_occupation(["kv_cache"]).result()
        assert again["success"] is True and "not released: kv_cache" in again["message"]
        engine.check_invariants()


@pytest.mark.skipif(not cpu_packing_available(), reason="oneDNN cannot pack weights here")
def test_weights_that_onednn_packed_are_not_released(
    models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without radixlm's C kernels (whose path holds float32 weights in panels) the first
    forward packs the linear weights for oneDNN and drops their plain copies, which no update
    could fill again after a resume."""
    from radixlm import kernels

    monkeypatch.setattr(kernels.cpu, "available", lambda: False)
    before, _after = models
    with _engine(before, cpu_threads=2) as engine:
        _outputs(engine)
        refused = engine.release_memory_occupation().result()
        assert refused["success"] is False and "cpu_weight_packing=False" in refused["message"]
        assert engine.release_memory_occupation(["kv_cache"]).result()["success"] is True
        assert engine.resume_memory_occupation().result()["success"] is True
        engine.check_invariants()


def test_the_engine_process_gives_the_memory_back_too(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """The same commands reach a core in its own process: its resident memory drops by about
    the pool's 64 MiB at each release and returns at each resume, and its server info says what
    is released."""
    before, _after = models
    old, _new = expected
    with _engine(before, kv_bytes=64 * MiB, engine_process=True) as engine:
        pid = engine.engine_pid
        assert pid is not None
        for _round in range(2):  # a second release must return memory as well
            resident = _rss(pid)
            assert engine.release_memory_occupation(["kv_cache"]).result(60)["success"] is True
            released = _rss(pid)
            assert resident - released > 56 * MiB, (resident, released)
            assert engine.server_info(fresh=True)["memory_released"] == ["kv_cache"]
            assert engine.resume_memory_occupation().result(60)["success"] is True
            assert _rss(pid) - released > 56 * MiB
            assert _outputs(engine) == old
        engine.check_invariants()
