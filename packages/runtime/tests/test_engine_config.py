"""EngineConfig from SGLang-style keyword arguments, and the Reply both sync and async code use."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import pytest

from radixlm.runtime import EngineConfig, Reply


def test_sglang_kwargs_land_in_the_composed_config() -> None:
    config = EngineConfig.from_kwargs(
        "/models/m",
        mem_fraction_static=0.5,
        max_running_requests=12,
        chunked_prefill_size=-1,
        schedule_policy="dfs-weight",
        disable_radix_cache=True,
        disable_jump_forward=True,
        grammar_backend=None,
        json_whitespace="any",
        disable_cuda_graph=True,
        sampling_defaults="openai",
    )
    assert config.model_path == "/models/m"
    assert config.runner.memory.kv_cache_fraction == 0.5
    assert config.runner.memory.max_running_requests == 12
    assert not hasattr(config.scheduler, "max_running_requests")  # held once, by the memory
    assert config.scheduler.chunked_prefill_size is None  # -1 disables chunking
    assert config.scheduler.schedule_policy == "dfs-weight"
    assert config.cache.disable_radix_cache
    assert not config.grammar.jump_forward and config.grammar.backend == "none"
    assert config.grammar.json_whitespace == "flexible"
    assert not config.runner.attention.cuda_graph
    assert config.sampling_defaults == "openai"


def test_grammar_defaults_are_auto_lenient_and_8_mib() -> None:
    grammar = EngineConfig.from_kwargs("/m").grammar
    assert (grammar.backend, grammar.strict, grammar.max_constraint_bytes) == (
        "auto",
        False,
        8 * 1024 * 1024,
    )


def test_grammar_kwargs_set_backend_strictness_and_size_limit() -> None:
    grammar = EngineConfig.from_kwargs(
        "/m", grammar_backend="llguidance", strict_constraints=True, max_constraint_bytes=4096
    ).grammar
    assert (grammar.backend, grammar.strict, grammar.max_constraint_bytes) == (
        "llguidance",
        True,
        4096,
    )


def test_json_schema_dir_sets_the_grammar_documents_directory(tmp_path: Any) -> None:
    grammar = EngineConfig.from_kwargs("/m", json_schema_dir=tmp_path).grammar
    assert grammar.schema_dir == str(tmp_path)
    assert EngineConfig.from_kwargs("/m").grammar.schema_dir is None
    with pytest.raises(ValueError, match="json_schema_dir"):
        EngineConfig.from_kwargs("/m", json_schema_dir=str(tmp_path / "absent"))


def test_every_grammar_backend_choice_is_accepted() -> None:
    from radixlm.runtime.config import GRAMMAR_BACKENDS

    assert GRAMMAR_BACKENDS == ("auto", "xgrammar", "llguidance", "outlines", "none")
    for name in GRAMMAR_BACKENDS:
        assert EngineConfig.from_kwargs("/m", grammar_backend=name).grammar.backend == name


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"quantization": "int3"}, "quantization"),
        ({"schedule_policy": "longest"}, "schedule_policy"),
        ({"radix_eviction_policy": "mru"}, "radix_eviction_policy"),
        ({"dtype": "float64"}, "dtype"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"log_level": "loud"}, "log_level"),
        ({"quantization_group_size": 48}, "quantization_group_size"),
    ],
)
def test_invalid_values_are_errors_naming_the_keyword(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field} must"):
        EngineConfig.from_kwargs("/m", **kwargs)


def test_every_choice_the_cli_offers_is_accepted() -> None:
    from radixlm.runtime.config import ENGINE_CHOICES

    # Choices that need a companion setting get it.
    draft = {"speculative_draft_model_path": "/d"}
    companions: dict[tuple[str, object], dict[str, str]] = {
        ("speculative_algorithm", kind): draft for kind in ("STANDALONE", "EAGLE", "EAGLE3")
    }
    companions[("hicache_storage_backend", "file")] = {"hicache_storage_dir": "/pages"}
    for keyword, choices in ENGINE_CHOICES.items():
        for value in choices:
            EngineConfig.from_kwargs(
                "/m", **{keyword: value}, **companions.get((keyword, value), {})
            )


def test_standalone_speculation_needs_a_draft_model() -> None:
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        EngineConfig.from_kwargs("/m", speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="NGRAM drafts need no model"):
        EngineConfig.from_kwargs(
            "/m", speculative_algorithm="NGRAM", speculative_draft_model_path="/d"
        )
    config = EngineConfig.from_kwargs(
        "/m",
        speculative_algorithm="standalone",
        speculative_draft_model_path="/d",
        speculative_draft_model_quantization="int4",
    )
    assert config.speculative.algorithm == "STANDALONE"
    assert config.speculative.draft_model_quantization == "int4"


def test_unknown_argument_names_the_closest_known_one() -> None:
    with pytest.raises(TypeError, match="did you mean 'chunked_prefill_size'"):
        EngineConfig.from_kwargs("/m", chunked_prefil_size=8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule_policy": "sjf"}, "schedule_policy"),
        ({"grammar_backend": "guidance"}, "grammar_backend"),
        ({"max_constraint_bytes": 0}, "max_constraint_bytes"),
        ({"grammar_compile_timeout": 0}, "grammar_compile_timeout"),
        ({"radix_eviction_policy": "fifo"}, "eviction_policy"),
        ({"max_queued_requests": -1}, "max_queued_requests"),
    ],
)
def test_invalid_values_are_refused_with_the_field_name(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("/m", **kwargs)


def test_reply_is_a_bool_in_sync_code_and_awaitable_in_async_code() -> None:
    future: Future[bool] = Future()
    reply = Reply(future)
    future.set_result(True)
    assert reply and reply.result() is True and reply == True  # noqa: E712

    async def main() -> bool:
        pending: Future[bool] = Future()
        later = Reply(pending)
        asyncio.get_running_loop().call_later(0.01, pending.set_result, False)
        return await later

    assert asyncio.run(main()) is False
    assert asyncio.run(asyncio.wait_for(Reply.of(True), 1)) is True  # a coroutine for asyncio


def test_disaggregation_kwargs_land_in_their_section() -> None:
    config = EngineConfig.from_kwargs(
        "/m",
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=9000,
        disaggregation_transfer_backend="shm",
        disaggregation_transfer_timeout=5,
    )
    pd = config.disaggregation
    assert (pd.mode, pd.bootstrap_port, pd.transfer_backend, pd.transfer_timeout) == (
        "prefill",
        9000,
        "shm",
        5.0,
    )
    default = EngineConfig.from_kwargs("/m").disaggregation
    assert (default.mode, default.bootstrap_port, default.transfer_backend) == ("null", 8998, "tcp")
    assert default.transfer_timeout == 60 and not default.enabled


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"disaggregation_mode": "both"}, "disaggregation_mode must be one of null, prefill"),
        ({"disaggregation_transfer_backend": "rdma"}, "disaggregation_transfer_backend must"),
        ({"disaggregation_bootstrap_port": 70000}, "disaggregation_bootstrap_port"),
        ({"disaggregation_transfer_timeout": 0}, "disaggregation_transfer_timeout"),
        (
            {"disaggregation_mode": "decode", "speculative_algorithm": "NGRAM"},
            "does not cover speculative decoding",
        ),
        ({"disaggregation_mode": "prefill", "tp_size": 2}, "tensor parallelism"),
        ({"disaggregation_mode": "prefill", "is_embedding": True}, "for generation"),
    ],
)
def test_disaggregation_refuses_what_it_does_not_cover(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("/m", **kwargs)
