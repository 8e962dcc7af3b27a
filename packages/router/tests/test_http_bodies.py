"""What the HTTP router reads from bodies and writes into them, and its configuration, without
a server: routing keys per route, the PD bootstrap fields, errors inside a worker's answer,
the worker pools' health bookkeeping, the command line."""

from __future__ import annotations

import json

import pytest

from radixlm.router.bodies import answer_error, error_status, request_ids, with_bootstrap
from radixlm.router.cli import build_parser, config_from_args, parse_prefill
from radixlm.router.keys import body_key, chat_text, text_key
from radixlm.router.workers import (
    HealthConfig,
    NoWorkerAvailable,
    RouterConfig,
    WorkerPool,
    WorkerSpec,
)

PREFILL = WorkerSpec("http://10.0.0.7:30000/", "prefill", 8998)


def test_generate_and_completion_bodies_are_keyed_by_their_prompt() -> None:
    assert body_key("/generate", {"text": "héllo"}) == (text_key("héllo"), None)
    assert body_key("/generate", {"input_ids": [5, 6]}) == ([5, 6], ("ids", None))
    assert body_key("/generate", {"text": ["first", "second"]}).key == text_key("first")
    assert body_key("/generate", {"input_ids": [[1, 2], [3]]}).key == [1, 2]
    assert body_key("/v1/completions", {"prompt": "abc"}).key == text_key("abc")
    assert body_key("/v1/completions", {"prompt": [7, 8]}).key == [7, 8]
    adapter = body_key("/generate", {"text": "abc", "lora_path": "sql"})
    assert adapter.namespace == "sql"
    assert body_key("/generate", {"input_embeds": [[0.1]]}) == ([], None)
    assert body_key("/generate", [1]) == ([], None)


def test_a_chat_that_extends_another_has_its_key_as_a_prefix() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    a = body_key("/v1/chat/completions", {"messages": first}).key
    b = body_key("/v1/chat/completions", {"messages": second}).key
    assert b[: len(a)] == a and len(b) > len(a)


def test_chat_text_is_stable_over_content_shapes_and_key_order() -> None:
    parts = [{"type": "text", "text": "look: "}, {"image_url": {"url": "u"}, "type": "image_url"}]
    same = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "u"}}]
    assert chat_text([{"role": "user", "content": parts}]) == chat_text(
        [{"content": same, "role": "user"}]
    )
    assert chat_text([{"role": "user", "content": "plain"}]) == "<|user|>\nplain\n"
    calls = chat_text([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    assert calls == '<|assistant|>\n{"tool_calls": [{"id": "1"}]}\n'


def test_bootstrap_fields_name_the_prefill_worker_and_a_fresh_room() -> None:
    body = {"text": "x", "stream": True}
    out = with_bootstrap("/generate", body, PREFILL)
    assert body == {"text": "x", "stream": True}  # the caller's dict is left alone
    assert out["bootstrap_host"] == "10.0.0.7" and out["bootstrap_port"] == 8998
    assert 0 <= out["bootstrap_room"] < 2**63 and isinstance(out["rid"], str)
    again = with_bootstrap("/generate", {"text": "x", "rid": "mine"}, PREFILL)
    assert again["rid"] == "mine" and again["bootstrap_room"] != out["bootstrap_room"]
    chat = with_bootstrap("/v1/chat/completions", {"messages": []}, PREFILL, rooms=[42])
    assert chat["bootstrap_room"] == 42


def test_a_batch_gets_one_room_and_rid_per_prompt() -> None:
    out = with_bootstrap("/generate", {"text": ["a", "b", "c"]}, PREFILL, rooms=[1, 2, 3])
    assert out["bootstrap_host"] == ["10.0.0.7"] * 3 and out["bootstrap_port"] == [8998] * 3
    assert out["bootstrap_room"] == [1, 2, 3] and len(set(out["rid"])) == 3
    assert request_ids(out) == out["rid"]
    with pytest.raises(ValueError, match="one bootstrap room per prompt"):
        with_bootstrap("/generate", {"input_ids": [[1], [2]]}, PREFILL, rooms=[1])
    with pytest.raises(ValueError, match="not a prefill worker"):
        with_bootstrap("/generate", {"text": "x"}, WorkerSpec("http://h:1"))


def test_errors_inside_a_200_answer_are_found() -> None:
    error = {"message": "out of memory", "type": "server_error", "code": 503}
    assert answer_error(json.dumps({"error": error}).encode()) == error
    stream = b'data: {"text": "a"}\n\ndata: ' + json.dumps({"error": error}).encode()
    assert answer_error(stream + b"\n\ndata: [DONE]\n\n") == error
    assert answer_error(b'data: {"text": "a"}\n\ndata: [DONE]\n\n') is None
    assert answer_error(b'{"text": "fine", "meta_info": {}}') is None
    assert answer_error(b'[{"text": "a batch"}]') is None
    assert answer_error(b'{"error": "plain words"}') == {"message": "plain words"}
    assert error_status(error) == 503 and error_status({"code": "busy"}) == 500


def test_worker_urls_are_checked_and_normalised() -> None:
    assert WorkerSpec("http://h:30000/").url == "http://h:30000"
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        WorkerSpec("h:30000")
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerSpec("http://h:1", "mixed")


def test_configs_refuse_what_cannot_route() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        RouterConfig(())
    with pytest.raises(ValueError, match="give --decode"):
        RouterConfig((PREFILL,))
    with pytest.raises(ValueError, match="not both"):
        RouterConfig((PREFILL, WorkerSpec("http://a:1")))
    with pytest.raises(ValueError, match="came twice"):
        RouterConfig.regular(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="policy must be one of"):
        RouterConfig.regular(["http://a:1"], policy="fastest")
    pd = RouterConfig.pd([("http://p:1", None)], ["http://d:1"])
    assert pd.disaggregated and pd.workers[0].bootstrap_port == 8998
    pools = pd.pools()
    assert {role: pool.policy for role, pool in pools.items()} == {
        "prefill": "cache_aware",
        "decode": "shortest_queue",
    }


def test_a_pool_routes_only_to_workers_its_checks_let_in() -> None:
    health = HealthConfig(interval_s=10, failure_threshold=2, success_threshold=2)
    pool = WorkerPool(
        "decode", [WorkerSpec("http://a:1"), WorkerSpec("http://b:1")], "random", health
    )
    with pytest.raises(NoWorkerAvailable, match="no decode worker is serving"):
        pool.choose([1])
    assert pool.due(now=0.0) == ["http://a:1", "http://b:1"]
    pool.record_check("http://a:1", True, now=0.0)  # a new worker: in at its first success
    assert pool.choose([1]).url == "http://a:1"
    assert pool.due(now=0.5) == ["http://b:1"]  # b is down: checked every second
    assert pool.due(now=1.0) == ["http://b:1"] and "http://a:1" in pool.due(now=10.0)
    pool.record_check("http://a:1", False, now=1.0)
    assert pool.healthy("http://a:1")  # one failure is not enough
    pool.record_check("http://a:1", False, now=2.0)
    assert not pool.healthy("http://a:1")
    pool.record_check("http://a:1", True, now=3.0)
    assert not pool.healthy("http://a:1")  # coming back takes two
    pool.record_check("http://a:1", True, now=4.0)
    assert pool.healthy("http://a:1")
    pool.mark_unreachable("http://a:1")  # a refused connection: out at once
    assert not pool.healthy("http://a:1")


def test_the_command_line_builds_both_modes() -> None:
    parser = build_parser()
    regular = config_from_args(
        parser.parse_args(["--worker-urls", "http://a:1", "http://b:1", "--policy", "round_robin"])
    )
    assert [w.url for w in regular.workers] == ["http://a:1", "http://b:1"]
    assert regular.policy == "round_robin" and not regular.disaggregated
    argv = ["--pd-disaggregation", "--prefill", "http://p:1", "9001", "--prefill", "http://q:1"]
    argv += ["--decode", "http://d:1", "--decode", "http://e:1", "--cache-threshold", "0.5"]
    pd = config_from_args(parser.parse_args(argv))
    assert [(w.url, w.role, w.bootstrap_port) for w in pd.workers] == [
        ("http://p:1", "prefill", 9001),
        ("http://q:1", "prefill", 8998),
        ("http://d:1", "decode", None),
        ("http://e:1", "decode", None),
    ]
    assert pd.cache_aware.cache_threshold == 0.5 and pd.decode_policy == "shortest_queue"


def test_the_command_line_says_what_is_missing() -> None:
    parser = build_parser()
    for argv, message in [
        ([], "give --worker-urls"),
        (["--decode", "http://d:1"], "need --pd-disaggregation"),
        (["--pd-disaggregation", "--decode", "http://d:1"], "give --prefill"),
        (["--pd-disaggregation", "--worker-urls", "http://a:1"], "not --worker-urls"),
    ]:
        with pytest.raises(ValueError, match=message):
            config_from_args(parser.parse_args(argv))
    with pytest.raises(ValueError, match="must be a number"):
        parse_prefill(["http://p:1", "port"])
    with pytest.raises(ValueError, match="optional bootstrap port"):
        parse_prefill(["http://p:1", "1", "2"])
