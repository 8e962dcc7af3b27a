"""Scheduling under overload on a tiny random Llama: request priorities (the queue's order,
preemption of lower priorities, a full queue refusing its lowest-priority request) and
per-request timeouts. Outputs stay what each request gives alone (greedy), and no KV slot is
lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model
from radixlm.runtime.messages import Call
from radixlm.sampling import EngineOverloaded, InvalidRequest

LONG: dict[str, Any] = {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True}
SHORT: dict[str, Any] = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
LOW = [11, 12, 13, 14, 15, 16, 17, 18]
HIGH = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def alone(model_dir: Path) -> dict[str, list[int]]:
    """Each prompt's greedy output when it runs by itself."""
    with Engine(str(model_dir), show_progress=False, max_total_tokens=4096) as eng:
        return {
            "low": eng.generate(input_ids=LOW, sampling_params=LONG)["output_ids"],
            "high": eng.generate(input_ids=HIGH, sampling_params=SHORT)["output_ids"],
        }


def _engine(model_dir: Path, **kwargs: Any) -> Engine:
    kwargs.setdefault("max_total_tokens", 4096)
    return Engine(str(model_dir), show_progress=False, **kwargs)


def _hold(engine: Engine) -> threading.Event:
    """Hold the engine loop (requests submitted meanwhile stay queued) until the event."""
    release = threading.Event()
    engine._connection.post(Call(lambda core: release.wait(30), reply=-1))
    return release


def _drain(stream: Iterator[dict[str, Any]], finished: list[str], name: str) -> threading.Thread:
    """Read a stream on a thread; its name goes to `finished` when it ends."""

    def read() -> None:
        for _chunk in stream:
            pass
        finished.append(name)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.thread_only("holds the loop with a Call")
@pytest.mark.parametrize("low_first", [False, True])
def test_the_queue_runs_higher_priorities_first(model_dir: Path, low_first: bool) -> None:
    """One running slot, three queued requests: they finish in priority order (larger first,
    or smaller first with `schedule_low_priority_values_first`), not in arrival order."""
    with _engine(
        model_dir,
        max_running_requests=1,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first,
    ) as eng:
        release = _hold(eng)
        finished: list[str] = []
        # Long enough that one request's run outlasts a reader thread's wake-up on a busy
        # machine: with 6 tokens (~2 ms) a reader that woke late swapped two names (CI).
        queued = {**SHORT, "max_new_tokens": 96}
        threads = [
            _drain(eng.generate(input_ids=LOW, sampling_params=queued, stream=True, priority=p),
                   finished, str(p))
            for p in (0, 5, 10)
        ]  # fmt: skip
        release.set()
        for thread in threads:
            thread.join(60)
        assert finished == (["0", "5", "10"] if low_first else ["10", "5", "0"])
        eng.check_invariants()


def test_a_higher_priority_preempts_a_running_request_whose_output_stays_the_same(
    model_dir: Path, alone: dict[str, list[int]]
) -> None:
    """With one running slot, a request of much higher priority does not wait for a long one:
    the long one goes back to the queue (its tokens to the cache) and resumes after, with the
    output it has alone. Without priority scheduling the same arrival waits."""
    for enabled in (True, False):
        with _engine(model_dir, max_running_requests=1, enable_priority_scheduling=enabled) as eng:
            extra = {"priority": 0} if enabled else {}
            low = eng.generate(input_ids=LOW, sampling_params=LONG, stream=True, **extra)
            first = next(low)  # it runs
            assert first["meta_info"]["finish_reason"] is None
            extra = {"priority": 100} if enabled else {}
            high = eng.generate(input_ids=HIGH, sampling_params=SHORT, **extra)
            rest = list(low)
            assert high["output_ids"] == alone["high"]
            assert rest[-1]["output_ids"] == alone["low"]
            retractions = eng.server_info(fresh=True)["num_retractions"]
            if enabled:
                # The high one finished while the low one still had most of its tokens to go.
                assert len(rest) > 1 and retractions >= 1, (len(rest), retractions)
                assert high["meta_info"]["e2e_latency"] < rest[-1]["meta_info"]["e2e_latency"]
            else:
                assert retractions == 0
            eng.check_invariants()


def test_a_small_priority_difference_does_not_preempt(
    model_dir: Path, alone: dict[str, list[int]]
) -> None:
    """Below `priority_scheduling_preemption_threshold` the newcomer waits its turn."""
    with _engine(
        model_dir,
        max_running_requests=1,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=10,
    ) as eng:
        low = eng.generate(input_ids=LOW, sampling_params=LONG, stream=True, priority=0)
        next(low)
        high = eng.generate(input_ids=HIGH, sampling_params=SHORT, priority=5)
        assert high["output_ids"] == alone["high"]
        assert list(low)[-1]["output_ids"] == alone["low"]
        assert eng.server_info(fresh=True)["num_retractions"] == 0


@pytest.mark.thread_only("holds the loop with a Call")
def test_a_full_queue_refuses_its_lowest_priority_request_for_a_higher_one(
    model_dir: Path, alone: dict[str, list[int]]
) -> None:
    """`max_queued_requests=1`: a third request of higher priority takes the queued one's
    place (that one gets EngineOverloaded, the 503 of the server); one of equal priority is
    refused itself."""
    with _engine(
        model_dir,
        max_running_requests=1,
        max_queued_requests=1,
        enable_priority_scheduling=True,
    ) as eng:
        release = _hold(eng)
        running = eng.generate(input_ids=LOW, sampling_params=SHORT, stream=True, priority=0)
        queued = eng.generate(input_ids=LOW, sampling_params=SHORT, stream=True, priority=0)
        same = eng.generate(input_ids=LOW, sampling_params=SHORT, stream=True, priority=0)
        urgent = eng.generate(input_ids=HIGH, sampling_params=SHORT, stream=True, priority=50)
        release.set()
        with pytest.raises(EngineOverloaded, match="queue is full"):
            list(same)
        with pytest.raises(EngineOverloaded, match="higher priority took"):
            list(queued)
        assert list(urgent)[-1]["output_ids"] == alone["high"]
        assert list(running)[-1]["meta_info"]["finish_reason"]["type"] == "length"
        eng.check_invariants()


def test_priority_without_priority_scheduling_is_refused(model_dir: Path) -> None:
    with _engine(model_dir) as eng:
        with pytest.raises(InvalidRequest, match="enable-priority-scheduling") as error:
            eng.generate(input_ids=LOW, sampling_params=SHORT, priority=3)
        assert error.value.field == "priority"
        with pytest.raises(InvalidRequest, match="timeout"):
            eng.generate(input_ids=LOW, sampling_params=SHORT, timeout=0)


@pytest.mark.thread_only("holds the loop with a Call")
def test_a_request_past_its_timeout_ends_with_abort_keeping_its_output(
    model_dir: Path, alone: dict[str, list[int]]
) -> None:
    """A queued request whose timeout passes ends with no output; a running one ends after
    the tokens it had; both say why, others finish untouched, and no slot is lost."""
    with _engine(model_dir) as eng:
        release = _hold(eng)
        queued = eng.generate(input_ids=HIGH, sampling_params=SHORT, stream=True, timeout=0.05)
        time.sleep(0.1)
        release.set()
        last = list(queued)[-1]
        reason = last["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "timed out" in reason["message"], reason
        assert last["output_ids"] == []

        running = eng.generate(input_ids=LOW, sampling_params=LONG, stream=True, timeout=0.5)
        other = eng.generate(input_ids=HIGH, sampling_params=SHORT, stream=True)
        first = next(running)
        release = _hold(eng)  # past its deadline before the next step
        time.sleep(0.6)
        release.set()
        last = list(running)[-1]
        reason = last["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "0.5 s" in reason["message"], reason
        output = last["output_ids"]
        assert len(first["output_ids"]) <= len(output) < len(alone["low"])
        assert output == alone["low"][: len(output)]
        assert list(other)[-1]["output_ids"] == alone["high"]
        eng.check_invariants()
