"""radixlm on Ray Serve (a local Ray instance, `ray.init(num_cpus=2)`): two engine replicas of
the tiny model routed by radixlm's policies through Ray Serve's request-router API, behind the
same HTTP routes as `radixlm serve`; and prefill/decode disaggregation on it (a prefill and a
decode replica, `build_pd_app`) against one colocated engine.

Heavy (Ray starts in ~20 s) and needs the `ray` extra, which the dev venv leaves out: it skips
without Ray. Run it with `pip install -e "packages/router[ray]"` first."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dp_workload import shared_prefix_prompts

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'radixlm-router[ray]'")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.timeout(600)

ENGINE = {"show_progress": False, "max_total_tokens": 8192, "device": "cpu", "cpu_threads": 1}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray instance with Serve's HTTP proxy on a free port; its URL."""
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _deploy(model: Path, policy: str) -> None:
    from radixlm.router.ray import build_app
    from radixlm.runtime import Engine
    from radixlm.server import ServerConfig, create_app

    app = build_app(
        str(model),
        Engine,
        functools.partial(create_app, config=ServerConfig(served_model_name="tiny")),
        ENGINE,
        num_replicas=2,
        ray_actor_options={"num_cpus": 0.5},
        policy=policy,
    )
    serve.run(app, name="radixlm", route_prefix="/")


def _cached_over_http(url: str) -> int:
    total = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        for text in shared_prefix_prompts():
            answer = http.post(
                "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}}
            )
            assert answer.status_code == 200, answer.text
            total += answer.json()["meta_info"]["cached_tokens"]
    return total


def _single_replica_cached(model: Path) -> int:
    from radixlm.runtime import Engine

    with Engine(str(model), **ENGINE) as engine:
        params = {"max_new_tokens": 2}
        return sum(
            engine.generate(t, params)["meta_info"]["cached_tokens"]
            for t in shared_prefix_prompts()
        )


def test_cache_aware_on_ray_reuses_nearly_what_one_replica_would(
    cluster: str, tiny_llama: Path
) -> None:
    single = _single_replica_cached(tiny_llama)
    _deploy(tiny_llama, "cache_aware")
    cache_aware = _cached_over_http(cluster)
    _deploy(tiny_llama, "round_robin")  # replaces the application: fresh replicas
    round_robin = _cached_over_http(cluster)
    print(
        f"cached tokens: one replica {single}, cache_aware {cache_aware}, round_robin {round_robin}"
    )
    assert single > 0
    assert cache_aware >= 0.9 * single, (cache_aware, single)
    assert round_robin < 0.95 * cache_aware, (round_robin, cache_aware)


def test_the_routes_are_radixlm_serves(cluster: str, tiny_llama: Path) -> None:
    _deploy(tiny_llama, "cache_aware")
    with httpx.Client(base_url=cluster, timeout=120) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        assert (
            chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
        )
        lines = []
        body = {"text": "stream", "stream": True, "sampling_params": {"max_new_tokens": 4}}
        with http.stream("POST", "/generate", json=body) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        # Chunks may be coalesced when the reader lags: the last one holds all four ids.
        assert lines[-1] == "data: [DONE]" and 3 <= len(lines) <= 5, lines
        final = json.loads(lines[-2].removeprefix("data: "))
        assert len(final["output_ids"]) == 4 and final["meta_info"]["finish_reason"] is not None
        bad = http.post(
            "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 10**7}}
        )
        assert (
            bad.status_code == 400
            and bad.json()["error"]["param"] == "sampling_params.max_new_tokens"
        )
        assert http.get("/health").status_code == 200
        assert http.get("/get_server_info").json()["ray_serve"] is True


def _engine_replica_pids(calls: int = 12) -> set[int]:
    """The engine replicas' processes, asked through a handle (round robin: each in turn)."""
    handle = serve.get_deployment_handle("radixlm-engine", app_name="radixlm")
    pids = set()
    for _ in range(calls):
        try:
            pids.add(handle.pid.remote().result(timeout_s=30))
        except Exception:  # a dead replica Ray has not taken out yet
            continue
    return pids


def test_a_killed_replica_leaves_the_other_serving(cluster: str, tiny_llama: Path) -> None:
    _deploy(tiny_llama, "round_robin")
    pids = _engine_replica_pids()
    assert len(pids) == 2, pids
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    with httpx.Client(base_url=cluster, timeout=120) as http:
        for i in range(8):  # every request sent after the kill completes
            answer = http.post(
                "/generate", json={"text": f"after {i}", "sampling_params": {"max_new_tokens": 3}}
            )
            assert answer.status_code == 200, answer.text
    # Ray Serve restarts the dead replica.
    deadline = time.monotonic() + 120
    while len(_engine_replica_pids() - {victim}) < 2:
        assert time.monotonic() < deadline, "Ray Serve did not restart the replica"
        time.sleep(1)


# ------------------------------------------------------- prefill/decode disaggregation


def _deploy_pd(model: Path) -> None:
    from radixlm.router.ray import build_pd_app
    from radixlm.runtime import Engine
    from radixlm.server import ServerConfig, create_app

    app = build_pd_app(
        str(model),
        Engine,
        functools.partial(create_app, config=ServerConfig(served_model_name="tiny")),
        ENGINE,
        num_prefill_replicas=1,
        num_decode_replicas=1,
        ray_actor_options={"num_cpus": 0.5},
        transfer_backend="tcp",
    )
    serve.run(app, name="radixlm", route_prefix="/")


PD_PROMPTS = ["The capital of France is", "one two three four", "a b c d e f g"]


def test_pd_on_ray_answers_as_one_colocated_engine(cluster: str, tiny_llama: Path) -> None:
    from radixlm.runtime import Engine

    params = {"max_new_tokens": 6, "temperature": 0}
    with Engine(str(tiny_llama), **ENGINE) as engine:
        expected = [
            engine.generate(t, params, return_logprob=True, top_logprobs_num=2) for t in PD_PROMPTS
        ]
    _deploy_pd(tiny_llama)
    with httpx.Client(base_url=cluster, timeout=120) as http:
        for text, want in zip(PD_PROMPTS, expected, strict=True):
            body = {
                "text": text,
                "sampling_params": params,
                "return_logprob": True,
                "top_logprobs_num": 2,
            }
            answer = http.post("/generate", json=body)
            assert answer.status_code == 200, answer.text
            got = answer.json()
            assert got["output_ids"] == want["output_ids"]
            got_lp = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
            want_lp = [e[0] for e in want["meta_info"]["output_token_logprobs"]]
            assert got_lp == pytest.approx(want_lp, abs=1e-5)
        # A batch: one room per prompt, each answer its prompt's.
        batch = http.post("/generate", json={"text": PD_PROMPTS, "sampling_params": params})
        assert batch.status_code == 200, batch.text
        assert [a["output_ids"] for a in batch.json()] == [w["output_ids"] for w in expected]
        # Streamed, and over the OpenAI routes.
        body = {"text": PD_PROMPTS[0], "stream": True, "sampling_params": params}
        with http.stream("POST", "/generate", json=body) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines
        final = json.loads(lines[-2].removeprefix("data: "))  # cumulative ids, as colocated
        assert final["output_ids"] == expected[0]["output_ids"]
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"


def test_pd_on_ray_refuses_what_disaggregation_does_not_cover(
    cluster: str, tiny_llama: Path
) -> None:
    _deploy_pd(tiny_llama)
    with httpx.Client(base_url=cluster, timeout=60) as http:
        started = time.monotonic()
        answer = http.post(
            "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "n": 2}}
        )
        assert answer.status_code == 400, answer.text
        assert "n" in answer.json()["error"]["param"], answer.json()
        # Refused at once, not after the other half's transfer timeout.
        assert time.monotonic() - started < 30
        ok = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200, ok.text


def _pd_replica_pid(deployment: str) -> int:
    handle = serve.get_deployment_handle(deployment, app_name="radixlm")
    return int(handle.pid.remote().result(timeout_s=30))


def test_pd_on_ray_a_killed_decode_replica_ends_its_stream_clearly(
    cluster: str, tiny_llama: Path
) -> None:
    _deploy_pd(tiny_llama)
    victim = _pd_replica_pid("radixlm-decode")
    body = {
        "text": "long",
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }
    lines: list[str] = []
    with (
        httpx.Client(base_url=cluster, timeout=120) as http,
        http.stream("POST", "/generate", json=body) as stream,
    ):
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if len(lines) == 3:
                os.kill(victim, signal.SIGKILL)
    # The stream ended (no hang) with an error event naming the dead replica before [DONE].
    assert len(lines) < 100, len(lines)
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_unavailable", error
    assert "decode replica" in error["message"] and "died" in error["message"], error
