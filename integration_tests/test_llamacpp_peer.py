"""llama.cpp as a benchmark peer and the machine-limit probe, without building llama.cpp: the
GGUF pre-tokenizer mapping and the converter patch (on a stand-in converter), the GGUF cache
key, the command lines of both servers (`llama_cpp.server`, the C++ `llama-server`), the
request bodies and concurrency cap of engine_bench's HTTP systems, quant_decode_bench's decode
rate, the limit arithmetic, and the benchmarks' new arguments. The round trips through a real
llama.cpp run only where tools/bench/_llamacpp.py has built it (never in CI, which must not
build it)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


def _bench_module(name: str) -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _id_tokenizer(directory: Path, vocab_size: int) -> Any:
    return _bench_module("_common").id_tokenizer(directory, vocab_size)


@pytest.fixture(scope="module")
def llamacpp() -> Any:
    return _bench_module("_llamacpp")


@pytest.fixture(scope="module")
def limit_probe() -> Any:
    return _bench_module("limit_probe")


@pytest.fixture(scope="module")
def serve_bench() -> Any:
    return _bench_module("serve_bench")


@pytest.fixture(scope="module")
def engine_bench() -> Any:
    return _bench_module("engine_bench")


# ------------------------------------------------------------------ GGUF pre-tokenizer


def test_the_id_tokenizer_maps_to_the_qwen2_pre_tokenizer(llamacpp: Any, tmp_path: Path) -> None:
    _id_tokenizer(tmp_path, 400)
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    assert llamacpp.pre_tokenizer_name(tokenizer_json) == "qwen2"


def test_a_locally_trained_byte_level_bpe_maps_to_gpt2(
    llamacpp: Any, serve_bench: Any, tmp_path: Path
) -> None:
    serve_bench._load_fake_engine().build_tokenizer(tmp_path)
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    assert tokenizer_json["pre_tokenizer"]["type"] == "ByteLevel"
    assert llamacpp.pre_tokenizer_name(tokenizer_json) == "gpt-2"


def test_an_unknown_pre_tokenizer_falls_back_to_gpt2(llamacpp: Any) -> None:
    assert llamacpp.pre_tokenizer_name({"pre_tokenizer": {"type": "Whitespace"}}) == "gpt-2"
    assert llamacpp.pre_tokenizer_name({"pre_tokenizer": None}) == "gpt-2"
    split = {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Isolated"}
    sequence = {"type": "Sequence", "pretokenizers": [split]}
    assert llamacpp.pre_tokenizer_name({"pre_tokenizer": sequence}) == "gpt-2"


def _stand_in_converter(cache_dir: Path, llamacpp: Any) -> None:
    """A vendored tree whose converter asks `TextModel.get_vocab_base_pre` (which, like the
    real one for an unknown tokenizer, raises) and writes the answer to --outfile."""
    root = llamacpp.sdist_dir(cache_dir) / "vendor" / "llama.cpp"
    (root / "conversion").mkdir(parents=True)
    (root / "gguf-py").mkdir()
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text(
        textwrap.dedent(
            """
            import logging
            logger = logging.getLogger("stand-in")

            class TextModel:
                def get_vocab_base_pre(self, tokenizer):
                    raise NotImplementedError("BPE pre-tokenizer was not recognized")
            """
        )
    )
    (root / "convert_hf_to_gguf.py").write_text(
        textwrap.dedent(
            """
            import argparse, sys
            from conversion.base import TextModel

            parser = argparse.ArgumentParser()
            parser.add_argument("model")
            parser.add_argument("--outfile")
            parser.add_argument("--outtype")
            args = parser.parse_args()
            with open(args.outfile, "w") as f:
                f.write(TextModel().get_vocab_base_pre(None) + " " + args.outtype)
            """
        )
    )


def test_convert_answers_the_converters_unknown_tokenizer_with_the_mapping(
    llamacpp: Any, tmp_path: Path
) -> None:
    cache, model = tmp_path / "cache", tmp_path / "model"
    _stand_in_converter(cache, llamacpp)
    _id_tokenizer(model, 400)
    out = llamacpp.convert(model, outtype="f32", cache_dir=cache)
    assert out.read_text() == "qwen2 f32"
    assert out.parent == cache / "gguf" and out.name.endswith("-f32.gguf")
    # Cached by the checkpoint's fingerprint: a second call does not convert again.
    out.write_text("kept")
    assert llamacpp.convert(model, outtype="f32", cache_dir=cache).read_text() == "kept"


def test_convert_without_the_sdist_says_to_install(llamacpp: Any, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(RuntimeError, match="install"):
        llamacpp.convert(tmp_path / "model", tmp_path / "x.gguf", cache_dir=tmp_path / "none")
    with pytest.raises(ValueError, match="outtype"):
        llamacpp.convert(tmp_path / "model", outtype="q4", cache_dir=tmp_path)


def test_the_fingerprint_follows_names_and_contents(llamacpp: Any, tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("1")
    first = llamacpp.checkpoint_fingerprint(tmp_path)
    assert llamacpp.checkpoint_fingerprint(tmp_path) == first
    (tmp_path / "a.json").write_text("2")
    assert llamacpp.checkpoint_fingerprint(tmp_path) != first


def test_the_dummy_checkpoint_is_the_same_files_each_time(serve_bench: Any, tmp_path: Path) -> None:
    llamacpp = _bench_module("_llamacpp")
    one = serve_bench.build_dummy_model("tiny", tmp_path / "one", "bfloat16")
    two = serve_bench.build_dummy_model("tiny", tmp_path / "two", "bfloat16")
    assert json.loads((one / "config.json").read_text())["dtype"] == "bfloat16"
    assert llamacpp.checkpoint_fingerprint(one) == llamacpp.checkpoint_fingerprint(two)


def test_an_empty_cache_is_not_installed(llamacpp: Any, tmp_path: Path) -> None:
    assert not llamacpp.is_installed(tmp_path)
    (tmp_path / "installed").write_text("0.0.1\n")
    assert not llamacpp.is_installed(tmp_path)


def test_the_server_runs_with_the_threads_and_without_interrupting(
    llamacpp: Any, tmp_path: Path
) -> None:
    options = llamacpp.ServerOptions(threads=1, n_ctx=2048, extra=("--flash_attn", "True"))
    cmd = llamacpp.server_command(tmp_path / "m.gguf", 8123, "model", options, tmp_path)
    assert cmd[:3] == [str(llamacpp.venv_python(tmp_path)), "-m", "llama_cpp.server"]
    pairs = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert pairs["--n_threads"] == pairs["--n_threads_batch"] == "1"
    assert pairs["--interrupt_requests"] == "False"
    assert pairs["--n_ctx"] == "2048" and pairs["--port"] == "8123"
    assert cmd[-2:] == ["--flash_attn", "True"]


def test_llama_server_batches_over_slots_that_split_the_context(
    llamacpp: Any, tmp_path: Path
) -> None:
    options = llamacpp.LlamaServerOptions(threads=1, parallel=8, slot_ctx=2048, extra=("-fa", "on"))
    cmd = llamacpp.llama_server_command(tmp_path / "m.gguf", 8123, "model", options, tmp_path)
    assert cmd[0] == str(llamacpp.llama_server_binary(tmp_path))
    assert "--cont-batching" in cmd
    named = [i for i, arg in enumerate(cmd) if arg.startswith("-")]
    pairs = {cmd[i]: cmd[i + 1] for i in named if i + 1 not in named and i + 1 < len(cmd)}
    assert pairs["--model"] == str(tmp_path / "m.gguf") and pairs["--alias"] == "model"
    assert pairs["--threads"] == pairs["--threads-batch"] == "1"
    assert pairs["--parallel"] == "8" and pairs["--ctx-size"] == str(8 * 2048)
    assert pairs["--cache-reuse"] == "256"
    assert (pairs["--host"], pairs["--port"]) == ("127.0.0.1", "8123")
    assert cmd[-2:] == ["-fa", "on"]


def test_an_empty_cache_has_no_llama_server_to_start(llamacpp: Any, tmp_path: Path) -> None:
    assert not llamacpp.is_server_built(tmp_path)
    with pytest.raises(RuntimeError, match="install-server"):
        llamacpp.start_llama_server(tmp_path / "m.gguf", 8123, tmp_path / "log",
                                    cache_dir=tmp_path)  # fmt: skip


# ------------------------------------------------------------------------- the limit


QWEN = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
}  # fmt: skip


def test_the_shape_counts_the_projection_weights(limit_probe: Any) -> None:
    shape = limit_probe.ModelShape.from_config(QWEN)
    assert shape.head_dim == 64
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    assert shape.projection_params == 24 * per_layer
    assert shape.flops_per_prompt_token == 2 * 24 * per_layer


def test_unique_prompt_tokens_count_a_shared_prefix_once(limit_probe: Any) -> None:
    prefix = list(range(100))
    prompts = [([*prefix, 1000 + i, 2000 + i], []) for i in range(4)]
    assert limit_probe.unique_prompt_tokens(prompts) == 102 + 3 * 2


def test_a_repeated_prompt_still_computes_its_last_token(limit_probe: Any) -> None:
    assert limit_probe.unique_prompt_tokens([([1, 2, 3], []), ([1, 2, 3], [])]) == 4
    # n samples of one prompt: the prompt once, then its last token for each other sample.
    assert limit_probe.unique_prompt_tokens([([1, 2, 3], [[7], [8], [9]])]) == 5


def test_earlier_outputs_are_reusable_prompt_tokens(limit_probe: Any) -> None:
    first = ([1, 2, 3], [[4, 5, 6]])
    # The next turn: the history (prompt + output) and a new question; all but the output's
    # last token was computed already.
    turn = ([1, 2, 3, 4, 5, 6, 7, 8], [[9]])
    assert limit_probe.unique_prompt_tokens([first, turn]) == 3 + 3


def test_attention_pairs_count_each_computed_token_with_its_keys(limit_probe: Any) -> None:
    prefix = list(range(100))
    prompts = [([*prefix, 1000 + i, 2000 + i], []) for i in range(3)]
    # the first prompt's 102 tokens attend 1 .. 102 keys; each later one's last two 101, 102
    assert limit_probe.attention_keys(prompts) == sum(range(1, 103)) + 2 * (101 + 102)
    # an output of 4 tokens: its first from the prefill, then steps over 4, 5 and 6 keys
    assert limit_probe.attention_keys([([1, 2, 3], [[7, 8, 9, 10]])]) == 6 + 4 + 5 + 6
    # n samples: the prompt once, each other sample its last token again (3 keys)
    assert limit_probe.attention_keys([([1, 2, 3], [[7], [8]])]) == 6 + 3


def test_attention_time_is_its_flops_at_the_rate(limit_probe: Any) -> None:
    shape = limit_probe.ModelShape.from_config(QWEN)
    rates = limit_probe.Rates(shape, "float32", 1, "cpu", 100.0, {8: 0.25})
    demand = limit_probe.Demand(1000, ((8, 40),), attention_keys=10**6)
    flops = 4 * 10**6 * 14 * 64 * 24
    assert rates.attention_seconds(demand) == pytest.approx(flops / 100e9)
    assert rates.attention_seconds(limit_probe.Demand(1000, ((8, 40),))) == 0
    # serve_demand counts them: 16 prompts of 10 tokens, 32 tokens out of each
    served = limit_probe.serve_demand([[i] * 10 for i in range(16)], 32, 8)
    assert served.attention_keys == 16 * (sum(range(1, 11)) + sum(range(11, 42)))


def test_serve_demand_decodes_in_waves_of_the_concurrency(limit_probe: Any) -> None:
    prompts = [[i] * 10 for i in range(16)]
    demand = limit_probe.serve_demand(prompts, output_len=32, concurrency=8)
    assert demand.unique_prompt_tokens == 160
    assert demand.decode_steps == ((8, 62),)
    odd = limit_probe.serve_demand(prompts[:10], output_len=5, concurrency=8)
    assert odd.decode_steps == ((8, 4), (2, 4))


def test_the_limit_adds_prefill_and_decode_time(limit_probe: Any) -> None:
    shape = limit_probe.ModelShape.from_config(QWEN)
    gflops = shape.flops_per_prompt_token * 100 / 1e9  # 100 prompt tokens per second
    rates = limit_probe.Rates(shape, "float32", 1, "cpu", gflops, {8: 0.25, 2: 0.1})
    assert rates.prompt_tokens_per_s == pytest.approx(100)
    demand = limit_probe.Demand(1000, ((8, 40), (2, 10)))
    assert rates.limit_seconds(demand) == pytest.approx(10 + 40 * 0.25 + 10 * 0.1)
    assert limit_probe.share(20.0, 40.0) == 0.5
    assert math.isnan(limit_probe.share(20.0, 0.0))
    with pytest.raises(KeyError, match="batch 4"):
        rates.step_time(4)


def test_the_floor_counts_every_flop_at_the_prefill_rate(limit_probe: Any) -> None:
    shape = limit_probe.ModelShape.from_config(QWEN)
    per_token = shape.flops_per_prompt_token
    assert shape.flops_per_decode_token == per_token + 2 * 151936 * 896
    rates = limit_probe.Rates(shape, "float32", 1, "cpu", per_token * 100 / 1e9, {8: 9.0})
    demand = limit_probe.Demand(1000, ((8, 40), (2, 10)))
    assert demand.decode_tokens == 8 * 40 + 2 * 10
    expected = 10 + 340 * shape.flops_per_decode_token / (per_token * 100)
    assert rates.floor_seconds(demand) == pytest.approx(expected)
    # With the read bandwidth: no step is shorter than one read of the weights.
    weights = (shape.projection_params + 151936 * 896) * 4
    assert shape.weight_bytes("float32") == weights == 2 * shape.weight_bytes("bfloat16")
    step_compute = (expected - 10) / 340  # seconds per decoded token at the rate
    slow = limit_probe.Rates(shape, "float32", 1, "cpu", rates.prefill_gflops, {}, 1.0)
    read = weights / 1e9  # seconds at 1 GB/s
    assert read > 8 * step_compute
    assert slow.floor_seconds(demand) == pytest.approx(10 + 50 * read)
    fast = limit_probe.Rates(shape, "float32", 1, "cpu", rates.prefill_gflops, {}, 1e6)
    assert fast.floor_seconds(demand) == pytest.approx(expected)


def test_decode_attention_reads_a_shared_prefix_once(limit_probe: Any) -> None:
    prefix = list(range(10))
    batch = [([*prefix, 100], [7, 8, 9]), ([*prefix, 200], [5, 6, 4])]
    # step 1 decodes each output's second token over its 11 prompt tokens and its first:
    # 12 keys each; it reads the 12 distinct cached tokens (the prefix once, the two last
    # prompt tokens), not the tokens it writes; step 2 reads those and the two first outputs
    assert limit_probe.decode_attention(batch) == [(2, 12, 24), (2, 14, 26)]
    # the same prompt twice: its tokens once, each output's own after them
    same = [([1, 2, 3], [7, 8, 9]), ([1, 2, 3], [5, 6, 4])]
    assert limit_probe.decode_attention(same) == [(2, 3, 8), (2, 5, 10)]
    # an output done leaves the batch
    ragged = [([1, 2], [7, 8, 9]), ([3, 4], [5])]
    assert limit_probe.decode_attention(ragged) == [(1, 4, 3), (1, 5, 4)]
    # the pairs agree with attention_keys: prompt tokens' plus each step's
    calls = [(prompt, [output]) for prompt, output in batch]
    steps = limit_probe.decode_attention(batch)
    assert limit_probe.attention_keys(calls) == limit_probe.prompt_attention_keys(calls) + sum(
        pairs for _, _, pairs in steps
    )


def test_the_floor_with_attention_adds_its_flops_and_reads(limit_probe: Any) -> None:
    shape = limit_probe.ModelShape.from_config(QWEN)
    assert shape.kv_bytes_per_token("float32") == 2 * 24 * 2 * 64 * 4
    assert shape.flops_per_key == 4 * 14 * 64 * 24
    per_token = shape.flops_per_prompt_token
    gflops = per_token * 100 / 1e9  # 100 prompt tokens per second
    weights, kv = shape.weight_bytes("float32"), shape.kv_bytes_per_token("float32")
    steps = ((8, 1000, 8000), (8, 100_000, 8100))
    demand = limit_probe.Demand(1000, ((8, 2),), 0, 5000, steps)
    rate = gflops * 1e9
    prefill = 10 + 5000 * shape.flops_per_key / rate
    # FLOPs alone (no bandwidth): each step its tokens' and its pairs'
    flops_only = limit_probe.Rates(shape, "float32", 1, "cpu", gflops, {})
    compute = [
        (8 * shape.flops_per_decode_token + p * shape.flops_per_key) / rate for _, _, p in steps
    ]
    assert flops_only.floor_seconds(demand) == pytest.approx(prefill + sum(compute))
    # at 1 GB/s each step reads its weights and its cached tokens' K/V, less the caches
    slow = limit_probe.Rates(shape, "float32", 1, "cpu", gflops, {}, 1.0, cache_bytes=10**6)
    reads = [(weights + k * kv - 10**6) / 1e9 for _, k, _ in steps]
    assert all(r > c for r, c in zip(reads, compute, strict=True))
    assert slow.floor_seconds(demand) == pytest.approx(prefill + sum(reads))
    # the floor counts FLOPs at the faster of torch's rate and the panels'
    faster = limit_probe.Rates(shape, "float32", 1, "cpu", gflops, {}, panel_gflops=2 * gflops)
    assert faster.floor_gflops == 2 * gflops
    assert faster.floor_seconds(demand) == pytest.approx((prefill + sum(compute)) / 2)
    assert flops_only.floor_gflops == gflops  # (nan panels: torch's)
    # serve_demand gives each wave's steps, in order
    served = limit_probe.serve_demand([[i] * 10 for i in range(16)], 4, 8)
    assert [b for b, _, _ in served.step_attention] == [8] * 6
    assert served.step_attention[0] == (8, 80, 8 * 11)
    assert served.prompt_attention_keys == 16 * sum(range(1, 11))


def test_the_caches_are_counted_once_each(limit_probe: Any) -> None:
    import torch

    held = limit_probe.cache_bytes(torch.device("cpu"))
    assert held >= 0
    if Path("/sys/devices/system/cpu/cpu0/cache/index0/size").exists():
        assert held > 0


def test_the_probe_measures_positive_rates_at_the_asked_batches(limit_probe: Any) -> None:
    tiny = {**QWEN, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    tiny.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    shape = limit_probe.ModelShape.from_config(tiny)
    rates = limit_probe.probe(
        shape, "float32", 0, [1, 4], prefill_tokens=32, repeats=1, read_megabytes=16
    )
    assert rates.prefill_gflops > 0 and set(rates.step_seconds) == {1, 4}
    assert rates.read_gbps > 0 and "GB/s" in rates.describe()
    assert all(t > 0 for t in rates.step_seconds.values())


def test_decode_steps_parse_as_batch_and_steps(limit_probe: Any) -> None:
    assert limit_probe.parse_steps("8:31, 4:31") == ((8, 31), (4, 31))
    with pytest.raises(ValueError, match="BATCH:STEPS"):
        limit_probe.parse_steps("2x31")


# ------------------------------------------------------------------ the benchmarks' CLIs


def test_serve_bench_takes_peers_and_keeps_transformers_as_default(serve_bench: Any) -> None:
    assert serve_bench.parse_args(["--compare"]).peers == ("transformers",)
    args = serve_bench.parse_args(["--compare", "--peers", "llamacpp,transformers"])
    assert args.peers == ("llamacpp", "transformers")
    assert serve_bench.parse_args(["--compare", "--peers", "none"]).peers == ()
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--compare", "--peers", "vllm"])


def test_serve_bench_presets_set_the_issues_workloads_in_tokens(serve_bench: Any) -> None:
    args = serve_bench.parse_args(["--compare", "--workload", "few-shot", "--num-prompts", "3"])
    assert (args.dataset, args.num_groups, args.prefix_len) == ("shared-prefix", 1, 1561)
    assert (args.num_prompts, args.max_concurrency, args.length_unit) == (16, 8, "tokens")
    args = serve_bench.parse_args(["--compare", "--workload", "no-sharing"])
    assert (args.dataset, args.input_len, args.num_prompts) == ("random", 490, 16)


def test_serve_bench_passes_server_arguments_through(serve_bench: Any) -> None:
    args = serve_bench.parse_args(
        ["--compare", "--radixlm-args", "--quantization int8 --dtype float32", "--threads", "1",
         "--llamacpp-quant", "Q8_0"]
    )  # fmt: skip
    assert args.radixlm_args == "--quantization int8 --dtype float32"
    assert (args.threads, args.llamacpp_quant, args.llamacpp_outtype) == (1, "Q8_0", "bf16")
    assert serve_bench._radixlm_dtype(args.radixlm_args) == "float32"
    assert serve_bench._radixlm_dtype("--dtype=bfloat16") == "bfloat16"
    assert serve_bench._radixlm_dtype("") == "auto"


def test_token_lengths_come_out_exact(serve_bench: Any, tmp_path: Path) -> None:
    tokenizer = _id_tokenizer(tmp_path, 5000)
    args = serve_bench.parse_args(["--compare", "--workload", "few-shot"])
    prompts = serve_bench.build_prompts(args, tokenizer)
    assert len(prompts) == 16 and len({p.system for p in prompts}) == 1
    assert len(tokenizer.encode(prompts[0].system, add_special_tokens=False)) == 1561
    assert all(len(tokenizer.encode(p.user, add_special_tokens=False)) == 20 for p in prompts)


def test_the_table_gives_the_first_columns_ratio_over_each_other(
    serve_bench: Any, capsys: Any
) -> None:
    serve_bench.print_table(
        {
            "radixlm": {"duration_s": 10.0, "output_tok_s": 30.0},
            "llamacpp": {"duration_s": 20.0, "output_tok_s": 15.0},
            "transformers": {"duration_s": 40.0, "output_tok_s": 7.5},
        }
    )
    out = capsys.readouterr().out
    assert "1st/llamacpp" in out and "1st/transformers" in out
    duration = next(line for line in out.splitlines() if line.startswith("duration_s"))
    assert duration.split()[-2:] == ["2.00x", "4.00x"]


def test_engine_bench_offers_llamacpp_over_http(engine_bench: Any) -> None:
    assert engine_bench.HttpSystem.SERVERS["llamacpp"] == "llamacpp-serve"
    assert engine_bench.base_of("llamacpp-serve") == "radixlm-serve"
    assert "llamacpp-serve" in engine_bench.ORDER


def test_llamacpp_bans_the_special_tokens_for_ignore_eos(engine_bench: Any, tmp_path: Path) -> None:
    tokenizer = _id_tokenizer(tmp_path, 400)
    system = engine_bench.HttpSystem("llamacpp", "m", tokenizer, client=None)
    call = engine_bench.Call(
        [300, 301], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    )
    body = system._body(call, None)
    assert body["logit_bias"] == {"0": -1e9} and "ignore_eos" not in body


def test_engine_bench_offers_llama_server_against_radixlm_serve(engine_bench: Any) -> None:
    assert engine_bench.HttpSystem.SERVERS["llama-server"] == "llama-server"
    assert engine_bench.base_of("llama-server") == "radixlm-serve"
    assert engine_bench.base_of("radixlm-nocache") == "radixlm"
    assert "llama-server" in engine_bench.ORDER


def test_llama_server_bans_the_special_tokens_and_caches_prompts(
    engine_bench: Any, tmp_path: Path
) -> None:
    tokenizer = _id_tokenizer(tmp_path, 400)
    system = engine_bench.HttpSystem("llama-server", "m", tokenizer, client=None)
    call = engine_bench.Call(
        [300, 301], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    )
    body = system._body(call, 7)
    assert body["logit_bias"] == {"0": -1e9} and body["cache_prompt"] is True
    assert (body["max_tokens"], body["seed"], body["model"]) == (4, 7, "m")


class _CountingClient:
    """A stand-in httpx client whose completions (each `text`) take a moment; it records the
    most requests that were in flight at once."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.lock = threading.Lock()
        self.in_flight = self.most = 0

    def post(self, path: str, json: dict[str, Any]) -> Any:
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        time.sleep(0.02)
        with self.lock:
            self.in_flight -= 1
        return _Reply({"choices": [{"text": self.text}], "usage": self.USAGE})

    USAGE: ClassVar[dict[str, Any]] = {
        "prompt_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


@dataclass
class _Reply:
    body: dict[str, Any]
    status_code: int = 200

    def json(self) -> dict[str, Any]:
        return self.body


def test_concurrency_caps_the_requests_in_flight(engine_bench: Any, tmp_path: Path) -> None:
    tokenizer = _id_tokenizer(tmp_path, 400)
    client = _CountingClient(tokenizer.decode([300]))
    system = engine_bench.HttpSystem("llama-server", "m", tokenizer, client, concurrency=3)
    calls = [engine_bench.Call([300], {"max_new_tokens": 1, "temperature": 0}) for _ in range(12)]
    system.generate(calls)
    assert client.most == 3
    assert all(c.outputs == [[300]] for c in calls)
    assert system.hit_rate() == 0.5  # llama-server's usage counts its cached prompt tokens


def test_a_llamacpp_server_that_answered_is_started_afresh_for_the_next_workload(
    engine_bench: Any, tmp_path: Path
) -> None:
    class Process:
        def terminate(self) -> None:
            self.ended = True

        def wait(self, timeout: float) -> int:
            return 0

    first, second = Process(), Process()
    tokenizer = _id_tokenizer(tmp_path, 400)
    system = engine_bench.HttpSystem("llama-server", "m", tokenizer, _CountingClient(), first,
                                     restart=lambda: second)  # fmt: skip
    system.reset()
    assert system.process is first  # not used yet: nothing to drop
    system.generate([engine_bench.Call([300], {"max_new_tokens": 1, "temperature": 0})])
    system.reset()
    assert first.ended and system.process is second


def test_the_decode_rate_cancels_prefill_and_http_time(monkeypatch: Any) -> None:
    bench = _bench_module("quant_decode_bench")
    # Every run: 0.5 s of prefill and HTTP, then 0.01 s per decode step for the whole batch.
    monkeypatch.setattr(bench, "complete_all", lambda url, model, prompts, n: 0.5 + 0.01 * n)
    args = bench.parse_args(["--short", "16", "--long", "144"])
    assert args.batches == [1, 8]
    assert bench.decode_rate("url", "m", 8, args) == pytest.approx(800)
    with pytest.raises(SystemExit):
        bench.parse_args(["--short", "16", "--long", "16"])


def test_engine_bench_demand_replays_the_workloads_stages(engine_bench: Any) -> None:
    args = argparse.Namespace(shape="quick", quick=True, seed=0, scale=1.0)
    few_shot = engine_bench.workload_demand("few_shot", args)
    assert few_shot.unique_prompt_tokens == 1500 + 64 * 20
    assert few_shot.decode_steps == ((64, 7),)  # 8 output tokens, the first from prefill
    consistency = engine_bench.workload_demand("self_consistency", args)
    assert consistency.decode_steps == ((64, 7),)  # 8 prompts x n = 8 decode together
    # each step reads the shared prefix once: 600 tokens, the 8 prompts' own 30 each, then
    # every sample's tokens so far (the n samples of a prompt differ)
    first, second = consistency.step_attention[:2]
    assert first == (64, 600 + 8 * 30, 64 * 631) and second == (64, 840 + 64, 64 * 632)
    assert engine_bench.workload_demand("json", args) is None  # outputs end at the schema
    # At most 8 in flight (--concurrency 8): the 64 sequences decode 8 at a time.
    args.concurrency = 8
    few_shot = engine_bench.workload_demand("few_shot", args)
    assert few_shot.decode_steps == ((8, 56),)
    assert len(few_shot.step_attention) == 56  # each batch of 8 over its own prompts
    assert few_shot.step_attention[0] == few_shot.step_attention[7] == (8, 1500 + 8 * 20, 8 * 1521)


# ------------------------------------------------------------- with llama.cpp built


@pytest.mark.skipif(
    not _bench_module("_llamacpp").is_installed(),
    reason="llama.cpp is not built here (tools/bench/_llamacpp.py install); CI never builds it",
)
def test_a_tiny_checkpoint_is_served_by_llamacpp_and_streams_text(
    llamacpp: Any, serve_bench: Any, tmp_path: Path
) -> None:
    import asyncio

    model = serve_bench.build_dummy_model("tiny", tmp_path / "model", "bfloat16")
    gguf = llamacpp.convert(model, tmp_path / "tiny.gguf")
    quantized = llamacpp.quantize(gguf, tmp_path / "tiny-q8.gguf", "Q8_0")
    port = serve_bench._free_port()
    options = llamacpp.ServerOptions(threads=1, n_ctx=512)
    server = llamacpp.start_server(quantized, port, tmp_path / "log", "tiny", options, 120)
    try:
        prompts = serve_bench.random_dataset(3, 8, 6, seed=0)
        results, _ = asyncio.run(
            serve_bench.run_load(server.url, "completions", "tiny", prompts, float("inf"), 2,
                                 {"logit_bias": {}}, 0)
        )  # fmt: skip
    finally:
        server.stop()
    assert all(r.ok and r.text for r in results)
    assert all(r.prompt_tokens == 0 for r in results)  # no usage in llama.cpp's streams


def _llama_server_built() -> bool:
    llamacpp = _bench_module("_llamacpp")
    return bool(llamacpp.is_installed() and llamacpp.is_server_built())


@pytest.mark.skipif(
    not _llama_server_built(),
    reason="llama-server is not built here (tools/bench/_llamacpp.py install, install-server); "
    "CI never builds it",
)
def test_a_tiny_checkpoint_is_served_by_llama_server_which_reuses_the_prompt(
    llamacpp: Any, serve_bench: Any, tmp_path: Path
) -> None:
    import httpx

    model = serve_bench.build_dummy_model("tiny", tmp_path / "model", "bfloat16")
    gguf = llamacpp.convert(model, tmp_path / "tiny.gguf")
    port = serve_bench._free_port()
    options = llamacpp.LlamaServerOptions(threads=1, parallel=2, slot_ctx=512)
    server = llamacpp.start_llama_server(gguf, port, tmp_path / "log", "tiny", options, 120)
    body = {"model": "tiny", "prompt": "hello world " * 8, "max_tokens": 4, "temperature": 0,
            "cache_prompt": True, "logit_bias": {}}  # fmt: skip
    try:
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    finally:
        server.stop()
    assert first["choices"][0]["text"] and first["usage"]["completion_tokens"] == 4
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < again["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt
