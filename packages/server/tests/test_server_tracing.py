"""OpenTelemetry tracing: a root span per HTTP request (continuing an incoming traceparent)
with the queue / prefill / decode / detokenize spans of each engine request, made from the
timestamps of its final chunk; tracing off needs nothing of the `tracing` extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import server_fake_engine as fake  # loaded by conftest.py
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from radixlm.server import ServerConfig, create_app
from radixlm.server.tracing import otlp_endpoint_url

PHASES = ["queue", "prefill", "decode", "detokenize"]


@pytest.fixture
def traced(make_server: Callable[..., Any]) -> Iterator[tuple[httpx.Client, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = ServerConfig(served_model_name="toy")
    live, _ = make_server(config, tracer_provider=provider, token_delay=0.002)
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client, exporter


def _root(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    """The root span `name`, once it has ended (just after the response was sent)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for span in exporter.get_finished_spans():
            if span.name == name:
                return span
        time.sleep(0.01)
    raise AssertionError(f"no span {name!r}: {[s.name for s in exporter.get_finished_spans()]}")


def _children(exporter: InMemorySpanExporter, root: ReadableSpan) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == root.context.span_id
    ]


def test_a_generate_request_is_a_root_span_with_its_phases_in_order(
    traced: tuple[httpx.Client, InMemorySpanExporter],
) -> None:
    http, exporter = traced
    body = {"text": "Hello", "rid": "trace-me", "sampling_params": {"max_new_tokens": 5}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200
    meta = response.json()["meta_info"]
    root = _root(exporter, "POST /generate")
    assert root.kind is SpanKind.SERVER and root.parent is None
    attributes = dict(root.attributes or {})
    assert attributes["http.route"] == "/generate"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.request.id"] == "trace-me"
    assert attributes["gen_ai.usage.input_tokens"] == meta["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == meta["completion_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    children = sorted(_children(exporter, root), key=lambda s: s.start_time or 0)
    assert [s.name for s in children] == PHASES
    assert all(s.context.trace_id == root.context.trace_id for s in children)
    assert all((s.attributes or {})["gen_ai.request.id"] == "trace-me" for s in children)
    # Back to back, inside the root span, each as long as the engine's timestamps say.
    edges = [root.start_time]
    for span in children:
        assert span.start_time is not None and span.end_time is not None
        assert span.start_time >= edges[-1]
        edges.append(span.end_time)
    assert root.end_time is not None and edges[-1] <= root.end_time
    stamps = meta["timestamps"]
    decode = children[2]
    assert decode.start_time == int(stamps["first_token"] * 1e9)
    assert decode.end_time == int(stamps["last_token"] * 1e9)
    assert decode.end_time > decode.start_time  # 5 tokens, 2 ms apart


def test_a_streamed_chat_gets_its_phases_too(
    traced: tuple[httpx.Client, InMemorySpanExporter],
) -> None:
    http, exporter = traced
    body = {"model": "toy", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert any("[DONE]" in line for line in response.iter_lines())
    root = _root(exporter, "POST /v1/chat/completions")
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["gen_ai.usage.output_tokens"] > 0
    assert sorted(s.name for s in _children(exporter, root)) == sorted(PHASES)


def test_an_incoming_traceparent_is_continued(
    traced: tuple[httpx.Client, InMemorySpanExporter],
) -> None:
    http, exporter = traced
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    response = http.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert response.status_code == 200
    root = _root(exporter, "POST /generate")
    assert root.context.trace_id == int(trace_id, 16)
    assert root.parent is not None and root.parent.span_id == int(parent_id, 16)
    assert root.parent.is_remote
    assert len(_children(exporter, root)) == 4


def test_a_refused_request_is_a_root_span_without_phases(
    traced: tuple[httpx.Client, InMemorySpanExporter],
) -> None:
    http, exporter = traced
    response = http.post("/generate", json={"text": "Hi", "sampling_params": {"top_p": 7}})
    assert response.status_code == 400
    root = _root(exporter, "POST /generate")
    assert (root.attributes or {})["http.response.status_code"] == 400
    assert root.status.status_code is not StatusCode.ERROR  # the client's error, not ours
    assert _children(exporter, root) == []


def test_probes_are_not_traced(traced: tuple[httpx.Client, InMemorySpanExporter]) -> None:
    http, exporter = traced
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").status_code == 200
    root = _root(exporter, "GET /v1/models")
    assert [s.name for s in exporter.get_finished_spans()] == [root.name]


# Tracing off where the `tracing` extra is not installed (the OpenTelemetry SDK and exporter
# fail to import; recent FastAPI releases need the API themselves): a server answering
# /generate, then what the app holds; and tracing asked for there.
_UNTRACED = """
import asyncio, json, sys

class NoOpenTelemetrySdk:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ImportError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoOpenTelemetrySdk())
import httpx
from radixlm.sampling import FinishReason, GenerateChunk
from radixlm.server import ServerConfig, create_app

class Engine:
    tokenizer = None
    async def generate(self, request):
        yield GenerateChunk(str(request.rid), 0, "hi", (1,), 1, 1,
                            finish_reason=FinishReason("length"))
    async def abort(self, rid): return False
    async def flush_cache(self): return True
    def model_info(self): return {"model_path": "m"}
    def server_info(self): return {}

async def main():
    app = create_app(Engine(), ServerConfig(log_requests=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post("/generate", json={"text": "x"})
    tracing = "radixlm.server.tracing" in sys.modules
    try:
        create_app(Engine(), ServerConfig(otlp_traces_endpoint="localhost:4318"))
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    print(json.dumps([response.status_code, app.state.radixlm.tracer is None, tracing, refusal]))

asyncio.run(main())
"""


def test_tracing_off_needs_no_tracing_extra_and_asking_for_it_names_the_extra() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _UNTRACED], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    status, untraced, imported, refusal = json.loads(done.stdout.strip().splitlines()[-1])
    assert status == 200 and untraced and not imported
    assert "pip install 'radixlm-server[tracing]'" in refusal


def test_an_endpoint_in_the_config_turns_tracing_on_with_an_otlp_exporter(tokenizer: Any) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    config = ServerConfig(otlp_traces_endpoint="localhost:4318")
    app = create_app(fake.FakeEngine(tokenizer), config)
    tracer = app.state.radixlm.tracer
    assert tracer is not None
    processor = tracer.provider._active_span_processor._span_processors[0]
    exporter = processor._batch_processor._exporter
    assert isinstance(exporter, OTLPSpanExporter)
    assert exporter._endpoint == "http://localhost:4318/v1/traces"
    tracer.provider.shutdown()


def test_endpoint_urls_get_a_scheme_and_the_traces_path_when_they_lack_them() -> None:
    assert otlp_endpoint_url("collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_endpoint_url("https://c.example/") == "https://c.example/v1/traces"
    assert otlp_endpoint_url("http://c:4318/custom") == "http://c:4318/custom"
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerConfig(otlp_traces_endpoint=" ")
