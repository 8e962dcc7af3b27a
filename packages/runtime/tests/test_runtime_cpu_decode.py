"""The CPU decode path (one C call per decode step) against the model's own forward: the same
logits and the same K/V written, for int4, int8 and float32 layers of every family (GQA, a tied head,
q/k/v biases, per-head q/k norms, a sliding window), GGUF Q4_1 and Q8_0 files, and batches of
requests at different lengths; which steps take it, and which models it refuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm import kernels
from radixlm.runtime import ForwardBatch, ModelRunner
from radixlm.runtime.cpu_decode import MAX_BATCH
from radixlm.runtime.fixtures import build_tiny_gguf, build_tiny_model

pytestmark = pytest.mark.skipif(not kernels.cpu.available(), reason="no C compiler here")

FAMILIES = {
    "llama3": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread unless a test says otherwise (the kernels follow torch's count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpu-decode-gguf")
    model_dir = build_tiny_model(root / "qwen2", "Qwen2ForCausalLM", init_std=0.3)
    return {
        kind: build_tiny_gguf(model_dir, root / f"{kind}.gguf", kind) for kind in ("Q4_1", "Q8_0")
    }


def _decode_steps(
    runner: ModelRunner,
    driver: Any,
    prompts: list[list[int]],
    steps: int,
    tolerance: float = 5e-2,
) -> int:
    """Prefill `prompts`, then decode them together `steps` times; each decode step runs
    through the path and then, on the same batch, through the model's own forward; asserts
    equal logits and K/V (`_assert_near`). Returns how many steps the path ran."""
    path = runner.cpu_decode
    assert path is not None
    seqs = [driver.start(p) for p in prompts]
    try:
        first = driver.forward([driver.entry(s, p) for s, p in zip(seqs, prompts, strict=True)])
        last = first.next_token_logits.argmax(-1).tolist()
        taken = 0
        for _ in range(steps):
            entries = [driver.entry(s, [t]) for s, t in zip(seqs, last, strict=True)]
            batch = ForwardBatch.build(entries, runner.req_to_token_pool.req_to_token)
            assert path.can_run(batch)
            fast = runner.forward(batch).next_token_logits.clone()
            pool = runner.kv_pool
            written = [(k[batch.out_cache_loc].clone(), v[batch.out_cache_loc].clone())
                       for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True)]  # fmt: skip
            taken += 1
            runner.cpu_decode = None
            try:
                plain = runner.forward(batch).next_token_logits
            finally:
                runner.cpu_decode = path
            _assert_near(fast, plain, tolerance)
            for (k_fast, v_fast), k, v in zip(written, pool.k_buffers, pool.v_buffers, strict=True):
                _assert_near(k_fast, k[batch.out_cache_loc], tolerance)
                _assert_near(v_fast, v[batch.out_cache_loc], tolerance)
            last = plain.argmax(-1).tolist()
        return taken
    finally:
        for seq in seqs:
            driver.release(seq)


def _assert_near(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """Equal but for the int8 rounding of activations. Both paths round each projection's
    input to int8 per 32 columns; a float32 difference upstream (a norm's or a softmax's sum
    order) that moves one value across a rounding step changes it by 1/127 of its block's
    largest value, and what follows by up to ~1 % of its scale (most steps: ~1e-6), where a
    wrong weight, slot, row or position changes it wholesale. The layers' own arithmetic is
    checked tightly, one layer at a time, in radixlm-kernels' tests. Float32 weights (no
    rounding of activations) take a tight bound."""
    error = float((got - want).abs().max() / want.abs().max())
    assert error < tolerance


# Lengths past the mistral model's window of 6, and of different sizes in one batch.
PROMPTS = [[5, 9, 14, 3, 7, 11, 2, 8, 4, 10], [6, 12], [13, 3, 9, 5, 7]]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_decode_steps_equal_the_model_forward_for_load_time_quantization(
    hf_checkpoints: Any, runner_config_for: Any, driver_for: Any, family: str, quantization: str
) -> None:
    path, _ = hf_checkpoints[family]
    runner = ModelRunner(runner_config_for(path, quantization=quantization))
    assert runner.cpu_decode is not None
    assert _decode_steps(runner, driver_for(runner), PROMPTS, steps=6) == 6


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_decode_steps_equal_the_model_forward_for_gguf_files(
    gguf_files: dict[str, Path], runner_config_for: Any, driver_for: Any, kind: str
) -> None:
    # (float32 said: "auto" keeps a GGUF file's bfloat16 on CPUs with AVX512-BF16 or AMX)
    runner = ModelRunner(runner_config_for(gguf_files[kind], dtype="float32"))
    assert runner.cpu_decode is not None
    assert _decode_steps(runner, driver_for(runner), PROMPTS, steps=4) == 4


def test_batches_past_one_call_run_in_chunks(hf_checkpoints: Any, driver_for: Any) -> None:
    """A step of 21 requests (two calls of at most 16) gives what its two parts give when
    they run as steps of their own."""
    from radixlm.runtime import BatchEntry, MemoryConfig, ModelConfig, RunnerConfig

    path, _ = hf_checkpoints["qwen2"]
    config = RunnerConfig(
        model=ModelConfig(str(path), show_progress=False, quantization="int4"),
        memory=MemoryConfig(max_total_tokens=2048, max_running_requests=40),
    )
    runner = ModelRunner(config)
    assert runner.cpu_decode is not None
    driver = driver_for(runner)
    count = kernels.cpu.MAX_ROWS + 5
    prompts = [[3 + (7 * i + j) % 200 for j in range(1 + i % 9)] for i in range(count)]
    seqs = [driver.start(p) for p in prompts]
    table = runner.req_to_token_pool.req_to_token
    try:
        driver.forward([driver.entry(s, p) for s, p in zip(seqs, prompts, strict=True)])
        entries = [driver.entry(s, [5]) for s in seqs]
        whole = ForwardBatch.build(entries, table)
        assert runner.cpu_decode.can_run(whole)
        together = runner.forward(whole).next_token_logits.clone()
        again = [
            BatchEntry(e.req_pool_index, e.input_ids, e.prefix_len, e.out_slots) for e in entries
        ]
        first = runner.forward(ForwardBatch.build(again[: kernels.cpu.MAX_ROWS], table))
        rest = runner.forward(ForwardBatch.build(again[kernels.cpu.MAX_ROWS :], table))
        parts = torch.cat([first.next_token_logits, rest.next_token_logits])
        assert torch.equal(together, parts)
    finally:
        for seq in seqs:
            driver.release(seq)


@pytest.mark.parametrize(("family", "quantization"), [("mistral", None), ("qwen3", "int4")])
def test_mixed_steps_run_their_one_token_requests_on_the_path(
    hf_checkpoints: Any, runner_config_for: Any, driver_for: Any, family: str, quantization: Any
) -> None:
    """A step of prefill chunks beside decodes: with int4 weights the decodes through the
    path and the chunks through the model's forward; with float32 weights (in panels) the
    whole step through the path. Either way the logits in batch order as the model's forward
    over the whole step gives them, and the K/V of every new token written."""
    from radixlm.runtime import BatchEntry

    path, _ = hf_checkpoints[family]
    fields = {"quantization": quantization} if quantization else {}
    runner = ModelRunner(runner_config_for(path, **fields))
    cpu_path = runner.cpu_decode
    assert cpu_path is not None
    driver = driver_for(runner)
    table = runner.req_to_token_pool.req_to_token
    old = [driver.start(p) for p in PROMPTS]
    chunk = [4, 8, 15, 16, 23, 42, 7, 9] * 9  # with the rest, past MAX_BATCH rows
    new = [driver.start(p) for p in (chunk, [3, 5])]
    try:
        driver.forward([driver.entry(s, p) for s, p in zip(old, PROMPTS, strict=True)])
        # decode, chunk, decode, decode, chunk: the two kinds interleaved
        entries = [
            driver.entry(old[0], [5]),
            driver.entry(new[0], chunk),
            driver.entry(old[1], [6]),
            driver.entry(old[2], [7]),
            driver.entry(new[1], [3, 5]),
        ]
        batch = ForwardBatch.build(entries, table)
        if quantization is None:  # every projection in panels: the path takes the whole step
            assert cpu_path.layers.panels_only and cpu_path.can_run(batch)
        else:
            assert not cpu_path.can_run(batch)
            step = cpu_path.split(batch)
            assert step is not None and step.rows.tolist() == [0, 2, 3]
        split = runner.forward(batch).next_token_logits.clone()
        slots = batch.out_cache_loc
        written = [(k[slots].clone(), v[slots].clone())
                   for k, v in zip(runner.kv_pool.k_buffers, runner.kv_pool.v_buffers, strict=True)]  # fmt: skip
        again = [
            BatchEntry(e.req_pool_index, e.input_ids, e.prefix_len, e.out_slots) for e in entries
        ]
        runner.cpu_decode = None
        try:
            whole = runner.forward(ForwardBatch.build(again, table)).next_token_logits
        finally:
            runner.cpu_decode = cpu_path
        tolerance = 5e-2 if quantization else 1e-5
        _assert_near(split, whole, tolerance)
        for (k_split, v_split), k, v in zip(
            written, runner.kv_pool.k_buffers, runner.kv_pool.v_buffers, strict=True
        ):
            _assert_near(k_split, k[slots], tolerance)
            _assert_near(v_split, v[slots], tolerance)
        # Not split: no one-token request, or a row that asks for its prompt logprobs.
        assert cpu_path.split(ForwardBatch.build(again[1:2] + again[4:], table)) is None
        asks = BatchEntry(again[1].req_pool_index, again[1].input_ids, again[1].prefix_len,
                          again[1].out_slots, input_logprob_targets=[1] * (len(chunk) - 1))  # fmt: skip
        assert cpu_path.split(ForwardBatch.build([again[0], asks], table)) is None
    finally:
        for seq in old + new:
            driver.release(seq)


def test_steps_past_max_batch_tokens_take_the_model_forward(
    hf_checkpoints: Any, runner_config_for: Any, driver_for: Any
) -> None:
    """Short prefills and mixed steps of at most MAX_BATCH tokens take the path (on any
    number of threads); longer prefills the model's forward."""
    path, _ = hf_checkpoints["llama3"]
    runner = ModelRunner(runner_config_for(path, quantization="int4"))
    assert runner.cpu_decode is not None
    driver = driver_for(runner)
    table = runner.req_to_token_pool.req_to_token
    rows = MAX_BATCH
    old, new, long = driver.start([5, 6, 7]), driver.start([8, 9]), driver.start([3] * (rows + 1))
    try:
        prefill = ForwardBatch.build([driver.entry(old, [5, 6, 7])], table)
        assert runner.cpu_decode.can_run(prefill)
        runner.forward(prefill)
        mixed = [driver.entry(old, [4]), driver.entry(new, [8, 9])]
        assert runner.cpu_decode.can_run(ForwardBatch.build(mixed, table))
        assert not runner.cpu_decode.can_run(
            ForwardBatch.build([driver.entry(long, [3] * (rows + 1))], table)
        )
        decode = ForwardBatch.build([driver.entry(old, [3])], table)
        assert runner.cpu_decode.can_run(decode)
        torch.set_num_threads(2)
        assert runner.cpu_decode.can_run(decode)  # several threads: the products split
    finally:
        for seq in (old, new, long):
            driver.release(seq)


def test_verify_steps_past_one_call_take_the_path(
    hf_checkpoints: Any, runner_config_for: Any, driver_for: Any
) -> None:
    """A step of drafts to verify (speculative decoding) with more tokens than one call
    takes runs on the path in calls of MAX_ROWS rows, a request's rows split between calls,
    whatever else the step holds: every row's logits and K/V as the model's forward gives
    them. (Until the path took such steps, a verify step past MAX_ROWS tokens ran through
    the model's forward, and a near tie could then fall the other way than when the same
    token was decoded alone.)"""
    path, _ = hf_checkpoints["qwen3"]
    runner = ModelRunner(runner_config_for(path, quantization="int4"))
    cpu_path = runner.cpu_decode
    assert cpu_path is not None
    driver = driver_for(runner)
    table = runner.req_to_token_pool.req_to_token
    prompts = [*PROMPTS, [9, 4, 6]]
    seqs = [driver.start(p) for p in prompts]
    try:
        driver.forward([driver.entry(s, p) for s, p in zip(seqs, prompts, strict=True)])
        drafts = [[3, 7, 2, 9, 5], [8, 1, 6, 4, 2], [5, 5, 9, 3, 1], [7, 2, 8, 6, 4]]
        entries = [driver.entry(s, d, num_logits=len(d)) for s, d in zip(seqs, drafts, strict=True)]
        seqs.append(driver.start([4, 2]))
        entries.append(driver.entry(seqs[-1], [4, 2]))  # a short prefill beside them
        batch = ForwardBatch.build(entries, table)
        assert kernels.cpu.MAX_ROWS < batch.num_tokens <= MAX_BATCH
        assert cpu_path.can_run(batch)
        fast = runner.forward(batch).next_token_logits.clone()
        assert fast.shape[0] == sum(map(len, drafts)) + 1
        slots = batch.out_cache_loc
        written = [(k[slots].clone(), v[slots].clone())
                   for k, v in zip(runner.kv_pool.k_buffers, runner.kv_pool.v_buffers, strict=True)]  # fmt: skip
        runner.cpu_decode = None
        try:
            plain = runner.forward(batch).next_token_logits
        finally:
            runner.cpu_decode = cpu_path
        _assert_near(fast, plain, 5e-2)
        for (k_fast, v_fast), k, v in zip(
            written, runner.kv_pool.k_buffers, runner.kv_pool.v_buffers, strict=True
        ):
            _assert_near(k_fast, k[slots], 5e-2)
            _assert_near(v_fast, v[slots], 5e-2)
    finally:
        for seq in seqs:
            driver.release(seq)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quantization", ["int4", "int8", "none"])
def test_short_prefills_beside_decodes_equal_the_model_forward(
    hf_checkpoints: Any,
    runner_config_for: Any,
    driver_for: Any,
    family: str,
    quantization: str,
) -> None:
    """One call over a whole step: a first chunk, a chunk after a cached prefix (past the
    mistral window of 6), decodes and one prompt-logprob ask; each token a row that sees the
    ones before it. The same logits, prompt logprobs and K/V as the model's forward."""
    from radixlm.runtime import BatchEntry

    path, _ = hf_checkpoints[family]
    fields = {} if quantization == "none" else {"quantization": quantization}
    runner = ModelRunner(runner_config_for(path, **fields))
    cpu_path = runner.cpu_decode
    assert cpu_path is not None
    driver = driver_for(runner)
    table = runner.req_to_token_pool.req_to_token
    old = [driver.start(p) for p in PROMPTS]
    fresh = driver.start([4, 8, 15, 16])
    try:
        driver.forward([driver.entry(s, p) for s, p in zip(old, PROMPTS, strict=True)])
        entries = [
            driver.entry(old[0], [5]),
            driver.entry(fresh, [4, 8, 15, 16]),
            driver.entry(old[1], [6, 2, 9, 11, 3]),  # a chunk after 2 cached tokens
            driver.entry(old[2], [7]),
        ]
        plain = [
            BatchEntry(e.req_pool_index, e.input_ids, e.prefix_len, e.out_slots) for e in entries
        ]
        plain[1] = BatchEntry(plain[1].req_pool_index, plain[1].input_ids, 0,
                              plain[1].out_slots, input_logprob_targets=[8, 15, 16])  # fmt: skip
        batch = ForwardBatch.build(plain, table)
        assert batch.num_tokens <= kernels.cpu.MAX_ROWS and cpu_path.can_run(batch)
        fast = runner.forward(batch)
        slots = batch.out_cache_loc
        written = [(k[slots].clone(), v[slots].clone())
                   for k, v in zip(runner.kv_pool.k_buffers, runner.kv_pool.v_buffers, strict=True)]  # fmt: skip
        runner.cpu_decode = None
        try:
            want = runner.forward(ForwardBatch.build(plain, table))
        finally:
            runner.cpu_decode = cpu_path
        tolerance = 1e-5 if quantization == "none" else 5e-2
        _assert_near(fast.next_token_logits, want.next_token_logits, tolerance)
        assert fast.input_logprobs is not None and want.input_logprobs is not None
        got_lp = [t.logprob for t in fast.input_logprobs[1] or []]
        want_lp = [t.logprob for t in want.input_logprobs[1] or []]
        assert len(got_lp) == 3
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) < 10 * tolerance
        for (k_fast, v_fast), k, v in zip(
            written, runner.kv_pool.k_buffers, runner.kv_pool.v_buffers, strict=True
        ):
            _assert_near(k_fast, k[slots], tolerance)
            _assert_near(v_fast, v[slots], tolerance)
    finally:
        for seq in [*old, fresh]:
            driver.release(seq)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_steps_equal_the_model_forward_for_float32_weights(
    hf_checkpoints: Any, runner_config_for: Any, driver_for: Any, family: str
) -> None:
    """Plain float32 projections (the C float product, no rounding of activations), held in
    panels from the path's build on: the plain weights are released, and read back whole."""
    path, hf_model = hf_checkpoints[family]
    runner = ModelRunner(runner_config_for(path))
    assert runner.cpu_decode is not None
    layer = runner.model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        packing = getattr(module, "packing", None)
        assert packing is not None and packing.panels is not None and not packing.enabled
        assert module.weight.numel() == 0  # released: the panels are the only copy
    state = hf_model.state_dict()
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(runner.weight(name), state[name])
    assert _decode_steps(runner, driver_for(runner), PROMPTS, steps=6, tolerance=1e-5) == 6


@pytest.mark.parametrize("family", ["llama3", "qwen2"])  # a tied head, an untied one
def test_float32_heads_multiply_in_c_for_a_few_rows(
    hf_checkpoints: Any, runner_config_for: Any, family: str
) -> None:
    """The C head gives the model's logits for any number of rows, from panels its packing
    holds (`compute_logits` reads them too): a tied head's table stays (the embedding lookup
    reads it), an untied head's plain weight is released and read back whole."""
    path, hf_model = hf_checkpoints[family]
    runner = ModelRunner(runner_config_for(path))
    decode = runner.cpu_decode
    assert decode is not None and decode.head is not None
    model = runner.model
    packing = model.head_packing
    assert packing is not None and decode.head is packing.panels
    tied = family == "llama3"
    assert (model.lm_head_weight.numel() > 0) == tied
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    weight = hf_model.state_dict()[name]
    assert torch.equal(runner.weight(name), weight)
    torch.manual_seed(0)
    for rows in (1, 5, kernels.cpu.MAX_ROWS, kernels.cpu.F32_MAX_ROWS + 3):
        hidden = torch.randn(rows, model.arch.hidden_size)
        want = hidden.double() @ weight.double().T
        for got in (decode.logits(hidden), model.compute_logits(hidden)):
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5
        # a row's logits are the same bits in any call
        assert torch.equal(decode.logits(hidden[rows - 1 :])[0], decode.logits(hidden)[rows - 1])


def test_quantized_heads_stay_with_the_model(hf_checkpoints: Any, runner_config_for: Any) -> None:
    path, _ = hf_checkpoints["qwen2"]
    runner = ModelRunner(runner_config_for(path, quantization="int8"))
    assert runner.cpu_decode is not None and runner.cpu_decode.head is None


def test_a_packed_tied_head_is_packed_again_after_new_weights(
    hf_checkpoints: Any, runner_config_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_weights drops the packed copy of a tied head (it would keep the old logits)."""
    from radixlm.runtime.models.linear import cpu_packing_available

    if not cpu_packing_available():
        pytest.skip("no oneDNN packing in this torch")
    path, hf_model = hf_checkpoints["llama3"]
    monkeypatch.setattr(kernels.cpu, "available", lambda: False)  # no path: oneDNN packs it
    runner = ModelRunner(runner_config_for(path))
    model = runner.model
    hidden = torch.randn(3, model.arch.hidden_size)
    before = model.compute_logits(hidden)
    assert model.head_packing is not None and model.head_packing.packed is not None
    table = hf_model.state_dict()["model.embed_tokens.weight"]
    runner.load_weights([("model.embed_tokens.weight", 2 * table)])
    after = model.compute_logits(hidden)
    torch.testing.assert_close(after, 2 * before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_several_threads_take_the_path_and_give_the_model_forward(
    hf_checkpoints: Any, runner_config_for: Any, driver_for: Any, quantization: str
) -> None:
    """On two torch threads the path splits its products and attention over them (the
    kernels' own threads): float32 layers hold panels there too, and the steps give the
    model's forward."""
    path, _ = hf_checkpoints["qwen2"]
    torch.set_num_threads(2)
    fields = {} if quantization == "none" else {"quantization": quantization}
    runner = ModelRunner(runner_config_for(path, **fields))
    assert runner.cpu_decode is not None
    if quantization == "none":
        packing = getattr(runner.model.model.layers[0].self_attn.qkv_proj, "packing", None)
        assert packing is not None and packing.panels is not None
    tolerance = 1e-5 if quantization == "none" else 0.02
    assert _decode_steps(runner, driver_for(runner), PROMPTS, steps=3, tolerance=tolerance) == 3


def test_bfloat16_models_are_not_taken(hf_checkpoints: Any, runner_config_for: Any) -> None:
    path, _ = hf_checkpoints["qwen2"]
    assert ModelRunner(runner_config_for(path, dtype="bfloat16")).cpu_decode is None


def test_the_path_is_off_without_the_c_kernels(tmp_path: Path) -> None:
    import subprocess
    import sys

    model = build_tiny_model(tmp_path / "m")
    script = (
        "from radixlm.runtime import ModelRunner, RunnerConfig, ModelConfig\n"
        f"r = ModelRunner(RunnerConfig(model=ModelConfig({str(model)!r}, quantization='int8', "
        "show_progress=False)))\n"
        "print(r.cpu_decode is None)\n"
    )
    env = {**__import__("os").environ, "RADIXLM_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True")
