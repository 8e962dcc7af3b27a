"""docs/grafana/radixlm-dashboard.json imports into Grafana (its data source an input) and
every metric its queries name is one the server exports after requests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixlm.server import ServerConfig

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "radixlm-dashboard.json"
METRIC = re.compile(r"\b(?:sglang|vllm):[A-Za-z0-9_:]+|\bradixlm_[A-Za-z0-9_]+")

pytestmark = pytest.mark.skipif(
    not DASHBOARD.is_file(), reason="the docs are not here (the package is tested on its own)"
)


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text(encoding="utf-8")))


def queries(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_dashboard_takes_its_prometheus_data_source_as_an_input() -> None:
    board = dashboard()
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    assert board["__inputs"][0]["pluginId"] == "prometheus"
    assert board["title"] and board["uid"] and board["panels"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])


def test_the_dashboard_shows_the_documented_panels() -> None:
    text = " ".join(queries(dashboard()))
    for wanted in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                   "sglang:cache_hit_rate", "rate(sglang:generation_tokens_total",
                   "histogram_quantile(0.99, sum by (le, model_name) "
                   "(rate(sglang:time_to_first_token_seconds_bucket",
                   "(rate(sglang:inter_token_latency_seconds_bucket",
                   "(rate(sglang:e2e_request_latency_seconds_bucket"):  # fmt: skip
        assert wanted in text


def test_every_metric_the_dashboard_queries_is_exported(make_server: Any) -> None:
    live, _ = make_server(ServerConfig(served_model_name="toy", enable_metrics=True))
    body = {"text": "dashboard", "sampling_params": {"max_new_tokens": 3}}
    for stream in (False, True):
        reply = httpx.post(f"{live.url}/generate", json={**body, "stream": stream}, timeout=30)
        assert reply.status_code == 200
    text = httpx.get(f"{live.url}/metrics").text
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    named = {m for expr in queries(dashboard()) for m in METRIC.findall(expr)}
    assert named
    missing = sorted(named - set(exported))
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    assert all("model_name" in exported[m] for m in named)  # the $model_name variable's label
