"""Weight updates under tensor parallelism (TP=2, gloo on CPU): every rank takes its shard of
each new tensor, from disk, from rank 0's tensors or from a trainer's group, and the engine's
next outputs are those of a TP=2 engine started on the new weights; get_weights_by_name
answers the whole tensor; LoRA adapters pushed as tensors reach every rank.

Two engines, each started once: `on_a` on policy A, `on_b` (serving LoRA adapters) on policy
B. Each test leaves its engine on the policy it found it on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_random_lora, build_tiny_model, checkpoint_tensors

#: Slow (engines started in processes of their own): in the workspace run, not the package's
#: own environment's (`hatch run alone.runtime:test` deselects `slow`).
pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43, 44]]
OPTIONS: dict[str, Any] = {
    "show_progress": False,
    "tp_size": 2,
    "dist_timeout": 30,
    "max_total_tokens": 2048,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Policies A and B: Qwen2 (q/k/v biases), 4 query heads and 2 K/V heads over 2 ranks."""
    root = tmp_path_factory.mktemp("tp-weights")
    return (
        build_tiny_model(root / "a", "Qwen2ForCausalLM", seed=0, init_std=0.3),
        build_tiny_model(root / "b", "Qwen2ForCausalLM", seed=1, init_std=0.3),
    )


@pytest.fixture(scope="module")
def on_a(models: tuple[Path, Path]) -> Iterator[Engine]:
    with Engine(str(models[0]), **OPTIONS) as engine:
        yield engine


@pytest.fixture(scope="module")
def on_b(models: tuple[Path, Path]) -> Iterator[Engine]:
    options = {**OPTIONS, "enable_lora": True, "max_lora_rank": 8, "max_loras_per_batch": 2}
    with Engine(str(models[1]), **options) as engine:
        yield engine


def _outputs(engine: Engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def expected(on_a: Engine, on_b: Engine) -> tuple[list[list[int]], list[list[int]]]:
    """The outputs of a TP=2 engine started on A, and of one started on B."""
    outputs = _outputs(on_a), _outputs(on_b)
    assert outputs[0] != outputs[1]  # the two policies differ
    return outputs


def _update_from_disk(engine: Engine, path: Path) -> None:
    result = engine.update_weights_from_disk(str(path)).result(60)
    assert result["success"], result


def test_an_update_from_disk_gives_the_outputs_of_an_engine_started_on_the_new_weights(
    on_a: Engine, models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    a, b = models
    old, new = expected
    result = on_a.update_weights_from_disk(str(b), weight_version="b").result(60)
    assert result == {"success": True, "message": "the weights were updated", "weight_version": "b"}
    outs = on_a.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == new
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)  # nothing stale reused
    _update_from_disk(on_a, a)
    assert _outputs(on_a) == old
    on_a.check_invariants()


def test_an_update_from_tensors_in_parts_gives_the_outputs_of_an_engine_started_on_them(
    on_b: Engine, models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """Rank 0 holds the tensors whole and broadcasts them; a part first (one layer's
    attention: sharded q/k/v rows with their biases, o_proj's columns), then the rest."""
    a, b = models
    old, new = expected
    tensors = checkpoint_tensors(a)
    part = [(n, t) for n, t in tensors if ".layers.0.self_attn." in n]
    rest = [(n, t) for n, t in tensors if ".layers.0.self_attn." not in n]
    assert on_b.update_weights_from_tensor(part).result(60)["success"]
    assert _outputs(on_b) not in (old, new)  # a mix of the two policies
    assert on_b.update_weights_from_tensor(rest).result(60)["weight_version"] == "2"
    assert _outputs(on_b) == old
    _update_from_disk(on_b, b)
    assert _outputs(on_b) == new
    on_b.check_invariants()


def test_a_bad_tensor_under_tp_says_which_and_the_engine_goes_on(
    on_a: Engine, expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    old, _new = expected
    name = "model.layers.1.mlp.down_proj.weight"
    bad = on_a.update_weights_from_tensor([(name, torch.zeros(64, 3))]).result(60)
    assert not bad["success"] and name in bad["message"] and "partly" in bad["message"]
    odd = on_a.update_weights_from_tensor([(name, [[0.0]])]).result(60)
    assert not odd["success"] and "not a torch tensor" in odd["message"]
    assert _outputs(on_a) == old  # the bad tensor was refused before it reached the layer
    on_a.check_invariants()


def test_get_weights_by_name_gathers_the_whole_tensor_from_the_ranks(
    on_a: Engine, on_b: Engine, models: tuple[Path, Path], expected: Any
) -> None:
    """SGLang answers rank 0's rows of a column-parallel weight; these are the rows of the
    whole tensor, each rank's shard in its place (past rank 0's rows too), the layers a LoRA
    wrapper holds (`on_b`) included."""
    for engine, path in ((on_a, models[0]), (on_b, models[1])):
        tensors = dict(checkpoint_tensors(path))
        for name in (
            "model.layers.0.self_attn.q_proj.weight",  # rows split over the ranks
            "model.layers.0.self_attn.k_proj.bias",  # one K/V head per rank
            "model.layers.1.self_attn.o_proj.weight",  # input columns split
            "model.layers.1.mlp.down_proj.weight",
            "model.embed_tokens.weight",  # the vocabulary split
            "lm_head.weight",
            "model.norm.weight",  # replicated
        ):
            got = torch.tensor(engine.get_weights_by_name(name, truncate_size=1000))
            assert torch.equal(got, tensors[name][:1000]), name
    q = "model.layers.0.self_attn.q_proj.weight"
    first = torch.tensor(on_a.get_weights_by_name(q, truncate_size=3))
    assert torch.equal(first, dict(checkpoint_tensors(models[0]))[q][:3])


def _trainer(port: int, path: str, world_size: int) -> None:
    """A trainer process: rank 0 of a gloo group; broadcasts its policy's tensors in order."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, world_size, timeout)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for _name, tensor in checkpoint_tensors(Path(path)):
        group.broadcast([tensor.contiguous()], options).wait()


def test_a_trainer_group_reaches_every_rank(
    on_a: Engine, models: tuple[Path, Path], expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """SGLang's layout: the trainer is rank 0, TP rank r joins as `rank_offset + r`, so a
    group of 1 + tp_size ranks; each rank receives every tensor and keeps its shard."""
    import multiprocessing
    import socket

    a, b = models
    old, new = expected
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    too_small = on_a.init_weights_update_group("127.0.0.1", port, 1, 2).result(10)
    assert not too_small["success"] and "world_size - 2" in too_small["message"]
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer, args=(port, str(b), 3), daemon=True
    )
    trainer.start()
    try:
        joined = on_a.init_weights_update_group("127.0.0.1", port, 1, 3).result(120)
        assert joined == {"success": True, "message": "joined 'weight_update_group' as rank 1..2"}
        tensors = checkpoint_tensors(b)
        result = on_a.update_weights_from_distributed(
            [n for n, _ in tensors], [t.dtype for _, t in tensors], [t.shape for _, t in tensors]
        ).result(120)
        assert result["success"], result
        assert _outputs(on_a) == new
    finally:
        trainer.join(30)
    _update_from_disk(on_a, a)
    assert _outputs(on_a) == old
    on_a.check_invariants()


def test_a_lora_adapter_pushed_as_tensors_reaches_every_rank(
    on_b: Engine, models: tuple[Path, Path], tmp_path: Path, expected: Any
) -> None:
    """The other rank cannot read an adapter pushed as tensors from a directory: it gets the
    tensors from rank 0. Outputs equal the same adapters loaded from their directories, with
    more adapters than slots (each rank swaps them in and out); pushed again under the same
    name, the new tensors answer."""
    from safetensors.torch import load_file

    adapters = [
        build_random_lora(models[1], tmp_path / name, rank=8, seed=seed, scale=0.3)
        for name, seed in (("x", 1), ("y", 2))
    ]
    for name, path in zip(("x", "y"), adapters, strict=True):
        on_b.load_lora_adapter(name, str(path)).result(60)

    def pushed(path: Path) -> None:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        config = json.loads((path / "adapter_config.json").read_text())
        on_b.load_lora_adapter_from_tensors("pushed", tensors, config).result(60)

    def outputs(names: list[str | None]) -> list[list[int]]:
        prompts = [PROMPTS[0]] * len(names)
        outs = on_b.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
        return [o["output_ids"] for o in outs]

    from_dirs = outputs(["x", "y"])
    assert from_dirs[0] != from_dirs[1]
    pushed(adapters[0])
    assert outputs(["pushed", "y", "x"]) == [from_dirs[0], from_dirs[1], from_dirs[0]]
    pushed(adapters[1])
    assert outputs(["pushed", "x"]) == [from_dirs[1], from_dirs[0]]
    for name in ("pushed", "x", "y"):
        on_b.unload_lora_adapter(name).result(30)
    assert on_b.lora_adapters() == {}
    on_b.check_invariants()
