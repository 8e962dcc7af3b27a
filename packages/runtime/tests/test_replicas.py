"""The engine options of data-parallel replicas on one machine (radixlm serve --dp-size)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.replicas import replica_kwargs, replica_options


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU split")
def test_each_cpu_replica_gets_a_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(9)), raising=False)
    options = [replica_kwargs({"device": "cpu", "page_size": 4}, i, 2) for i in range(2)]
    assert (
        options == [{"device": "cpu", "page_size": 4, "engine_process": True, "cpu_threads": 4}] * 2
    )
    assert replica_kwargs({"cpu_threads": 2}, 0, 4)["cpu_threads"] == 2  # given: kept
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert replica_kwargs({}, 1, 2)["cpu_threads"] == 1  # never fewer than one


def test_what_replicas_cannot_do_is_refused() -> None:
    with pytest.raises(ValueError, match="drop --engine-mode thread"):
        replica_kwargs({"engine_process": False}, 0, 2)
    with pytest.raises(ValueError, match="--tp-size > 1 is not supported yet"):
        replica_kwargs({"tp_size": 2}, 0, 2)
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        replica_kwargs({}, 2, 2)
    with pytest.raises(ValueError, match="drop --device"):
        replica_kwargs({"device": "cuda:0"}, 0, 2)


def test_prefill_replicas_listen_on_consecutive_bootstrap_ports() -> None:
    prefill = {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 9000}
    options = replica_options({**prefill, "cpu_threads": 1}, 3)
    assert [o["disaggregation_bootstrap_port"] for o in options] == [9000, 9001, 9002]
    assert all(o["disaggregation_bootstrap_ports"] == [9000, 9001, 9002] for o in options)
    default = replica_options({"disaggregation_mode": "prefill", "cpu_threads": 1}, 2)
    assert [o["disaggregation_bootstrap_port"] for o in default] == [8998, 8999]
    # Port 0 (any free one): the first of free consecutive ports, chosen once for all.
    anywhere = replica_options({**prefill, "disaggregation_bootstrap_port": 0}, 2)
    first = anywhere[0]["disaggregation_bootstrap_port"]
    assert first > 0 and anywhere[1]["disaggregation_bootstrap_port"] == first + 1
    config = EngineConfig.from_kwargs("m", **anywhere[1]).disaggregation
    assert config.bootstrap_ports == (first, first + 1) and config.bootstrap_port == first + 1
    # A decode server's replicas, and one replica, keep the options as given.
    decode = replica_options({"disaggregation_mode": "decode", "cpu_threads": 1}, 2)
    assert all("disaggregation_bootstrap_ports" not in o for o in decode)
    assert "disaggregation_bootstrap_ports" not in replica_options(prefill, 1)[0]
    with pytest.raises(ValueError, match="past 65535"):
        replica_options({**prefill, "disaggregation_bootstrap_port": 65535}, 2)
    with pytest.raises(ValueError, match="replica_options"):
        replica_kwargs({**prefill, "disaggregation_bootstrap_port": 0}, 0, 2)


def test_replica_bootstrap_ports_are_checked() -> None:
    with pytest.raises(ValueError, match="must be one of disaggregation_bootstrap_ports"):
        EngineConfig.from_kwargs(
            "m", disaggregation_mode="prefill", disaggregation_bootstrap_port=7,
            disaggregation_bootstrap_ports=[8, 9],
        )  # fmt: skip
    with pytest.raises(ValueError, match="drop them for disaggregation_mode decode"):
        EngineConfig.from_kwargs(
            "m", disaggregation_mode="decode", disaggregation_bootstrap_ports=[8, 9]
        )


def test_cpu_threads_is_an_engine_option() -> None:
    assert EngineConfig.from_kwargs("m", cpu_threads=3).cpu_threads == 3
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        EngineConfig.from_kwargs("m", cpu_threads=0)


def test_cpu_threads_applies_to_a_core_on_a_thread_of_this_process(tmp_path: Path) -> None:
    """The in-process engine (the default) computes on this process's torch threads: a
    number given sets them (it was only applied in an engine process of its own)."""
    from radixlm.runtime import Engine
    from radixlm.runtime.fixtures import build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(str(model), cpu_threads=1, show_progress=False, device="cpu")
        try:
            assert torch.get_num_threads() == 1
        finally:
            engine.shutdown()
        engine = Engine(str(model), show_progress=False, device="cpu")  # None: left alone
        try:
            assert torch.get_num_threads() == 1
        finally:
            engine.shutdown()
    finally:
        torch.set_num_threads(before)
