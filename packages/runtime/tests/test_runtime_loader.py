"""Loading HF model directories: formats, dtypes, and every error a user can cause."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import (
    ModelConfig,
    ModelLoadError,
    ModelNotFoundError,
    load_model,
    read_model_info,
    supported_architectures,
)
from radixlm.runtime.loader import resolve_device, resolve_dtype
from radixlm.runtime.models.linear import cpu_packing_available

IDS = torch.tensor([[3, 14, 15, 92, 65, 35]])


def logits_of(model: Any, ids: torch.Tensor = IDS) -> torch.Tensor:
    """Our model's last-position logits via a throwaway runner-free forward."""
    from radixlm.runtime import BatchEntry, ForwardBatch, KVPool, ReqToTokenPool
    from radixlm.runtime.attention.torch_native import TorchNativeBackend

    arch = model.arch
    pool = KVPool(arch.num_layers, 64, arch.num_kv_heads, arch.head_dim, model.dtype, "cpu")
    table = ReqToTokenPool(1, 64, "cpu")
    slots = pool.alloc(ids.shape[1])
    batch = ForwardBatch.build([BatchEntry(0, ids[0].tolist(), 0, slots)], table.req_to_token)
    batch.write_req_to_token()
    backend = TorchNativeBackend(pool)
    backend.prepare(batch)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, backend))


def test_sharded_safetensors_load_the_same_weights(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    _, hf_model = hf_checkpoints["qwen2"]
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _ = load_model(ModelConfig(str(tmp_path), show_progress=False))
    with torch.no_grad():
        expected = hf_model(IDS).logits[0].float()
    assert (logits_of(model) - expected).abs().max().item() <= 1e-4


def test_dtype_auto_keeps_a_float32_checkpoint_in_float32(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    path, _ = hf_checkpoints["llama3"]
    model, info = load_model(ModelConfig(str(path), show_progress=False))
    assert info.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_bfloat16_load_casts_the_weights_and_stays_close(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    path, hf_model = hf_checkpoints["llama3"]
    model, info = load_model(ModelConfig(str(path), dtype="bf16", show_progress=False))
    assert info.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        expected = hf_model(IDS).logits[0].float()
    ours = logits_of(model)
    assert ours.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the argmax of the last position must agree.
    assert (ours - expected).abs().max().item() < 0.15 * expected.abs().max().item()
    assert int(ours[-1].argmax()) == int(expected[-1].argmax())


def test_bfloat16_checkpoint_with_auto_computes_in_the_devices_fast_dtype(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    _, hf_model = hf_checkpoints["qwen3"]
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    model, info = load_model(ModelConfig(str(tmp_path), device="cpu", show_progress=False))
    fast = cpu_packing_available(torch.bfloat16)  # AVX512-BF16 / AMX CPUs
    assert info.dtype == (torch.bfloat16 if fast else torch.float32)
    assert all(p.dtype == info.dtype for p in model.parameters())
    assert ("fast rate" if fast else "no fast bfloat16") in info.dtype_reason
    _, asked = load_model(ModelConfig(str(tmp_path), dtype="bfloat16", show_progress=False))
    assert asked.dtype == torch.bfloat16 and asked.dtype_reason == "bfloat16, as asked"


@pytest.mark.parametrize("fast", [True, False])
def test_auto_dtype_follows_the_cpu_probe(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    from radixlm.runtime import loader

    monkeypatch.setattr(loader, "cpu_packing_available", lambda dtype: fast)
    cpu = torch.device("cpu")
    dtype, why = loader.choose_dtype("auto", "bfloat16", cpu)
    assert dtype == (torch.bfloat16 if fast else torch.float32), why
    assert loader.choose_dtype("auto", "float16", cpu)[0] == (
        torch.float16 if fast else torch.float32
    )
    assert loader.choose_dtype("auto", "float32", cpu)[0] == torch.float32
    assert loader.choose_dtype("auto", "bfloat16", torch.device("cuda"))[0] == torch.bfloat16
    assert loader.choose_dtype("bfloat16", "float32", cpu) == (torch.bfloat16, "bfloat16, as asked")


def test_dummy_format_builds_real_shapes_without_weight_files(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path, hf_model = hf_checkpoints["qwen2"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    model, _ = load_model(ModelConfig(str(tmp_path), load_format="dummy", show_progress=False))
    expected = {n: p.shape for n, p in hf_model.named_parameters()}
    assert model.checkpoint_names() == set(expected)
    assert torch.isfinite(logits_of(model)).all()
    again, _ = load_model(ModelConfig(str(tmp_path), load_format="dummy", show_progress=False))
    assert torch.equal(logits_of(model), logits_of(again))  # the seed fixes the weights


def test_generation_config_gives_eos_ids_and_defaults(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path, _ = hf_checkpoints["qwen2"]
    shutil.copytree(path, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1, 2], "temperature": 0.7, "top_p": 0.8})
    )
    info = read_model_info(ModelConfig(str(tmp_path / "m")))
    assert info.eos_token_ids == (1, 2)
    assert info.generation_config["temperature"] == 0.7


def test_missing_directory_is_reported() -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        read_model_info(ModelConfig("/nonexistent/model/dir"))


def test_hub_id_without_local_copy_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"HF_HUB_OFFLINE.*hf download some-org/tiny"):
        read_model_info(ModelConfig("some-org/tiny"))


def test_directory_without_config_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        read_model_info(ModelConfig(str(tmp_path)))


def test_missing_weight_files_are_reported(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path, _ = hf_checkpoints["qwen2"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_model(ModelConfig(str(tmp_path), show_progress=False))


def test_missing_shard_named_in_the_index_is_reported(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    _, hf_model = hf_checkpoints["qwen2"]
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelNotFoundError, match=victim.name):
        load_model(ModelConfig(str(tmp_path), show_progress=False))


def test_checkpoint_missing_tensors_is_reported(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = hf_checkpoints["qwen2"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor.*layers\.1\.mlp\.up_proj"):
        load_model(ModelConfig(str(tmp_path), show_progress=False))


def test_unsupported_architecture_lists_the_supported_ones(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path, _ = hf_checkpoints["qwen2"]
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        read_model_info(ModelConfig(str(tmp_path)))
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    for name in supported_architectures():
        assert name in message
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }


def test_config_values_are_checked() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig("x", dtype="int8")
    with pytest.raises(ValueError, match="load_format"):
        ModelConfig("x", load_format="pt")
    assert ModelConfig("x", dtype="bf16").dtype == "bfloat16"


def test_device_and_dtype_resolution() -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", None) == torch.float32
    assert resolve_dtype("auto", "bfloat16") == torch.bfloat16  # no device: the checkpoint's
    assert resolve_dtype("float16", "bfloat16") == torch.float16
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")


def test_loading_shows_a_progress_bar_over_shards(
    hf_checkpoints: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, hf_model = hf_checkpoints["qwen2"]
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    shards = len(list(tmp_path.glob("*.safetensors")))
    load_model(ModelConfig(str(tmp_path), show_progress=True))
    err = capsys.readouterr().err
    assert "Loading safetensors shards" in err
    assert f"{shards}/{shards}" in err


def test_cpu_weights_are_packed_at_the_first_forward(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    from radixlm.runtime.models.linear import PackedMergedColumnLinear, cpu_packing_available

    if not cpu_packing_available():
        pytest.skip("this torch build has no oneDNN")
    path, _ = hf_checkpoints["qwen2"]
    model, _ = load_model(ModelConfig(str(path), show_progress=False))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PackedMergedColumnLinear)
    before = logits_of(model)
    assert qkv.weight.numel() == 0  # the plain copy is released once packed
    plain, _ = load_model(ModelConfig(str(path), show_progress=False, cpu_weight_packing=False))
    assert not isinstance(plain.model.layers[0].self_attn.qkv_proj, PackedMergedColumnLinear)
    assert torch.allclose(logits_of(plain), before, atol=1e-5)


def test_packed_cpu_weights_take_a_later_load_of_some_rows(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    """A weight update after packing: the rows it names are replaced, the others keep their
    values (the plain weight comes back from the packed copy), as in an unpacked model."""
    from radixlm.runtime.models.linear import cpu_packing_available

    if not cpu_packing_available():
        pytest.skip("this torch build has no oneDNN")
    path, _ = hf_checkpoints["qwen2"]
    packed, _ = load_model(ModelConfig(str(path), show_progress=False))
    plain, _ = load_model(ModelConfig(str(path), show_progress=False, cpu_weight_packing=False))
    logits_of(packed)  # packs every layer and releases the plain weights
    generator = torch.Generator().manual_seed(3)
    update = [
        (name, torch.randn(shape, generator=generator) * 0.2)
        for name, shape in [
            ("model.layers.0.self_attn.k_proj.weight", (32, 64)),  # a part of q/k/v
            ("model.layers.1.mlp.down_proj.weight", (64, 128)),
            ("lm_head.weight", (packed.arch.vocab_size, 64)),
        ]
    ]
    for model in (packed, plain):
        model.load_weights(update)
    assert torch.allclose(logits_of(packed), logits_of(plain), atol=1e-5)


def test_hub_id_resolves_to_a_copy_in_the_local_hf_cache(
    hf_checkpoints: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path, _ = hf_checkpoints["qwen3"]
    repo = tmp_path / "models--some-org--tiny"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(path, repo / "snapshots" / revision)
    monkeypatch.chdir(tmp_path)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    info = read_model_info(ModelConfig("some-org/tiny"))
    assert info.path == repo / "snapshots" / revision
    assert info.arch.architecture == "Qwen3ForCausalLM"


def test_a_dtype_onednn_cannot_pack_here_gets_plain_linears(
    hf_checkpoints: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # AVX2-only CPUs: oneDNN refuses to pack bfloat16 weights; the model must still build and run.
    import radixlm.runtime.loader as loader
    from radixlm.runtime.models.linear import PackedMergedColumnLinear

    asked: list[torch.dtype] = []

    def only_float32(dtype: torch.dtype = torch.float32) -> bool:
        asked.append(dtype)
        return dtype == torch.float32

    monkeypatch.setattr(loader, "cpu_packing_available", only_float32)
    path, _ = hf_checkpoints["qwen2"]
    model, _ = load_model(ModelConfig(str(path), dtype="bfloat16", show_progress=False))
    assert asked == [torch.bfloat16]
    assert not isinstance(model.model.layers[0].self_attn.qkv_proj, PackedMergedColumnLinear)
    assert torch.isfinite(logits_of(model)).all()
    packed, _ = load_model(ModelConfig(str(path), dtype="float32", show_progress=False))
    assert isinstance(packed.model.layers[0].self_attn.qkv_proj, PackedMergedColumnLinear)
