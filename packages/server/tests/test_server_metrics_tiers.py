"""The hierarchical cache's gauges on /metrics: read from the engine's server info when the
tiers are on, absent when they are off."""

from __future__ import annotations

from radixlm.server.metrics import ServerMetrics


def test_tier_gauges_follow_the_engines_info() -> None:
    info = {"num_running_reqs": 1, "host_cached_tokens": 640, "storage_cached_tokens": 128,
            "hicache_host_pages": 12}  # fmt: skip
    text = ServerMetrics(lambda: info, lambda: 0).render().decode()
    assert "radixlm_hicache_host_cached_tokens 640.0" in text
    assert "radixlm_hicache_storage_cached_tokens 128.0" in text
    assert "radixlm_hicache_host_pages 12.0" in text
    plain = ServerMetrics(lambda: {"num_running_reqs": 1}, lambda: 0).render().decode()
    assert "radixlm_hicache" not in plain and "sglang:num_running_reqs{" in plain
