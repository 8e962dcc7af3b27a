"""GGUF files: metadata, tokenizer and weights read back as transformers reads them; the 4-bit
block types converted exactly into the int4 layout; files and directories found."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixlm import kernels
from radixlm.runtime import Engine, ModelRunner
from radixlm.runtime.fixtures import build_tiny_gguf, build_tiny_model
from radixlm.runtime.gguf_checkpoint import find_gguf, gguf_sidecar, int4_rows, iter_gguf_weights
from radixlm.runtime.loader import ModelLoadError
from radixlm.runtime.model_files import resolve_model_path
from radixlm.runtime.quant import QuantizedLinear
from radixlm.runtime.quant.gguf_linear import GGUFLinear, Int4Rows, Int8GroupRows

gguf = pytest.importorskip("gguf")
TEXT = "the radix tree of the model is a cache of Paris"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """(architecture, linear type) -> a GGUF file of a tiny random model."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    families = {
        "llama": ("LlamaForCausalLM", ("Q4_0", "Q4_1", "Q8_0")),
        "qwen2": ("Qwen2ForCausalLM", ("Q4_0", "Q4_1", "Q8_0")),
        "qwen3": ("Qwen3ForCausalLM", ("Q4_0",)),
        "mistral": ("MistralForCausalLM", ("Q4_1",)),
    }
    for arch, (family, kinds) in families.items():
        model_dir = build_tiny_model(root / arch, family, init_std=0.3)
        for kind in kinds:
            out[f"{arch}-{kind}"] = build_tiny_gguf(model_dir, root / f"{arch}-{kind}.gguf", kind)
    return out


def _transformers(gguf_file: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _runner_logits(runner: ModelRunner, driver: Any, ids: list[int]) -> torch.Tensor:
    return driver(runner).prefill_logits(ids).float()


@pytest.mark.parametrize(
    "name", ["llama-Q4_0", "llama-Q4_1", "llama-Q8_0", "qwen2-Q4_1", "qwen3-Q4_0", "mistral-Q4_1"]
)
def test_dequantized_gguf_logits_equal_transformers(
    tiny_ggufs: dict[str, Path], name: str, driver_for: Any, runner_config_for: Any
) -> None:
    model, tokenizer = _transformers(tiny_ggufs[name])
    ids = tokenizer(TEXT).input_ids
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    runner = ModelRunner(
        runner_config_for(str(tiny_ggufs[name]), quantization="none", dtype="float32")
    )
    got = _runner_logits(runner, driver_for, ids)
    # float32 throughout: only the order of summation differs (Qwen3's 128-wide heads reach
    # about 1.4e-5).
    assert torch.allclose(got, want, atol=5e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("name", ["llama-Q4_0", "qwen2-Q4_1"])
def test_gguf_4bit_weights_stay_int4_and_match_the_dequantized_model(
    tiny_ggufs: dict[str, Path], name: str, driver_for: Any, runner_config_for: Any
) -> None:
    exact = ModelRunner(
        runner_config_for(str(tiny_ggufs[name]), quantization="none", dtype="float32")
    )
    packed = ModelRunner(runner_config_for(str(tiny_ggufs[name]), dtype="float32"))
    head = packed.model.quantized_head
    assert head is not None and head.qweight.dtype == torch.int8  # as llama.cpp's output
    layers = [m for m in packed.model.modules() if isinstance(m, QuantizedLinear) and m is not head]
    assert layers and all(m.qweight.dtype == torch.uint8 and m.qweight.numel() for m in layers)
    assert all(m.group_size == 32 for m in layers)
    # Every int4 layer holds exactly the file's values (the kernels then multiply them with
    # bfloat16 activations on CPU).
    exact_weights = dict(exact.model.named_modules())
    for path, layer in packed.model.named_modules():
        if isinstance(layer, QuantizedLinear) and layer is not head:
            values = kernels.dequantize_int4(
                layer.qweight, layer.scales, layer.zeros, layer.group_size
            )
            module = exact_weights[path]
            # (on one thread the CPU decode path holds float32 weights in panels)
            weight = module.weight if module.weight.numel() else module.packing.plain()
            assert torch.allclose(values, weight, atol=1e-6), path
    ids = list(range(5, 40))
    want = _runner_logits(exact, driver_for, ids)
    got = _runner_logits(packed, driver_for, ids)
    # The CPU int4 kernel multiplies in bfloat16 (activations, scales): a few percent of the
    # largest logit over every position of these random models.
    assert float((got - want).abs().max() / want.abs().max()) < 0.05


def test_q8_0_tensors_stay_int8_on_the_cpu_with_the_c_kernels(
    tiny_ggufs: dict[str, Path], runner_config_for: Any
) -> None:
    runner = ModelRunner(runner_config_for(str(tiny_ggufs["llama-Q8_0"])))
    head = runner.model.quantized_head
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear) and m is not head]
    assert layers and all(m.qweight.numel() == 0 for m in layers)  # no int4 rows
    kept = [m.cpu_int8_operands() is not None for m in layers]
    # Without a C compiler the rows are dequantized into float copies instead.
    assert all(kept) if kernels.cpu.available() else not any(kept)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_convert_exactly_into_the_int4_layout(type_name: str) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    rows, cols = 8, 512
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    # Scales as finite float16 values (random bytes would hold NaNs and infinities).
    per_row = raw.reshape(rows, -1, size)
    halves = 4 if type_name != "Q4_0" else 2
    per_row[..., :halves] = (
        rng.uniform(-0.1, 0.1, size=(rows, per_row.shape[1], halves // 2))
        .astype(np.float16)
        .view(np.uint8)
    )
    per_row[0, 0, :2] = 0  # a block whose scale is zero (a constant block)
    raw = per_row.reshape(rows, -1)
    want = gguf.dequantize(raw, qtype).reshape(rows, cols)
    converted = int4_rows(raw, type_name, rows, cols)
    got = kernels.dequantize_int4(
        converted.qweight, converted.scales, converted.zeros, converted.group_size
    )
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_q8_0_rows_are_read_exactly_for_the_grouped_int8_kernel(
    tiny_ggufs: dict[str, Path],
) -> None:
    from transformers import AutoConfig

    path = tiny_ggufs["llama-Q8_0"]
    config = AutoConfig.from_pretrained(str(gguf_sidecar(path)))
    names = {
        f"model.layers.{i}.self_attn.{p}.weight"
        for i in range(2)
        for p in ("q_proj", "k_proj", "o_proj")
    }
    kw = {"show_progress": False}
    dense = dict(iter_gguf_weights(path, names, config, torch.float32, names, **kw))
    packed = dict(
        iter_gguf_weights(path, names, config, torch.float32, names, keep_int8=True, **kw)
    )
    assert set(dense) == set(packed) == names
    for name in names:
        rows = packed[name]
        assert isinstance(rows, Int8GroupRows) and rows.values.dtype == torch.int8
        values = kernels.dequantize_int8_grouped(rows.values, rows.scales, rows.group_size)
        assert torch.equal(values, dense[name]), name  # q/k rows un-permuted alike


def test_a_gguf_layer_with_rows_of_several_kinds_runs_a_float_copy() -> None:
    from radixlm.runtime.quant import QuantConfig

    quant = QuantConfig(method="gguf", format="int4", source="gguf", group_size=32)
    layer = GGUFLinear(64, {"q": 8, "k": 4, "v": 4}, False, quant, torch.float32)
    q = torch.randn(8, 64)
    k_values, k_scales = kernels.quantize_int8_grouped(torch.randn(4, 64), 32)
    v_int4 = kernels.quantize_int4(torch.randn(4, 64), 32, fit=True)
    layer.load_weight("q", "weight", q)
    layer.load_weight("k", "weight", Int8GroupRows(k_values, k_scales, 32))
    layer.load_weight("v", "weight", Int4Rows(*v_int4, group_size=32))
    layer.finalize()
    want = torch.cat(
        [
            q,
            kernels.dequantize_int8_grouped(k_values, k_scales, 32),
            kernels.dequantize_int4(*v_int4, 32),
        ]
    )
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ want.t())


def test_gguf_engine_reads_tokenizer_chat_template_and_eos_from_the_file(
    tiny_ggufs: dict[str, Path],
) -> None:
    path = tiny_ggufs["llama-Q4_1"]
    with Engine(str(path), max_total_tokens=256) as engine:
        reply = engine.generate(TEXT, {"max_new_tokens": 4, "temperature": 0})
        assert len(reply["output_ids"]) == 4
        assert engine.config.served_model_name == str(path)
        info = engine.server_info()
        assert info["quantization"].startswith("gguf")
        template = engine._tokenizer.chat_template
        assert template and "<|im_start|>" in template
        assert engine.eos_token_ids


def test_a_directory_holding_one_gguf_file_is_a_model(
    tiny_ggufs: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "model.gguf").write_bytes(tiny_ggufs["qwen2-Q4_0"].read_bytes())
    assert find_gguf(tmp_path) == tmp_path / "model.gguf"
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        resolve_model_path(tmp_path)


def test_gguf_models_default_to_float32_on_cpus_with_the_c_kernels(
    tiny_ggufs: dict[str, Path], runner_config_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their int4 / int8 blocks multiply in C with float32 activations: float32 even where
    bfloat16 is fast; without the C kernels, bfloat16 where it is fast."""
    from radixlm import kernels
    from radixlm.runtime import loader
    from radixlm.runtime.loader import read_model_info

    config = runner_config_for(str(tiny_ggufs["qwen2-Q4_0"]), device="cpu").model
    monkeypatch.setattr(loader, "cpu_packing_available", lambda dtype: True)  # AVX512-BF16
    monkeypatch.setattr(kernels.cpu, "available", lambda: True)
    info = read_model_info(config)
    assert info.dtype == torch.float32 and "C kernels" in info.dtype_reason, info.dtype_reason
    assert read_model_info(dataclasses.replace(config, dtype="bfloat16")).dtype == torch.bfloat16
    monkeypatch.setattr(kernels.cpu, "available", lambda: False)
    assert read_model_info(config).dtype == torch.bfloat16
    # Every tensor dequantized (no int4 kept): the C kernels have nothing to multiply.
    plain = read_model_info(dataclasses.replace(config, quantization="none"))
    assert plain.dtype == torch.bfloat16


def test_a_file_that_is_not_gguf_is_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"broken\.gguf is not a readable GGUF file"):
        resolve_model_path(broken)


def test_the_sidecar_is_written_once_per_file(tiny_ggufs: dict[str, Path]) -> None:
    first = gguf_sidecar(tiny_ggufs["llama-Q4_0"])
    stamp = (first / "config.json").stat().st_mtime_ns
    assert gguf_sidecar(tiny_ggufs["llama-Q4_0"]) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp


def test_a_hub_quantization_method_on_a_gguf_file_is_refused(
    tiny_ggufs: dict[str, Path], runner_config_for: Any
) -> None:
    with pytest.raises(ModelLoadError, match="reads a GPTQ checkpoint; this is a GGUF file"):
        ModelRunner(runner_config_for(str(tiny_ggufs["llama-Q4_0"]), quantization="gptq"))


def test_requantizing_a_gguf_file_at_load_time(
    tiny_ggufs: dict[str, Path], runner_config_for: Any
) -> None:
    runner = ModelRunner(runner_config_for(str(tiny_ggufs["llama-Q8_0"]), quantization="int8"))
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.qweight.dtype == torch.int8 for m in layers)


@pytest.mark.gpu
def test_q8_0_layers_run_the_grouped_int8_kernel_on_cuda(
    tiny_ggufs: dict[str, Path], driver_for: Any, runner_config_for: Any
) -> None:
    path = str(tiny_ggufs["llama-Q8_0"])
    exact = ModelRunner(
        runner_config_for(path, quantization="none", dtype="float32", device="cuda")
    )
    packed = ModelRunner(runner_config_for(path, dtype="float32", device="cuda"))
    layers = [m for m in packed.model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(m._int8 is not None for m in layers)
    ids = list(range(5, 40))
    want = _runner_logits(exact, driver_for, ids)
    got = _runner_logits(packed, driver_for, ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-3
