"""LoRA adapters: radixlm against transformers + peft, batches of mixed adapters, the cache,
loading and unloading at run time, and bad adapters."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")

from radixlm.runtime import Engine, ModelRunner  # noqa: E402
from radixlm.runtime.config import LoraConfig, RunnerConfig  # noqa: E402
from radixlm.runtime.executor import ForwardStep, run_forward  # noqa: E402
from radixlm.runtime.fixtures import build_tiny_tokenizer  # noqa: E402
from radixlm.runtime.forward_batch import BatchEntry  # noqa: E402
from radixlm.runtime.lora import LoraAdapterError, load_adapter  # noqa: E402
from radixlm.runtime.scheduler.adapters import AdapterSlots  # noqa: E402
from radixlm.sampling import InvalidRequest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Each family's adapter: ranks, alphas, targets and rsLoRA differ.
ADAPTERS: dict[str, dict[str, Any]] = {
    "llama3": dict(r=8, lora_alpha=16, target_modules=ALL),
    "mistral": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "qwen2": dict(
        r=16,
        lora_alpha=8,
        target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
        alpha_pattern={"down_proj": 32},
    ),
    "qwen3": dict(r=8, lora_alpha=32, target_modules=ALL, rank_pattern={"v_proj": 4}),
}
PROMPT = [3, 17, 42, 99, 7, 150, 23, 64, 11, 200, 5, 77]


def make_adapter(
    factory: Callable[..., Any], family: str, path: Path, seed: int, **overrides: Any
) -> Any:
    """A random PEFT adapter saved at `path`; returns the peft model (the reference)."""
    base = factory(family)
    settings = {**ADAPTERS[family], **overrides}
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **settings))
    model.eval()
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def family_setups(
    tmp_path_factory: pytest.TempPathFactory, hf_model_factory: Callable[..., Any]
) -> dict[str, tuple[Path, list[tuple[str, Path, Any]]]]:
    """family -> (base checkpoint, [(adapter name, directory, peft model) x 3])."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for family in ADAPTERS:
        base_dir = root / family
        hf_model_factory(family).save_pretrained(base_dir)
        build_tiny_tokenizer(base_dir, vocab_size=300)  # the engine detokenizes outputs
        adapters = []
        for k, name in enumerate(("a", "b", "c")):
            path = root / f"{family}-{name}"
            adapters.append((name, path, make_adapter(hf_model_factory, family, path, 10 + k)))
        out[family] = (base_dir, adapters)
    return out


def peft_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([list(ids)])).logits[0]
    return logits


def base_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with model.disable_adapter():
        return peft_logits(model, ids)


def peft_greedy(model: Any, ids: Sequence[int], steps: int) -> list[int]:
    tokens = list(ids)
    for _ in range(steps):
        tokens.append(int(peft_logits(model, tokens)[-1].argmax()))
    return tokens[len(ids) :]


class LoraDriver:
    """Runs forwards on a runner with adapter slots, as the executor does."""

    def __init__(self, runner: ModelRunner, table: Sequence[tuple[str, str] | None]) -> None:
        self.runner = runner
        self.table = tuple(table) + (None,) * (runner.lora.shape.slots - len(table))  # type: ignore[union-attr]

    def run(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[torch.Tensor]:
        """Prefill each (prompt, slot) in one forward; logits at every prompt position of
        each, computed position by position after the first (decode steps, mixed slots)."""
        runner = self.runner
        rows, slots = [], []
        for _ in requests:
            rows.append(runner.req_to_token_pool.alloc())
            slots.append([])
        logits: list[list[torch.Tensor]] = [[] for _ in requests]
        try:
            length = max(len(p) for p, _ in requests)
            for position in range(length):
                entries = []
                live = []
                for i, (prompt, slot) in enumerate(requests):
                    if position >= len(prompt):
                        continue
                    new = runner.kv_pool.alloc(1)
                    assert new is not None
                    entries.append(
                        BatchEntry(rows[i], [prompt[position]], position, new, lora_slot=slot)
                    )
                    slots[i].extend(new)
                    live.append(i)
                out = run_forward(runner, ForwardStep([], entries, self.table))
                for k, i in enumerate(live):
                    logits[i].append(out.next_token_logits[k])
            return [torch.stack(rows_) for rows_ in logits]
        finally:
            for row, used in zip(rows, slots, strict=True):
                runner.kv_pool.free(used)
                runner.req_to_token_pool.free(row)

    def prefill_last(self, requests: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
        """One forward prefilling every request at once: the last position's logits."""
        runner = self.runner
        entries, used = [], []
        for prompt, slot in requests:
            row = runner.req_to_token_pool.alloc()
            new = runner.kv_pool.alloc(len(prompt))
            entries.append(BatchEntry(row, list(prompt), 0, new, lora_slot=slot))
            used.append((row, new))
        try:
            return run_forward(runner, ForwardStep([], entries, self.table)).next_token_logits
        finally:
            for row, new in used:
                runner.kv_pool.free(new)
                runner.req_to_token_pool.free(row)


def lora_runner(
    runner_config_for: Callable[..., RunnerConfig], base: Path, adapters: Sequence[Any], **lora: Any
) -> ModelRunner:
    config = runner_config_for(base)
    paths = tuple((name, str(path)) for name, path, _ in adapters)
    return ModelRunner(
        RunnerConfig(
            model=config.model,
            memory=config.memory,
            attention=config.attention,
            lora=LoraConfig(paths=paths, **lora),
        )
    )


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_logits_match_peft_and_mixed_batches_match_each_alone(
    family: str,
    family_setups: dict[str, Any],
    runner_config_for: Callable[..., RunnerConfig],
) -> None:
    base, adapters = family_setups[family]
    runner = lora_runner(runner_config_for, base, adapters)
    table = [(f"{name}#1", str(path)) for name, path, _ in adapters]
    driver = LoraDriver(runner, table)
    prompts = [PROMPT, PROMPT[:9], PROMPT[2:], PROMPT[:5]]
    # Three adapters and the base model, decoded position by position in shared steps.
    requests = [(prompts[0], 0), (prompts[1], 1), (prompts[2], 2), (prompts[3], -1)]
    mixed = driver.run(requests)
    for k, (_, _, reference) in enumerate(adapters):
        expected = peft_logits(reference, prompts[k])
        # The adapter matters: its logits are far from the base model's.
        assert (expected - base_logits(reference, prompts[k])).abs().max().item() > 0.05
        assert (mixed[k] - expected).abs().max().item() < 1e-4
    plain = base_logits(adapters[0][2], prompts[3])
    assert (mixed[3] - plain).abs().max().item() < 1e-4
    # Each request alone gives the same logits as in the mixed batch.
    for k, request in enumerate(requests):
        alone = driver.run([request])[0]
        assert (alone - mixed[k]).abs().max().item() < 1e-5
    # A prefill of all four in one forward (segments of several rows).
    last = driver.prefill_last(requests)
    for k, (_, _, reference) in enumerate(adapters):
        assert (last[k] - peft_logits(reference, prompts[k])[-1]).abs().max().item() < 1e-4
    assert (last[3] - plain[-1]).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def llama_engine(family_setups: dict[str, Any]) -> Any:
    base, adapters = family_setups["llama3"]
    with Engine(
        str(base),
        show_progress=False,
        dtype="float32",
        max_total_tokens=4096,
        lora_paths={name: str(path) for name, path, _ in adapters},
        max_loras_per_batch=2,
    ) as engine:
        yield engine


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_greedy_continuations_equal_peft_alone_and_batched(
    family: str, family_setups: dict[str, Any]
) -> None:
    base, adapters = family_setups[family]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    names: list[str | None] = [name for name, _, _ in adapters] + [None]
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:], PROMPT[:10]]
    expected = [peft_greedy(ref, prompts[k], 10) for k, (_, _, ref) in enumerate(adapters)]
    with adapters[0][2].disable_adapter():
        expected.append(peft_greedy(adapters[0][2], prompts[3], 10))
    # Two adapter slots for three adapters: the batch waits for a slot, then swaps.
    with Engine(
        str(base),
        show_progress=False,
        dtype="float32",
        max_total_tokens=2048,
        lora_paths={name: str(path) for name, path, _ in adapters},
        max_loras_per_batch=2,
    ) as engine:
        alone = [
            engine.generate(input_ids=prompts[k], sampling_params=params, lora_path=name)
            for k, name in enumerate(names)
        ]
        batched = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        assert engine.server_info()["lora_slot_swaps"] >= 3
        engine.check_invariants()
    for k in range(4):
        assert alone[k]["output_ids"] == expected[k], names[k]
        assert batched[k]["output_ids"] == expected[k], names[k]


def test_cache_is_shared_within_an_adapter_never_across(llama_engine: Engine) -> None:
    prompt = [9, *range(20, 60)]
    params = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    llama_engine.flush_cache().result()
    first = llama_engine.generate(input_ids=prompt, sampling_params=params, lora_path="a")
    other = llama_engine.generate(input_ids=prompt, sampling_params=params, lora_path="b")
    base = llama_engine.generate(input_ids=prompt, sampling_params=params)
    again = llama_engine.generate(input_ids=prompt, sampling_params=params, lora_path="a")
    assert first["meta_info"]["cached_tokens"] == 0
    assert other["meta_info"]["cached_tokens"] == 0
    assert base["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] >= len(prompt) - 1
    llama_engine.check_invariants()


def test_unknown_adapter_is_refused_and_nothing_else_affected(llama_engine: Engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    with pytest.raises(InvalidRequest) as error:
        llama_engine.generate(input_ids=PROMPT, sampling_params=params, lora_path="nope")
    assert error.value.field == "lora_path"
    assert "nope" in str(error.value) and "a, b, c" in str(error.value)
    out = llama_engine.generate(input_ids=PROMPT, sampling_params=params, lora_path="a")
    assert len(out["output_ids"]) == 3
    llama_engine.check_invariants()


def _adapter_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What a trainer holds of a PEFT adapter: its tensors and its config."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    return tensors, json.loads((path / "adapter_config.json").read_text())


def test_an_adapter_pushed_as_tensors_answers_as_its_directory_and_a_push_replaces_it(
    llama_engine: Engine, family_setups: dict[str, Any]
) -> None:
    """SGLang's load_lora_adapter_from_tensors: the outputs equal the same adapter's loaded
    from its directory; pushed again under the name, new requests use the new tensors and
    reuse no K/V of the earlier ones, while a request already running finishes on them."""
    _base, adapters = family_setups["llama3"]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    prompt = [9, *range(60, 90)]

    def greedy(name: str, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = llama_engine.generate(
            input_ids=prompt, sampling_params={**params, **extra}, lora_path=name
        )
        return out

    from_dir = {name: greedy(name)["output_ids"] for name in ("a", "b")}
    assert from_dir["a"] != from_dir["b"]
    # What a trainer holds: the peft model's adapter state and config, never saved.
    trained = adapters[0][2]
    tensors = peft.get_peft_model_state_dict(trained)
    config = trained.peft_config["default"].to_dict()
    loaded = llama_engine.load_lora_adapter_from_tensors("pushed", tensors, config).result(60)
    assert loaded["pushed"] == "<tensors>" and loaded["a"] == str(adapters[0][1])
    assert greedy("pushed")["output_ids"] == from_dir["a"]

    stream = llama_engine.generate(
        input_ids=prompt,
        sampling_params={**params, "max_new_tokens": 200},
        lora_path="pushed",
        stream=True,
    )
    first = next(stream)
    tensors, config = _adapter_tensors(adapters[1][1])
    pairs = sorted(tensors.items())  # (name, tensor) pairs work as a dict does
    llama_engine.load_lora_adapter_from_tensors("pushed", pairs, config).result(60)
    # The earlier version stays while the running request uses it.
    [earlier] = llama_engine.server_info(fresh=True)["lora_unloading"]
    assert earlier.startswith("pushed#")
    replaced = greedy("pushed")
    assert replaced["output_ids"] == from_dir["b"]
    assert replaced["meta_info"]["cached_tokens"] == 0  # nothing of the earlier version
    running = [first, *stream][-1]
    assert running["output_ids"][:8] == from_dir["a"]  # it finished on the earlier one
    assert llama_engine.server_info(fresh=True)["lora_unloading"] == []
    assert llama_engine.unload_lora_adapter("pushed").result(30) == {
        name: str(path) for name, path, _ in adapters
    }
    llama_engine.check_invariants()


def test_a_bad_pushed_adapter_is_refused_naming_the_field(
    llama_engine: Engine, family_setups: dict[str, Any]
) -> None:
    _base, adapters = family_setups["llama3"]
    tensors, config = _adapter_tensors(adapters[0][1])
    cases = [
        ({**tensors, "model.layers.0.mlp.up_proj.lora_A.weight": [1.0]}, config, "tensors"),
        ({"model.layers.0.mlp.up_proj.weight": torch.ones(2, 2)}, config, "tensors"),
        (tensors, {**config, "use_dora": True}, "config_dict"),
        (tensors, {**config, "r": 0}, "config_dict"),
    ]
    for bad_tensors, bad_config, field in cases:
        with pytest.raises(InvalidRequest) as error:
            llama_engine.load_lora_adapter_from_tensors("bad", bad_tensors, bad_config).result(30)
        assert error.value.field == field, str(error.value)
        assert "'bad' (from tensors)" in str(error.value)
    assert "bad" not in llama_engine.lora_adapters()
    llama_engine.check_invariants()


def test_base_engine_refuses_lora_path(family_setups: dict[str, Any]) -> None:
    base, _ = family_setups["llama3"]
    with Engine(str(base), show_progress=False, max_total_tokens=1024) as engine:
        with pytest.raises(InvalidRequest, match="serves no LoRA adapters") as error:
            engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, lora_path="a")
        assert error.value.field == "lora_path"
        with pytest.raises(InvalidRequest, match="--enable-lora"):
            engine.load_lora_adapter("a", "/nowhere").result(30)


def test_load_and_unload_while_requests_run(
    family_setups: dict[str, Any], tmp_path: Path, hf_model_factory: Callable[..., Any]
) -> None:
    base, adapters = family_setups["llama3"]
    _, path, reference = adapters[1]
    long_params = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    with Engine(
        str(base),
        show_progress=False,
        dtype="float32",
        max_total_tokens=4096,
        enable_lora=True,
        max_lora_rank=8,
    ) as engine:
        assert engine.lora_adapters() == {}
        loaded = engine.load_lora_adapter("late", str(path)).result(60)
        assert loaded == {"late": str(path)}

        stream = engine.generate(
            input_ids=PROMPT, sampling_params=long_params, lora_path="late", stream=True
        )
        first = next(stream)  # it runs
        assert engine.unload_lora_adapter("late").result(30) == {}
        # Unloaded while in flight: new requests are refused, this one goes on.
        assert engine.server_info(fresh=True)["lora_unloading"] == ["late#1"]
        with pytest.raises(InvalidRequest) as error:
            engine.generate(input_ids=PROMPT, sampling_params=long_params, lora_path="late")
        assert error.value.field == "lora_path"
        finished = [first, *stream][-1]
        assert len(finished["output_ids"]) == 200
        assert finished["output_ids"][:40] == peft_greedy(reference, PROMPT, 40)
        with pytest.raises(InvalidRequest) as error:
            engine.unload_lora_adapter("late").result(30)
        assert error.value.field == "lora_name"
        engine.check_invariants()
        stats = engine.server_info()
        assert stats["lora_unloading"] == [] and stats["lora_adapters"] == {}
        # The name again, another adapter: nothing of the first is reused (cache or weights).
        _, other_path, other_ref = adapters[2]
        engine.load_lora_adapter("late", str(other_path)).result(60)
        out = engine.generate(
            input_ids=PROMPT,
            sampling_params={**long_params, "max_new_tokens": 6},
            lora_path="late",
        )
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["output_ids"] == peft_greedy(other_ref, PROMPT, 6)


def write_adapter_config(path: Path, **fields: Any) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(fields)
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_bad_adapters_are_refused_with_the_reason(
    family_setups: dict[str, Any], tmp_path: Path, hf_model_factory: Callable[..., Any]
) -> None:
    base, adapters = family_setups["llama3"]
    good = adapters[0][1]
    qwen_adapter = family_setups["qwen3"][1][0][1]  # head_dim 32: other q/k/v shapes
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
    big = tmp_path / "big"
    make_adapter(hf_model_factory, "llama3", big, 3, r=32)
    dora = tmp_path / "dora"
    make_adapter(hf_model_factory, "llama3", dora, 4)
    write_adapter_config(dora, use_dora=True)
    with Engine(
        str(base),
        show_progress=False,
        max_total_tokens=1024,
        enable_lora=True,
        max_lora_rank=16,
        lora_target_modules=[
            "q_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "k_proj",
        ],
    ) as engine:
        cases = {
            str(tmp_path / "missing"): "does not exist",
            str(corrupt): "not a readable safetensors file",
            str(big): "above the server's max_lora_rank 16",
            str(dora): "DoRA",
            str(qwen_adapter): "trained for another model",
        }
        for path, reason in cases.items():
            with pytest.raises(InvalidRequest, match=reason) as error:
                engine.load_lora_adapter("x", path).result(60)
            assert error.value.field == "lora_path"
        engine.load_lora_adapter("x", str(good)).result(60)
        with pytest.raises(InvalidRequest, match="already loaded") as error:
            engine.load_lora_adapter("x", str(good)).result(60)
        assert error.value.field == "lora_name"
        out = engine.generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, lora_path="x"
        )
        assert len(out["output_ids"]) == 2
        engine.check_invariants()


def test_pool_refuses_targets_it_does_not_hold(family_setups: dict[str, Any]) -> None:
    base, adapters = family_setups["llama3"]
    with (
        Engine(
            str(base),
            show_progress=False,
            max_total_tokens=1024,
            enable_lora=True,
            lora_target_modules=["q_proj", "v_proj"],
        ) as engine,
        pytest.raises(InvalidRequest, match="--lora-target-modules"),
    ):
        engine.load_lora_adapter("all", str(adapters[0][1])).result(60)


def test_adapter_reader_checks(family_setups: dict[str, Any], tmp_path: Path) -> None:
    from radixlm.runtime.config import ModelConfig
    from radixlm.runtime.loader import read_model_info

    base, adapters = family_setups["qwen2"]
    arch = read_model_info(ModelConfig(str(base))).arch
    adapter = load_adapter("a", adapters[0][1], arch)
    assert adapter.target_modules == {"o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter.rank == 16
    # alpha_pattern: down_proj's scaling is 32 / 16, the others 8 / 16.
    peft_model = adapters[0][2]
    layer = peft_model.base_model.model.model.layers[0]
    assert layer.mlp.down_proj.scaling["default"] == pytest.approx(2.0)
    expected = layer.mlp.down_proj.lora_B["default"].weight * 2.0
    assert torch.allclose(adapter.weights[(0, "down_proj")].b, expected)
    with pytest.raises(LoraAdapterError, match=r"no adapter_config\.json"):
        load_adapter("x", tmp_path, arch)


def test_adapter_slots_evict_idle_adapters_lru() -> None:
    slots = AdapterSlots(2)
    assert slots.acquire("a", "/a") == 0
    assert slots.acquire("b", "/b") == 1
    assert not slots.can_place("c")  # both in use
    slots.release("a")
    assert slots.can_place("c")
    assert slots.acquire("c", "/c") == 0  # a was idle: evicted
    assert not slots.resident("a") and slots.snapshot() == (("c", "/c"), ("b", "/b"))
    slots.release("b")
    slots.release("c")
    slots.acquire("b", "/b")  # b is resident: no move
    slots.release("b")
    assert slots.acquire("d", "/d") == 0  # c is the least recently used
    with pytest.raises(RuntimeError):
        slots.drop("d")
    slots.release("d")
    slots.drop("d")
    assert slots.snapshot() == (None, ("b", "/b"))
