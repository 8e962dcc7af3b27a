"""Quantized linear layers: each path against the dequantized-weights reference (transformers
with its linear weights replaced by the dequantized ones), greedy parity for int8, GPTQ / AWQ /
FP8 checkpoints written here and read back, the fp8 KV pool, and the errors."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from radixlm import kernels
from radixlm.runtime import ModelRunner
from radixlm.runtime.loader import ModelLoadError
from radixlm.runtime.quant import (
    QuantizationError,
    QuantizedLinear,
    checkpoint_quantization,
    resolve_quantization,
)
from radixlm.runtime.quant.checkpoint import (
    AWQ_ORDER,
    pack_int32_columns,
    pack_int32_rows,
    unpack_int32_columns,
    unpack_int32_rows,
)
from radixlm.runtime.quant.linear import layer_group_size

_DRIVER: Any = None  # the conftest's Driver class, set by the autouse fixture below
PROMPTS = ([5, 17, 33, 2, 90, 41], [200, 3, 3, 150, 8], [11] * 9)
Dequantize = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture(autouse=True)
def _helpers(driver_for: Any, hf_model_factory: Any, runner_config_for: Any) -> None:
    global _DRIVER, make_hf_model, runner_config
    _DRIVER, make_hf_model, runner_config = driver_for, hf_model_factory, runner_config_for


make_hf_model: Any = None
runner_config: Any = None


def _int8(w: torch.Tensor) -> torch.Tensor:
    return kernels.dequantize_int8(*kernels.quantize_int8(w))


def _int4(group: int) -> Dequantize:
    def dequantize(w: torch.Tensor) -> torch.Tensor:
        qweight, scales, zeros = kernels.quantize_int4(w, group, fit=True)
        return kernels.dequantize_int4(qweight, scales, zeros, group)

    return dequantize


def _fp8(w: torch.Tensor) -> torch.Tensor:
    return kernels.dequantize_fp8(*kernels.quantize_fp8(w, per_channel=True))


def _projections(model: nn.Module) -> dict[str, nn.Linear]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith("lm_head")
    }


def dequantized_reference(hf_model: nn.Module, dequantize: Dequantize) -> nn.Module:
    """A copy of the transformers model whose projections hold dequantized weights."""
    reference = copy.deepcopy(hf_model)
    with torch.no_grad():
        for linear in _projections(reference).values():
            linear.weight.copy_(dequantize(linear.weight.float()))
    return reference


def hf_last_logits(model: nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def runner_last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    driver = _DRIVER(runner)
    seq = driver.start(prompt)
    try:
        return driver.forward([driver.entry(seq, prompt)]).next_token_logits[0].float()
    finally:
        driver.release(seq)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


# Stated tolerances (max |error| / max |logit|): the weight-only CPU paths multiply with
# bfloat16 activations; w8a8_int8 also quantizes activations to 7 bits per token (fbgemm),
# which on these tiny peaked models moves the logits by up to ~10%.
LOAD_TIME_CASES = [
    ("int8", {}, _int8, 0.02),
    ("w8a8_int8", {}, _int8, 0.12),
    ("int4", {"quantization_group_size": 32}, _int4(32), 0.03),
    ("int4", {"quantization_group_size": 64}, _int4(64), 0.03),
    ("fp8", {}, _fp8, 1e-4),
]


@pytest.mark.usefixtures("torch_kernels")
@pytest.mark.parametrize("family", ["qwen2", "llama3"])
@pytest.mark.parametrize(("method", "fields", "dequantize", "tolerance"), LOAD_TIME_CASES)
def test_load_time_quantization_matches_the_dequantized_reference(
    hf_checkpoints: dict[str, tuple[Path, Any]],
    family: str,
    method: str,
    fields: dict[str, Any],
    dequantize: Dequantize,
    tolerance: float,
) -> None:
    path, hf_model = hf_checkpoints[family]
    runner = ModelRunner(runner_config(path, quantization=method, **fields))
    # The LM head is quantized to int8 too (as llama.cpp's files do), except under fp8.
    assert (runner.model.quantized_head is not None) == (method != "fp8")
    reference = dequantized_reference(hf_model, dequantize)
    for prompt in PROMPTS:
        got = runner_last_logits(runner, list(prompt))
        want = hf_last_logits(reference, list(prompt))
        assert relative_error(got, want) <= tolerance, (method, prompt)


BUILTIN_PROMPTS = (
    "The capital of France is",
    "A radix tree stores",
    "Once upon a time",
    "The cache keeps the prefix of",
)


@pytest.fixture(scope="module")
def builtin_greedy() -> dict[str | None, list[str]]:
    """Greedy continuations of the built-in (trained) demo model, per quantization.

    The random tiny models' top logits lie within ~0.01 of each other, so any change of
    arithmetic flips their argmax; a trained model's greedy path is what int8 must keep."""
    from radixlm.runtime import Engine, builtin_model_path

    out: dict[str | None, list[str]] = {}
    for method in (None, "int8"):
        with Engine(builtin_model_path(), quantization=method) as engine:
            out[method] = [
                engine.generate(p, {"temperature": 0.0, "max_new_tokens": 24})["text"]
                for p in BUILTIN_PROMPTS
            ]
            info = engine.server_info()
            assert (info["quantization"] or "none").startswith(method or "none")
    return out


def test_int8_keeps_greedy_continuations_of_the_full_precision_model(
    builtin_greedy: dict[str | None, list[str]],
) -> None:
    # (w8a8_int8 does not: its 7-bit activations end one of these four answers early.)
    assert builtin_greedy["int8"] == builtin_greedy[None]


def test_w8a8_rows_do_not_depend_on_the_rest_of_the_batch(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    path, _ = hf_checkpoints["qwen2"]
    runner = ModelRunner(runner_config(path, quantization="w8a8_int8"))
    driver = _DRIVER(runner)
    alone = runner_last_logits(runner, list(PROMPTS[0]))
    seqs = [driver.start(list(prompt)) for prompt in PROMPTS]
    try:
        out = driver.forward([driver.entry(seq, seq.tokens) for seq in seqs])
    finally:
        for seq in seqs:
            driver.release(seq)
    torch.testing.assert_close(out.next_token_logits[0], alone, rtol=1e-5, atol=1e-5)


# Checkpoints quantized here ------------------------------------------------------------------


def _save_quantized(
    hf_model: nn.Module,
    path: Path,
    quantization_config: dict[str, Any],
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Save `hf_model` with each projection replaced by the tensors `convert` returns."""
    hf_model.save_pretrained(path)
    state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    for name in _projections(hf_model):
        weight = state.pop(f"{name}.weight")
        for leaf, tensor in convert(name, weight.float()).items():
            state[f"{name}.{leaf}"] = tensor.contiguous()
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for old in path.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


def _int4_parts(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Integer 4-bit values [N, K], integer zeros [N, G], float16 scales [N, G]."""
    qweight, scales, zeros = kernels.quantize_int4(weight, group)
    return kernels.unpack_int4(qweight), zeros.round(), scales.to(torch.float16)


def _int4_dequantized(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int):
    expand = {"repeats": group, "dim": 1}
    return (
        values.float() - zeros.float().repeat_interleave(**expand)
    ) * scales.float().repeat_interleave(**expand)


def _gptq_tensors(group: int, v1: bool) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    def convert(_name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        group_of = weight.shape[1] if group == -1 else group  # -1: one group per row
        values, zeros, scales = _int4_parts(weight, group_of)
        stored_zeros = zeros - 1 if v1 else zeros
        in_features = weight.shape[1]
        return {
            "qweight": pack_int32_rows(values.t().to(torch.int32)),
            "qzeros": pack_int32_columns(stored_zeros.t().to(torch.int32)),
            "scales": scales.t().contiguous(),
            "g_idx": torch.arange(in_features, dtype=torch.int32) // group_of,
        }

    return convert


def _awq_tensors(group: int) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    def convert(_name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        values, zeros, scales = _int4_parts(weight, group)
        return {
            "qweight": pack_int32_columns(values.t().to(torch.int32), AWQ_ORDER),
            "qzeros": pack_int32_columns(zeros.t().to(torch.int32), AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }

    return convert


def _int4_reference(group: int) -> Dequantize:
    def dequantize(weight: torch.Tensor) -> torch.Tensor:
        group_of = weight.shape[1] if group == -1 else group
        return _int4_dequantized(*_int4_parts(weight, group_of), group_of)

    return dequantize


def test_int32_packing_round_trips() -> None:
    values = torch.randint(0, 16, (16, 24), dtype=torch.int32)
    assert torch.equal(unpack_int32_rows(pack_int32_rows(values)), values)
    assert torch.equal(unpack_int32_columns(pack_int32_columns(values)), values)
    packed = pack_int32_columns(values, AWQ_ORDER)
    assert torch.equal(unpack_int32_columns(packed, AWQ_ORDER), values)
    assert not torch.equal(unpack_int32_columns(packed), values)


@pytest.mark.parametrize(
    ("label", "quantization_config", "convert", "dequantize"),
    [
        (
            "gptq",
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False},
            _gptq_tensors(32, v1=True),
            _int4_reference(32),
        ),
        (
            "gptq_v2",
            {
                "quant_method": "gptq",
                "bits": 4,
                "group_size": 64,
                "desc_act": False,
                "checkpoint_format": "gptq_v2",
            },
            _gptq_tensors(64, v1=False),
            _int4_reference(64),
        ),
        (
            "gptq_one_group_per_row",
            {"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False, "desc_act": False},
            _gptq_tensors(-1, v1=True),
            _int4_reference(-1),
        ),
        (
            "awq",
            {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True},
            _awq_tensors(32),
            _int4_reference(32),
        ),
    ],
)
def test_int4_checkpoints_round_trip(
    tmp_path: Path,
    label: str,
    quantization_config: dict[str, Any],
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    dequantize: Dequantize,
) -> None:
    hf_model = make_hf_model("qwen2", seed=3)
    _save_quantized(hf_model, tmp_path / label, quantization_config, convert)
    runner = ModelRunner(runner_config(tmp_path / label))
    assert runner.info.quantization is not None
    assert runner.info.quantization.method == quantization_config["quant_method"]
    assert runner.model.quantized_head is None  # checkpoints' heads stay as they are
    reference = dequantized_reference(hf_model, dequantize)
    for prompt in PROMPTS:
        got = runner_last_logits(runner, list(prompt))
        assert relative_error(got, hf_last_logits(reference, list(prompt))) <= 0.03, label


def test_fp8_checkpoint_round_trips_with_per_tensor_and_per_channel_scales(tmp_path: Path) -> None:
    hf_model = make_hf_model("llama3", seed=4)
    chosen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def convert(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        per_channel = "mlp" in name  # attention per tensor, MLP per channel
        fp8, scale = kernels.quantize_fp8(weight, per_channel=per_channel)
        chosen[name] = (fp8, scale)
        stored_scale = scale.reshape(-1, 1) if per_channel else scale.reshape(())
        return {"weight": fp8, "weight_scale": stored_scale, "input_scale": torch.tensor(1.0)}

    path = tmp_path / "fp8"
    _save_quantized(hf_model, path, {"quant_method": "fp8", "activation_scheme": "static"}, convert)
    runner = ModelRunner(runner_config(path))
    reference = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, linear in _projections(reference).items():
            linear.weight.copy_(kernels.dequantize_fp8(*chosen[name]))
    for prompt in PROMPTS:
        got = runner_last_logits(runner, list(prompt))
        assert relative_error(got, hf_last_logits(reference, list(prompt))) <= 1e-4


def test_act_order_gptq_checkpoint_is_refused_naming_g_idx(tmp_path: Path) -> None:
    hf_model = make_hf_model("qwen2")
    plain = _gptq_tensors(32, v1=True)

    def permuted(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = plain(name, weight)
        tensors["g_idx"] = tensors["g_idx"].flip(0)
        return tensors

    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    _save_quantized(hf_model, tmp_path / "m", config, permuted)
    with pytest.raises(ModelLoadError, match=r"g_idx.*desc_act"):
        ModelRunner(runner_config(tmp_path / "m"))


def test_dummy_weights_of_a_gptq_checkpoint_run_the_int4_kernels(tmp_path: Path) -> None:
    hf_model = make_hf_model("qwen2")
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    _save_quantized(hf_model, tmp_path / "m", config, _gptq_tensors(32, v1=True))
    runner = ModelRunner(runner_config(tmp_path / "m", load_format="dummy"))
    assert runner.info.quantization is not None and runner.info.quantization.format == "int4"
    assert torch.isfinite(runner_last_logits(runner, [1, 2, 3])).all()


# The fp8 KV pool ----------------------------------------------------------------------------


def test_fp8_kv_cache_stores_float8_and_stays_close(
    hf_checkpoints: dict[str, tuple[Path, Any]], runners: dict[str, ModelRunner]
) -> None:
    path, _ = hf_checkpoints["qwen2"]
    config = runner_config(path)
    config = type(config)(
        model=config.model,
        memory=type(config.memory)(
            max_total_tokens=2048, max_running_requests=16, kv_cache_dtype="fp8_e4m3"
        ),
        attention=config.attention,
    )
    runner = ModelRunner(config)
    assert runner.kv_pool.dtype == torch.float8_e4m3fn
    assert runner.kv_pool.bytes_per_token * 4 == runners["qwen2"].kv_pool.bytes_per_token
    for prompt in PROMPTS:
        got = _DRIVER(runner).prompt_logits(list(prompt))
        want = _DRIVER(runners["qwen2"]).prompt_logits(list(prompt))
        # e4m3 keeps 3 mantissa bits: each stored K/V value moves by up to 1/16 of itself.
        assert relative_error(got, want) <= 0.1


# Errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quantization_config", "match"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'.*GPTQ and AWQ"),
    ],
)
def test_unreadable_checkpoint_quantization_is_named(
    quantization_config: dict[str, Any], match: str
) -> None:
    with pytest.raises(QuantizationError, match=match):
        checkpoint_quantization({"quantization_config": quantization_config})


def test_quantization_flag_conflicting_with_the_checkpoint_is_refused() -> None:
    raw = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    with pytest.raises(QuantizationError, match="already quantized with awq"):
        resolve_quantization("int8", raw)
    assert resolve_quantization("awq", raw) == resolve_quantization(None, raw)
    with pytest.raises(QuantizationError, match="no quantization_config"):
        resolve_quantization("gptq", {})


@pytest.mark.usefixtures("torch_kernels")
def test_int4_takes_the_largest_group_a_layer_allows(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    path, hf_model = hf_checkpoints["qwen2"]  # hidden size 64, intermediate 128
    runner = ModelRunner(runner_config(path, quantization="int4", quantization_group_size=128))
    groups = {
        name: module.group_size
        for name, module in runner.model.named_modules()
        if isinstance(module, QuantizedLinear) and name.startswith("model.")
    }
    assert groups["model.layers.0.self_attn.qkv_proj"] == 64
    assert groups["model.layers.0.mlp.down_proj"] == 128

    def per_layer(w: torch.Tensor) -> torch.Tensor:
        return _int4(layer_group_size(w.shape[1], 128))(w)

    reference = dequantized_reference(hf_model, per_layer)
    for prompt in PROMPTS:
        got = runner_last_logits(runner, list(prompt))
        assert relative_error(got, hf_last_logits(reference, list(prompt))) <= 0.03


def test_int4_pads_an_input_no_group_divides() -> None:
    from radixlm.runtime.quant import QuantConfig

    quant = QuantConfig(method="int4", format="int4", source="load_time", group_size=128)
    layer = QuantizedLinear(72, {"out": 16}, False, quant, torch.float32)  # 72 = 2 x 32 + 8
    assert (layer.group_size, layer.padded_in) == (32, 96)
    weight = torch.randn(16, 72)
    assert layer.weight is not None
    layer.weight.data.copy_(weight)
    layer.finalize()
    x = torch.randn(3, 72)
    padded = torch.nn.functional.pad(weight, (0, 24))
    qweight, scales, zeros = kernels.quantize_int4(padded, 32, fit=True)
    want = x @ kernels.dequantize_int4(qweight, scales, zeros, 32)[:, :72].t()
    assert relative_error(layer(x), want) <= 0.03


def test_unknown_quantization_names_the_choices(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    path, _ = hf_checkpoints["qwen2"]
    with pytest.raises(ValueError, match="quantization must be one of int8, w8a8_int8"):
        runner_config(path, quantization="int3")


@pytest.mark.parametrize(("family", "method"), [("qwen3", "int8"), ("qwen2", "int4")])
def test_new_weights_of_a_model_quantized_at_load_time_are_quantized_as_at_start(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path, family: str, method: str
) -> None:
    """A runner given another model's weights computes what a runner started quantized on
    them computes: layers, merged parts and the int8 LM head (tied to the embedding in
    qwen3, its own in qwen2) quantized again, row by row as at start."""
    path, _ = hf_checkpoints[family]
    other = make_hf_model(family, seed=1)
    other.save_pretrained(tmp_path)
    fields = {"quantization": method, "quantization_group_size": 32}
    runner = ModelRunner(runner_config(path, **fields))
    _DRIVER(runner).prefill_logits(PROMPTS[0])  # it ran on the old weights
    runner.load_weights(other.state_dict().items())
    reference = ModelRunner(runner_config(tmp_path, **fields))
    for prompt in PROMPTS:
        got = _DRIVER(runner).prefill_logits(prompt)
        assert torch.equal(got, _DRIVER(reference).prefill_logits(prompt))


def test_weights_held_only_quantized_cannot_be_replaced(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    """fp8 on the CPU keeps only a dequantized copy: nothing to quantize new rows into."""
    path, hf_model = hf_checkpoints["qwen2"]
    runner = ModelRunner(runner_config(path, quantization="fp8"))
    with pytest.raises(RuntimeError, match="restart the engine"):
        runner.load_weights(hf_model.state_dict().items())


def test_gptq_one_group_per_row_runs_as_repeated_smaller_groups() -> None:
    from radixlm.runtime.quant import QuantConfig

    quant = QuantConfig(method="gptq", format="int4", source="gptq", group_size=-1, zero_offset=1)
    layer = QuantizedLinear(192, {"out": 16}, False, quant, torch.float32)  # 192 = 3 x 64
    assert (layer.checkpoint_group, layer.group_size) == (192, 64)
    weight = torch.randn(16, 192)
    # The reference quantizer takes any group size (the public one only the kernels' sizes).
    qweight, scales, zeros = kernels.reference.quantize_int4(weight, 192)
    values = kernels.unpack_int4(qweight)
    tensors = {
        "qweight": pack_int32_rows(values.t().to(torch.int32)),
        "qzeros": pack_int32_columns((zeros.round() - 1).t().to(torch.int32)),
        "scales": scales.to(torch.float16).t().contiguous(),
    }
    for leaf, tensor in tensors.items():
        layer.load_weight(None, leaf, tensor)
    layer.finalize()
    x = torch.randn(3, 192)
    want = x @ _int4_dequantized(values, zeros.round(), scales.to(torch.float16), 192).t()
    assert relative_error(layer(x), want) <= 0.03


def test_int4_decode_rows_run_the_c_kernel_on_one_thread_and_on_several() -> None:
    from radixlm import kernels
    from radixlm.runtime.quant import compute

    if not kernels.cpu.available():
        pytest.skip("no C compiler here")
    torch.manual_seed(0)
    qweight, scales, zeros = kernels.quantize_int4(torch.randn(48, 128) / 11, 32, fit=True)
    matmul = compute.int4_grouped(qweight, scales, zeros, 32)
    x = torch.randn(3, 128)
    want = kernels.reference.int4_linear(x, qweight, scales, zeros, 32)
    c_kernel = kernels.cpu.int4_linear(x, qweight, scales.float(), zeros.float(), 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = matmul(x)
        torch.set_num_threads(2)
        two = matmul(x)
    finally:
        torch.set_num_threads(threads)
    # Decode rows: the C kernel, on one thread or several (the same bits)
    assert torch.equal(one, c_kernel) and torch.equal(two, c_kernel)
    for got in (one, two):
        assert float((got - want).abs().max() / want.abs().max()) < 0.03


def test_int8_decode_rows_run_the_c_kernel_on_one_thread() -> None:
    from radixlm import kernels
    from radixlm.runtime.quant import compute

    if not kernels.cpu.available():
        pytest.skip("no C compiler here")
    torch.manual_seed(0)
    qweight, scale = kernels.quantize_int8(torch.randn(48, 128) / 11)
    matmul = compute.int8_weight_only(qweight, scale)
    x = torch.randn(2, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = matmul(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, kernels.cpu.int8_linear(x, qweight, scale.float()))
    want = kernels.reference.int8_linear(x, qweight, scale)
    assert float((one - want).abs().max() / want.abs().max()) < 0.02
