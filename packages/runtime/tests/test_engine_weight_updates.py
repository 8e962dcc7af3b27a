"""Weight updates without a restart (reinforcement learning's rollout engine): from a
checkpoint directory and from tensors, the engine's next outputs are those of an engine
started on the new weights; K/V computed under the old weights is never reused; the weight
version is in every response; bad updates say what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import Engine, FlattenedTensorBucket
from radixlm.runtime.fixtures import build_tiny_model, checkpoint_tensors
from radixlm.sampling import InvalidRequest

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43, 44]]


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    """Engines with `cpu_threads` set this process's torch threads (the module fixtures'
    too): put them back after the module."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The policy before and after a training step: same shapes, other weights."""
    root = tmp_path_factory.mktemp("weights")
    return (
        build_tiny_model(root / "before", seed=0, init_std=0.3),
        build_tiny_model(root / "after", seed=1, init_std=0.3),
    )


def _engine(path: Path, **kwargs: Any) -> Engine:
    return Engine(str(path), show_progress=False, cpu_threads=1, **kwargs)


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


def test_an_update_from_disk_makes_the_next_outputs_the_new_models(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    before, after = models
    old, new = expected
    with _engine(before) as engine:
        first = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert first["meta_info"]["weight_version"] == "default"
        assert _outputs(engine) == old  # the prompts are cached now
        result = engine.update_weights_from_disk(str(after), weight_version="step-1").result()
        assert result == {
            "success": True,
            "message": "the weights were updated",
            "weight_version": "step-1",
        }
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        engine.check_invariants()
    assert [o["output_ids"] for o in out] == new
    assert all(o["meta_info"]["weight_version"] == "step-1" for o in out)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in out)  # nothing stale reused


def test_an_update_from_tensors_takes_any_subset(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    before, after = models
    _old, new = expected
    tensors = checkpoint_tensors(after)
    with _engine(before) as engine:
        _outputs(engine)
        # A part first (one layer's MLP), then the rest: the result is the new model.
        mlp = [(n, t) for n, t in tensors if ".mlp." in n and ".layers.0." in n]
        part = engine.update_weights_from_tensor(mlp).result()
        assert part["success"] and part["weight_version"] == "1"
        name = "model.layers.0.mlp.gate_proj.weight"
        want = dict(tensors)[name][:3]
        assert torch.equal(torch.tensor(engine.get_weights_by_name(name, truncate_size=3)), want)
        rest = [(n, t) for n, t in tensors if (n, t) not in mlp]
        assert engine.update_weights_from_tensor(rest).result()["weight_version"] == "2"
        assert _outputs(engine) == new
        engine.check_invariants()


def test_a_running_request_keeps_going_and_later_ones_do_not_reuse_old_kv(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """An update while a request streams: it finishes (on the new weights from then on); the
    cache cannot be flushed then, but a later request with the same prompt reuses nothing."""
    before, after = models
    _old, new = expected
    with _engine(before) as engine:
        stream = engine.generate(
            input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 64}, stream=True
        )
        next(iter(stream))
        result = engine.update_weights_from_disk(str(after)).result()
        assert result["success"] and "do not reuse" in result["message"]
        chunks = list(stream)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        engine.check_invariants()
    assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == new[0]


def test_bad_updates_say_what_is_wrong(models: tuple[Path, Path], tmp_path: Path) -> None:
    before, after = models
    tensors = dict(checkpoint_tensors(after))
    # A checkpoint that lacks a tensor the model needs: nothing changes.
    from safetensors.torch import save_file

    lacking = {k: v for k, v in tensors.items() if "layers.1." not in k}
    (tmp_path / "lacking").mkdir()
    save_file(lacking, str(tmp_path / "lacking" / "model.safetensors"))
    with _engine(before) as engine:
        old = _outputs(engine)
        result = engine.update_weights_from_disk(str(tmp_path / "lacking")).result()
        assert not result["success"] and "lacks" in result["message"]
        assert result["weight_version"] == "default" and _outputs(engine) == old
        missing = engine.update_weights_from_disk(str(tmp_path / "nowhere")).result()
        assert not missing["success"] and "nowhere" in missing["message"]
        shape = engine.update_weights_from_tensor([("model.norm.weight", torch.ones(3))]).result()
        assert not shape["success"] and "model.norm.weight" in shape["message"]
        unknown = engine.update_weights_from_tensor([("model.nothing.weight", torch.ones(3))])
        assert "does not know" in unknown.result()["message"]
        with pytest.raises(InvalidRequest, match="no weight named"):
            engine.get_weights_by_name("model.nothing.weight")
        engine.check_invariants()


def test_a_flattened_bucket_brings_every_tensor_to_an_engine_process_in_one_piece(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """SGLang's `load_format="flattened_bucket"`: one flat buffer and each tensor's place in
    it cross to the engine process; its next outputs are the new policy's."""
    before, after = models
    _old, new = expected
    bucket = FlattenedTensorBucket(named_tensors=checkpoint_tensors(after))
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    with _engine(before, engine_process=True, kv_cache_bytes=1 << 22) as engine:
        result = engine.update_weights_from_tensor(payload, load_format="flattened_bucket")
        assert result.result(60) == {
            "success": True,
            "message": "the weights were updated",
            "weight_version": "1",
        }
        assert _outputs(engine) == new
        engine.check_invariants()


def test_a_bucket_that_does_not_fit_its_buffer_is_refused_and_changes_nothing(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    before, after = models
    old, _new = expected
    bucket = FlattenedTensorBucket(named_tensors=checkpoint_tensors(after))
    short = FlattenedTensorBucket(
        flattened_tensor=bucket.flattened_tensor[:-4], metadata=bucket.metadata
    )
    with _engine(before, kv_cache_bytes=1 << 22) as engine:
        with pytest.raises(InvalidRequest, match=r"metadata\[\d+\] \(.*\): .* is not within"):
            engine.update_weights_from_tensor(short, load_format="flattened_bucket")
        with pytest.raises(InvalidRequest, match="load_format is None"):
            engine.update_weights_from_tensor(checkpoint_tensors(after), load_format="pickle")
        assert _outputs(engine) == old
        engine.check_invariants()


def _trainer(port: int, path: str) -> None:
    """A trainer process: rank 0 of a gloo group; broadcasts its policy's tensors in order."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)  # (the store waits for the engine)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for _name, tensor in checkpoint_tensors(Path(path)):
        group.broadcast([tensor.contiguous()], options).wait()


def test_a_trainer_broadcasts_new_weights_over_gloo(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """The toy RL loop's weight sync: a trainer process (rank 0) and the engine (rank 1) in a
    gloo group of their own; the engine (in deterministic mode, as RL rollouts run) gives the
    new policy's outputs, and their logprobs are what the new policy computes (recomputed in
    transformers here) within 1e-5."""
    import multiprocessing
    import socket

    import transformers

    before, after = models
    _old, new = expected
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    trainer = context.Process(target=_trainer, args=(port, str(after)), daemon=True)
    trainer.start()
    try:
        with _engine(before, enable_deterministic_inference=True) as engine:
            joined = engine.init_weights_update_group("127.0.0.1", port, 1, 2).result(120)
            assert joined["success"], joined
            tensors = checkpoint_tensors(after)
            result = engine.update_weights_from_distributed(
                [n for n, _ in tensors],
                [t.dtype for _, t in tensors],
                [t.shape for _, t in tensors],
            ).result(120)
            assert result["success"] and result["weight_version"] == "1", result
            outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
            again = engine.init_weights_update_group("127.0.0.1", port, 1, 2).result(10)
            assert not again["success"] and "exists" in again["message"]
    finally:
        trainer.join(30)
    assert [o["output_ids"] for o in outs] == new
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(after)).float().eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            logits = reference(ids).logits[0].log_softmax(-1)
        start = len(prompt) - 1
        want = [float(logits[start + i, t]) for i, t in enumerate(out["output_ids"])]
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        error = max(abs(a - b) for a, b in zip(got, want, strict=True))
        assert error < 1e-5, error  # (3.5e-6 and 5.0e-6 when written)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_pause_holds_requests_and_continue_finishes_them(
    models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]], mode: str
) -> None:
    """Paused (in place, or retracted to the queue), a request makes no progress; after
    continue_generation it finishes, and later requests give the outputs they would have
    had (same weights)."""
    import time

    before, _after = models
    old, _new = expected
    with _engine(before) as engine:
        long = {**GREEDY, "max_new_tokens": 200}
        stream = iter(engine.generate(input_ids=PROMPTS[0], sampling_params=long, stream=True))
        next(stream)
        assert engine.pause_generation(mode).result() is True
        info = engine.get_server_info()
        held = info["generated_tokens"]
        time.sleep(0.3)
        assert engine.get_server_info()["generated_tokens"] == held  # no step ran
        if mode == "retract":
            assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 1
        assert engine.continue_generation().result() is True
        *_, last = stream
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert _outputs(engine) == old
        engine.check_invariants()


def test_a_pause_that_aborts_ends_every_open_request(models: tuple[Path, Path]) -> None:
    before, _after = models
    with _engine(before) as engine:
        long = {**GREEDY, "max_new_tokens": 500}
        stream = iter(engine.generate(input_ids=PROMPTS[0], sampling_params=long, stream=True))
        next(stream)
        assert engine.pause_generation("abort").result() is True
        *_, last = stream
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        with pytest.raises(InvalidRequest, match="mode must be one of"):
            engine.pause_generation("sometimes").result()
        assert engine.continue_generation().result() is True
        assert len(_outputs(engine)) == 2
        engine.check_invariants()
