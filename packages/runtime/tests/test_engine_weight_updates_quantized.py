"""Weight updates on a model quantized at load time: the new full-precision tensors are
quantized as the loader quantizes them at start (the LM head's int8 copy too), so the next
outputs are those of an engine started quantized on the new weights, on the CPU decode path as
well; weights stored quantized (a GGUF file's blocks) are refused with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm import kernels
from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model, checkpoint_tensors

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43, 44]]


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    """Engines with `cpu_threads` set this process's torch threads: put them back after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The policy before and after a training step: same shapes, other weights."""
    root = tmp_path_factory.mktemp("quantized-weights")
    return (
        build_tiny_model(root / "before", seed=0, init_std=0.3),
        build_tiny_model(root / "after", seed=1, init_std=0.3),
    )


def _engine(path: Path | str, **kwargs: Any) -> Engine:
    # One torch thread: decode steps take the CPU decode path (radixlm's C kernels).
    return Engine(str(path), show_progress=False, cpu_threads=1, **kwargs)


def _outputs(engine: Engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _count_cpu_decode_steps(engine: Engine) -> list[int]:
    """A counter of the steps the engine's CPU decode path runs from now on."""
    path = engine.runner.cpu_decode
    assert path is not None
    count = [0]
    forward = path.forward

    def counted(batch: Any) -> torch.Tensor:
        count[0] += 1
        return forward(batch)

    path.forward = counted  # type: ignore[method-assign]
    return count


def test_an_int4_engine_updated_from_disk_answers_as_one_started_on_the_new_weights(
    models: tuple[Path, Path],
) -> None:
    """The decode steps after the update run on the CPU decode path (radixlm's C kernels,
    built again over the new int4 tensors) and give the new policy's tokens."""
    if not kernels.cpu.available():
        pytest.skip("radixlm's CPU kernels are not built here")
    before, after = models
    with _engine(after, quantization="int4") as engine:
        new = _outputs(engine)
    with _engine(before, quantization="int4") as engine:
        old = _outputs(engine)
        assert old != new  # the two policies differ, quantized too
        result = engine.update_weights_from_disk(str(after)).result()
        assert result["success"], result
        steps = _count_cpu_decode_steps(engine)
        assert _outputs(engine) == new
        assert steps[0] >= GREEDY["max_new_tokens"] - 1
        engine.check_invariants()


def test_an_int8_engine_updated_from_tensors_in_parts_answers_as_one_started_on_them(
    models: tuple[Path, Path],
) -> None:
    """Parts of merged projections (q alone, then k and v), the untied LM head (its int8 copy
    is made again) and the rest, pushed one after another."""
    before, after = models
    tensors = checkpoint_tensors(after)
    with _engine(after, quantization="int8") as engine:
        new = _outputs(engine)
    with _engine(before, quantization="int8") as engine:
        _outputs(engine)
        parts = [
            [(n, t) for n, t in tensors if n.endswith("q_proj.weight")],
            [(n, t) for n, t in tensors if n == "lm_head.weight"],
        ]
        parts.append([(n, t) for n, t in tensors if all((n, t) not in p for p in parts)])
        for part in parts:
            result = engine.update_weights_from_tensor(part).result()
            assert result["success"], result
        assert _outputs(engine) == new
        engine.check_invariants()


def test_a_bad_tensor_leaves_a_quantized_engine_running(models: tuple[Path, Path]) -> None:
    """A shape that does not fit fails the update (partly done, says so), and the layers
    it reached still run: the engine answers, and a full update then restores the policy."""
    before = models[0]
    with _engine(before, quantization="int4") as engine:
        old = _outputs(engine)
        name = "model.layers.0.self_attn.q_proj.weight"
        bad = engine.update_weights_from_tensor([(name, torch.zeros(3, 3))]).result()
        assert not bad["success"] and name in bad["message"]
        assert "partly" in bad["message"]
        assert len(_outputs(engine)) == 2
        restored = engine.update_weights_from_disk(str(before)).result()
        assert restored["success"] and _outputs(engine) == old
        engine.check_invariants()


def _trainer(port: int, path: str) -> None:
    """A trainer process: rank 0 of a gloo group; broadcasts its policy's tensors in order."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for _name, tensor in checkpoint_tensors(Path(path)):
        group.broadcast([tensor.contiguous()], options).wait()


def test_a_gguf_model_refuses_updates_saying_what_to_serve_instead(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """From disk, tensors or a trainer's group; the trainer's broadcasts are taken all the
    same (it is not left waiting), and the model is unchanged."""
    pytest.importorskip("gguf")
    import multiprocessing
    import socket

    from radixlm.runtime.fixtures import build_tiny_gguf

    before, after = models
    path = build_tiny_gguf(before, tmp_path / "tiny.gguf", "Q4_0")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer, args=(port, str(after)), daemon=True
    )
    trainer.start()
    with _engine(path) as engine:
        old = _outputs(engine)
        result = engine.update_weights_from_disk(str(after)).result()
        assert not result["success"] and result["weight_version"] == "default"
        assert "GGUF" in result["message"] and "quantization='int4'" in result["message"]
        pushed = engine.update_weights_from_tensor(checkpoint_tensors(after)).result()
        assert not pushed["success"] and "GGUF" in pushed["message"]
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2).result(120)["success"]
        tensors = checkpoint_tensors(after)
        sent = engine.update_weights_from_distributed(
            [n for n, _ in tensors], [t.dtype for _, t in tensors], [t.shape for _, t in tensors]
        ).result(120)
        assert not sent["success"] and "GGUF" in sent["message"]
        trainer.join(60)
        assert trainer.exitcode == 0  # every broadcast was received
        assert _outputs(engine) == old
