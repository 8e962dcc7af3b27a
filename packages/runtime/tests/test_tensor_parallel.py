"""Tensor parallelism (gloo, CPU): every rank's shard together computes what one device does.

Tiny random models of each family are split over 2 and 4 spawned ranks; rank 0's prefill
logits must equal the unsplit runner's within 1e-4 (fp32), its greedy continuations must be
the same tokens, and each rank must hold about 1/N of the weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import tp_ranks

from radixlm.runtime import ModelRunner
from radixlm.runtime.config import EngineConfig

PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33, 2, 200, 11, 9, 180, 77, 4, 61, 19]
STEPS = 32

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    eos_token_id=1,
    bos_token_id=0,
)
# name -> (config class, what differs): every case of sharding the tests must cover.
MODELS: dict[str, tuple[Any, dict[str, Any]]] = {
    # Tied embeddings, llama3 rope scaling.
    "llama3-tied": (
        transformers.LlamaConfig,
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # One K/V head: fewer than the ranks at TP=2 and TP=4, replicated on each.
    "llama-mqa": (transformers.LlamaConfig, dict(num_key_value_heads=1)),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=6)),
    # q/k/v biases; a vocabulary that does not split evenly (the last rank pads).
    "qwen2-bias": (transformers.Qwen2Config, dict(vocab_size=251, tie_word_embeddings=False)),
    # q/k norms, head_dim unrelated to hidden / heads, tied.
    "qwen3-qknorm": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    paths = {}
    for name, (config_class, extra) in MODELS.items():
        config = config_class(**{**COMMON, **extra})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        model.save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.fixture(scope="module")
def unsplit(checkpoints: dict[str, Path]) -> dict[str, Any]:
    return tp_ranks.probe([str(p) for p in checkpoints.values()], PROMPT, STEPS)


@pytest.fixture(scope="module")
def split(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, Any]]:
    """Rank 0's probe of every model at TP=2 and TP=4 (one spawned group each)."""
    workdir = tmp_path_factory.mktemp("tp-groups")
    paths = [str(p) for p in checkpoints.values()]
    return {size: tp_ranks.probe_on_ranks(size, workdir, paths, PROMPT, STEPS) for size in (2, 4)}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_logits_equal_one_device(
    name: str,
    size: int,
    checkpoints: dict[str, Path],
    unsplit: dict[str, Any],
    split: dict[int, dict[str, Any]],
) -> None:
    path = str(checkpoints[name])
    ours = split[size][path]["logits"]
    reference = unsplit[path]["logits"]
    assert ours.shape == reference.shape == (len(PROMPT), MODELS[name][1].get("vocab_size", 256))
    assert (ours - reference).abs().max().item() <= 1e-4


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_continuations_identical(
    name: str,
    size: int,
    checkpoints: dict[str, Path],
    unsplit: dict[str, Any],
    split: dict[int, dict[str, Any]],
) -> None:
    path = str(checkpoints[name])
    assert len(unsplit[path]["greedy"]) == STEPS
    assert split[size][path]["greedy"] == unsplit[path]["greedy"]


def test_unsplit_runner_matches_transformers(checkpoints: dict[str, Path]) -> None:
    # The reference the split runs are held to is itself right (one family is enough here:
    # test_runtime_parity covers every family).
    path = checkpoints["qwen2-bias"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    runner = ModelRunner(tp_ranks.runner_config(path))
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT])).logits[0]
    assert (tp_ranks.all_position_logits(runner, PROMPT) - theirs).abs().max().item() <= 1e-4


def _replicated_bytes(runner: ModelRunner, size: int) -> int:
    """Bytes a rank holds beyond its 1/N share: norms and rotary tables (whole on every rank),
    K/V projections when there are fewer K/V heads than ranks (each rank keeps a whole head, not
    1/N of them) and vocabulary padding rows."""
    model = runner.model
    total = sum(b.numel() * b.element_size() for b in model.buffers())
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            total += param.numel() * param.element_size()
    arch = runner.info.arch
    if arch.num_kv_heads < size:
        for layer in model.model.layers:
            proj = layer.self_attn.qkv_proj
            kv_bytes = (proj.out_features - arch.num_heads * arch.head_dim) * proj.in_features * 4
            total += kv_bytes // arch.num_kv_heads - kv_bytes // size
    tables = 1 if arch.tie_word_embeddings else 2
    total += tables * size * arch.hidden_size * 4  # at most one padding row per rank
    return total


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_holds_its_share_of_the_weights(
    name: str,
    size: int,
    checkpoints: dict[str, Path],
    unsplit: dict[str, Any],
    split: dict[int, dict[str, Any]],
) -> None:
    path = str(checkpoints[name])
    whole = unsplit[path]["weight_bytes"][0]
    runner = ModelRunner(tp_ranks.runner_config(path))
    slack = _replicated_bytes(runner, size)
    assert slack < whole / size / 4  # the tolerance is small beside the share itself
    per_rank = split[size][path]["weight_bytes"]
    assert len(per_rank) == size
    for measured in per_rank:
        assert whole / size <= measured <= whole / size + slack, (measured, whole / size, slack)


def test_kv_heads_split_or_replicated(
    checkpoints: dict[str, Path], split: dict[int, dict[str, Any]]
) -> None:
    # 2 K/V heads: one per rank at TP=2, and still one (replicated) at TP=4.
    assert split[2][str(checkpoints["llama3-tied"])]["kv_heads"] == 1
    assert split[4][str(checkpoints["llama3-tied"])]["kv_heads"] == 1
    assert split[4][str(checkpoints["llama-mqa"])]["kv_heads"] == 1


def test_shapes_that_do_not_split_are_refused(checkpoints: dict[str, Path]) -> None:
    from radixlm.runtime.loader import ModelLoadError
    from radixlm.runtime.models.linear import HeadLayout

    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible"):
        HeadLayout.of(4, 2, 16, tp_ranks.TensorParallel(rank=0, size=3))
    with pytest.raises(ValueError, match="must divide one another"):
        HeadLayout.of(12, 3, 16, tp_ranks.TensorParallel(rank=0, size=2))
    assert issubclass(ModelLoadError, RuntimeError)


def test_parallel_options_are_checked() -> None:
    def config(**kwargs: Any) -> EngineConfig:
        return EngineConfig.from_kwargs("m", **kwargs)

    # (engine_process given as None: the default, whatever a test plugin sets.)
    assert config(tp_size=2, engine_process=None).in_process
    assert not config(engine_process=None).in_process
    with pytest.raises(ValueError, match="drop engine_process=False"):
        config(tp_size=2, engine_process=False)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        config(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        config(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        config(tp_size=2, dist_init_addr="localhost")
    with pytest.raises(ValueError, match="node_rank must be in"):
        config(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="dist_backend must be one of"):
        config(dist_backend="mpi")
    assert config(tensor_parallel_size=4).runner.parallel.tp_size == 4
    ranks = config(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="h:1").runner.parallel
    assert list(ranks.node_ranks) == [2, 3]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL tensor parallelism needs two GPUs (one rank per GPU)",
)
def test_nccl_engine_on_two_gpus_equals_one(tmp_path: Path) -> None:
    from radixlm.runtime import Engine
    from radixlm.runtime.fixtures import build_tiny_model

    path = str(build_tiny_model(tmp_path / "qwen2", "Qwen2ForCausalLM"))
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    prompts = ["the cache of the radix tree", "a batch", "decode steps of the model"]
    options = dict(show_progress=False, max_total_tokens=4096, device="cuda", dtype="float32")
    outputs = {}
    for tp_size in (1, 2):
        with Engine(path, tp_size=tp_size, engine_process=True, **options) as eng:
            assert eng.server_info()["tp_size"] == tp_size
            outputs[tp_size] = [o["output_ids"] for o in eng.generate(prompts, params)]
    assert outputs[2] == outputs[1]
