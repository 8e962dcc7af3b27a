"""The engine options of data-parallel replicas on one machine (radixlm serve --dp-size)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.replicas import replica_kwargs


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
