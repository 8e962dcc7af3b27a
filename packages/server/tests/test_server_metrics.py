"""/metrics under SGLang's names (the default) or vLLM's (`--metrics-format vllm`): the names,
their labels, and the values after requests; first-token and inter-token times from streamed
requests only; a disaggregated engine's queues as SGLang's gauges."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import server_fake_engine as fake  # loaded by conftest.py
from prometheus_client.parser import text_string_to_metric_families

from radixlm.sampling import FinishReason, GenerateChunk, GenerateRequest
from radixlm.server import ServerConfig
from radixlm.server.cli import build_parser, server_config
from radixlm.server.metrics import (
    SGLANG_ITL_BUCKETS,
    SGLANG_TTFT_BUCKETS,
    VLLM_ITL_BUCKETS,
    ServerMetrics,
    one_two_five_buckets,
)

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """/metrics as {sample name: {sorted labels: value}}."""
    text = httpx.get(f"{url}/metrics").text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    matches = [v for k, v in samples[name].items() if set(labels.items()) <= set(k)]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return float(matches[0])


def generate(url: str, stream: bool = False) -> None:
    body = {"text": "count me", "sampling_params": GREEDY, "stream": stream}
    assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 200


@pytest.fixture
def started(make_server: Any) -> Callable[..., str]:
    def start(**config: Any) -> str:
        live, _ = make_server(ServerConfig(served_model_name="toy", enable_metrics=True, **config))
        return str(live.url)

    return start


def test_sglang_names_are_the_default_with_model_name_labels(started: Callable[..., str]) -> None:
    url = started()
    generate(url)
    samples = scrape(url)
    toy = {"model_name": "toy"}
    assert value(samples, "sglang:num_requests_total", **toy) == 1
    assert value(samples, "sglang:generation_tokens_total", **toy) == 4
    prompt = value(samples, "sglang:prompt_tokens_total", **toy)
    assert prompt > 0
    assert value(samples, "sglang:cached_tokens_total", **toy) == prompt // 2  # the fake's
    assert value(samples, "sglang:e2e_request_latency_seconds_count", **toy) == 1
    engine = {**toy, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
    assert value(samples, "sglang:num_running_reqs", **engine) == 0
    assert value(samples, "sglang:num_queue_reqs", **engine) == 0
    assert value(samples, "sglang:cache_hit_rate", **engine) == 0.25
    assert value(samples, "sglang:token_usage", **engine) == 0
    assert value(samples, "sglang:max_total_num_tokens", **engine) == 4096
    assert value(samples, "sglang:num_used_tokens", **engine) == 0
    assert "sglang:gen_throughput" in samples
    assert not [name for name in samples if name.startswith("vllm:")]
    assert not [name for name in samples if "_prealloc_" in name or "_transfer_queue" in name]


#: A disaggregated engine's queues (SGLang's names), as its server_info reports them.
PD_QUEUES = {
    "num_prefill_prealloc_queue_reqs": 1,
    "num_prefill_inflight_queue_reqs": 2,
    "num_decode_prealloc_queue_reqs": 3,
    "num_decode_transfer_queue_reqs": 4,
}


def test_a_disaggregated_engines_queues_are_sglang_gauges(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reported = fake.FakeEngine.server_info
    monkeypatch.setattr(
        fake.FakeEngine, "server_info", lambda self: {**reported(self), **PD_QUEUES}
    )
    live, _ = make_server(ServerConfig(served_model_name="toy", enable_metrics=True))
    samples = scrape(live.url)
    labels = {"model_name": "toy", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
    for key, count in PD_QUEUES.items():
        assert value(samples, f"sglang:{key}", **labels) == count


def test_radixlm_names_that_duplicate_sglangs_are_gone(started: Callable[..., str]) -> None:
    url = started()
    generate(url)
    samples = scrape(url)
    assert value(samples, "radixlm_requests_total", route="/generate", finish_reason="length") == 1
    assert "radixlm_http_requests_in_flight" in samples
    for gone in ("radixlm_generation_tokens_total", "radixlm_num_running_requests",
                 "radixlm_e2e_request_latency_seconds_count", "radixlm_cache_hit_rate"):  # fmt: skip
        assert gone not in samples


def test_a_streamed_request_records_first_token_and_inter_token_times(
    started: Callable[..., str],
) -> None:
    url = started()
    generate(url, stream=True)
    samples = scrape(url)
    assert value(samples, "sglang:time_to_first_token_seconds_count") == 1
    # Four tokens: three gaps after the first, each token observed once.
    assert value(samples, "sglang:inter_token_latency_seconds_count") == 3
    assert value(samples, "sglang:time_per_output_token_seconds_count") == 1
    assert value(samples, "sglang:e2e_request_latency_seconds_count") == 1


def test_a_request_not_streamed_records_no_token_times(started: Callable[..., str]) -> None:
    url = started()
    generate(url, stream=False)
    samples = scrape(url)
    assert value(samples, "sglang:time_to_first_token_seconds_count") == 0
    assert value(samples, "sglang:inter_token_latency_seconds_count") == 0
    assert value(samples, "sglang:e2e_request_latency_seconds_count") == 1


def test_sglang_histograms_use_sglangs_buckets(started: Callable[..., str]) -> None:
    samples = scrape(started())
    ttft = {float(dict(k)["le"]) for k in samples["sglang:time_to_first_token_seconds_bucket"]}
    itl = {float(dict(k)["le"]) for k in samples["sglang:inter_token_latency_seconds_bucket"]}
    assert ttft == {*map(float, SGLANG_TTFT_BUCKETS), float("inf")}
    assert itl == {*map(float, SGLANG_ITL_BUCKETS), float("inf")}


def test_vllm_format_exports_vllms_names_instead(started: Callable[..., str]) -> None:
    url = started(metrics_format="vllm")
    generate(url, stream=True)
    generate(url)
    samples = scrape(url)
    labels = {"model_name": "toy", "engine": "0"}
    assert value(samples, "vllm:request_success_total", finished_reason="length", **labels) == 2
    assert value(samples, "vllm:request_success_total", finished_reason="stop", **labels) == 0
    assert value(samples, "vllm:generation_tokens_total", **labels) == 8
    prompts = value(samples, "vllm:prompt_tokens_total", **labels)  # two equal prompts
    assert value(samples, "vllm:prefix_cache_queries_total", **labels) == prompts
    assert value(samples, "vllm:prefix_cache_hits_total", **labels) == 2 * (prompts // 2 // 2)
    assert value(samples, "vllm:num_requests_running", **labels) == 0
    assert value(samples, "vllm:num_requests_waiting", **labels) == 0
    assert value(samples, "vllm:kv_cache_usage_perc", **labels) == 0
    assert value(samples, "vllm:e2e_request_latency_seconds_count", **labels) == 2
    assert value(samples, "vllm:time_to_first_token_seconds_count", **labels) == 1
    # vLLM observes one interval per step that gave tokens: three after the first.
    assert value(samples, "vllm:inter_token_latency_seconds_count", **labels) == 3
    assert value(samples, "vllm:request_time_per_output_token_seconds_count", **labels) == 1
    assert value(samples, "vllm:request_params_n_count", **labels) == 2
    assert value(samples, "vllm:request_generation_tokens_sum", **labels) == 8
    assert not [name for name in samples if name.startswith("sglang:")]


def test_vllm_histograms_use_vllms_buckets(started: Callable[..., str]) -> None:
    samples = scrape(started(metrics_format="vllm"))
    itl = {float(dict(k)["le"]) for k in samples["vllm:inter_token_latency_seconds_bucket"]}
    assert itl == {*map(float, VLLM_ITL_BUCKETS), float("inf")}


def test_both_formats_export_both_names(started: Callable[..., str]) -> None:
    url = started(metrics_format="both")
    generate(url)
    samples = scrape(url)
    assert value(samples, "sglang:num_requests_total") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1


def test_a_client_that_leaves_counts_as_aborted() -> None:
    metrics = ServerMetrics(lambda: {}, lambda: 0, "m", "both")
    metrics.record_unfinished("/generate", "disconnected")
    text = metrics.render().decode()
    assert 'sglang:num_aborted_requests_total{model_name="m"} 1.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 1.0' in (
        text
    )
    assert 'radixlm_requests_total{finish_reason="disconnected",route="/generate"} 1.0' in text


def chunk(count: int, finished: bool = False, index: int = 0) -> GenerateChunk:
    return GenerateChunk(
        rid="r", index=index, text="", output_ids=tuple(range(count)), prompt_tokens=3,
        completion_tokens=count, finish_reason=FinishReason("length") if finished else None,
    )  # fmt: skip


def test_inter_token_latency_spreads_a_chunks_interval_over_its_tokens_for_sglang() -> None:
    metrics = ServerMetrics(lambda: {}, lambda: 0, "m", "both")
    request = GenerateRequest.parse({"text": "x", "stream": True})
    timer = metrics.track(request, arrival=10.0)
    timer.chunk(chunk(1), now=10.5)  # first token after 0.5 s
    timer.chunk(chunk(1), now=10.6)  # nothing new: no observation
    timer.chunk(chunk(3), now=10.7)  # two tokens in 0.2 s
    timer.chunk(chunk(4, finished=True), now=10.8)
    text = metrics.render().decode()
    assert 'sglang:time_to_first_token_seconds_sum{model_name="m"} 0.5' in text
    assert 'sglang:inter_token_latency_seconds_count{model_name="m"} 3.0' in text
    assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 2.0' in text
    # (10.8 - 10.5) over the three tokens after the first.
    tpot = next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "sglang:time_per_output_token_seconds_sum"
    )
    assert tpot == pytest.approx(0.1)


def test_a_structured_output_request_is_counted_when_it_finishes() -> None:
    metrics = ServerMetrics(lambda: {}, lambda: 0, "m")
    request = GenerateRequest.parse({"text": "x", "sampling_params": {"regex": "a+"}})
    timer = metrics.track(request, arrival=0.0)
    timer.chunk(chunk(2, finished=True), now=1.0)
    assert 'sglang:num_so_requests_total{model_name="m"} 1.0' in metrics.render().decode()


def test_generation_throughput_is_the_engines_token_rate_between_scrapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("radixlm.server.metrics.time.monotonic", lambda: clock[0])
    info = {"generated_tokens": 1000}
    metrics = ServerMetrics(lambda: info, lambda: 0, "m")
    assert "sglang:gen_throughput" in metrics.render().decode()  # the first sample: 0
    clock[0], info["generated_tokens"] = 102.0, 1300
    assert 'sglang:gen_throughput{engine_type="unified",model_name="m",pp_rank="0",' in (
        text := metrics.render().decode()
    )
    assert 'tp_rank="0"} 150.0' in text


def test_engine_gauges_are_left_out_when_the_engine_does_not_report_them() -> None:
    text = ServerMetrics(lambda: {}, lambda: 0, "m").render().decode()
    assert "sglang:num_running_reqs" not in text and "sglang:gen_throughput" not in text
    assert "radixlm_http_requests_in_flight 0.0" in text


def test_vllm_token_buckets_go_one_two_five_up_to_the_context() -> None:
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_an_unknown_metrics_format_names_the_choices() -> None:
    with pytest.raises(ValueError, match="sglang, vllm, both"):
        ServerConfig(metrics_format="prometheus")


def test_the_metrics_flags_reach_the_server_config() -> None:
    config = server_config(build_parser().parse_args(["--metrics-format", "vllm"]))
    assert config.metrics_format == "vllm" and not config.enable_cache_report
    default = server_config(build_parser().parse_args(["--enable-cache-report"]))
    assert default.metrics_format == "sglang" and default.enable_cache_report


def test_queue_prefill_and_decode_times_come_from_the_engines_timestamps() -> None:
    metrics = ServerMetrics(lambda: {}, lambda: 0, "m", "both")
    stamps = {"arrival": 100.0, "scheduled": 100.25, "first_token": 100.75, "last_token": 102.0}
    metrics.record_phases(stamps)
    metrics.record_phases({**stamps, "scheduled": None})  # never left the queue: not observed
    metrics.record_phases(None)  # an engine without timestamps
    samples: dict[str, float] = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
        if s.name.endswith(("_sum", "_count"))
    }
    assert samples["sglang:queue_time_seconds_count"] == 1
    assert samples["sglang:queue_time_seconds_sum"] == pytest.approx(0.25)
    assert samples["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.25)
    assert samples["vllm:request_prefill_time_seconds_sum"] == pytest.approx(0.5)
    assert samples["vllm:request_decode_time_seconds_sum"] == pytest.approx(1.25)
    assert samples["vllm:request_inference_time_seconds_sum"] == pytest.approx(1.75)
