"""Prefill/decode disaggregation on a tiny random Llama: a prefill engine and a decode engine
(threads of this process, over both transfer backends) answer a request together exactly as a
colocated engine does (greedy: text, ids, logprobs, cached tokens), batched, concurrent and
chunked; a data-parallel prefill server's replicas each prefill their own rooms, a decode
engine sent to the wrong one registering at the right one; and every failure (no prefill server, no prefill request, a decode side that goes
away, another model, an abort) ends the request with finish reason abort and a message that
says what to check, with every KV slot back."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from radixlm.runtime import Engine
from radixlm.runtime.disaggregation import create_backend
from radixlm.runtime.disaggregation.kv import pool_layout
from radixlm.runtime.disaggregation.protocol import (
    Cancel,
    Redirect,
    Register,
    Registered,
    from_frame,
    to_frame,
)
from radixlm.runtime.fixtures import build_tiny_model
from radixlm.runtime.replicas import free_port_range, replica_options
from radixlm.sampling import InvalidRequest

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LOGPROBS: dict[str, Any] = {
    "return_logprob": True,
    "top_logprobs_num": 3,
    "logprob_start_len": 0,
    "token_ids_logprob": [5, 17],
}
PROMPTS = [
    "the cache of the radix tree",
    "a request to the decode server",
    "the first token is sampled on the prefill server, the rest here",
    "hello world",
]
#: (Each test's prompts start apart from the other tests': a prefix cached by another test
#: would be computed in other batches by the prefill and the colocated engine.)
#: Settings every engine here shares (so that their numbers agree bit for bit).
COMMON: dict[str, Any] = {
    "show_progress": False,
    "cpu_threads": 1,
    "device": "cpu",
    "dtype": "float32",
    "max_total_tokens": 2048,
    "chunked_prefill_size": 64,
}
_rooms = itertools.count(1 << 40)


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("pd") / "llama", init_std=0.5)


@pytest.fixture(scope="module")
def colocated(model: Path) -> Iterator[Engine]:
    with Engine(str(model), **COMMON) as engine:
        yield engine


@pytest.fixture(scope="module", params=["tcp", "shm"])
def pair(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[Engine, Engine]]:
    """A prefill engine and a decode engine over the backend of the parameter."""
    backend = {"disaggregation_transfer_backend": request.param}
    with (
        Engine(
            str(model),
            disaggregation_mode="prefill",
            disaggregation_bootstrap_port=0,
            **backend,
            **COMMON,
        ) as prefill,
        Engine(str(model), disaggregation_mode="decode", **backend, **COMMON) as decode,
    ):
        yield prefill, decode


@pytest.fixture(scope="module")
def quick(model: Path) -> Iterator[tuple[Engine, Engine]]:
    """A pair that gives up after half a second (the failure tests)."""
    short = {"disaggregation_transfer_timeout": 0.5, **COMMON}
    with (
        Engine(
            str(model), disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **short
        ) as prefill,
        Engine(str(model), disaggregation_mode="decode", **short) as decode,
    ):
        yield prefill, decode


def bootstrap(prefill: Engine, room: int | list[int] | None = None) -> dict[str, Any]:
    """The bootstrap fields a router sends both servers."""
    port = prefill.info.static_info["disaggregation"]["bootstrap_port"]
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": next(_rooms) if room is None else room,
    }


def both(
    prefill: Engine, decode: Engine, prompt: Any, prefill_first: bool = False, **kwargs: Any
) -> tuple[Any, Any]:
    """Send the same request to both servers at once, as a router does; their answers. With
    `prefill_first` the decode request goes once the prefill server has the K/V ready."""
    kwargs = {"sampling_params": GREEDY, **bootstrap(prefill), **kwargs}
    answers: dict[str, Any] = {}

    def run_prefill() -> None:
        try:
            answers["prefill"] = prefill.generate(prompt, **kwargs)
        except Exception as error:  # reported below
            answers["prefill"] = error

    thread = threading.Thread(target=run_prefill)
    thread.start()
    if prefill_first:
        wait_for(lambda: prefill.server_info()["num_prefill_prealloc_queue_reqs"] > 0)
    decoded = decode.generate(prompt, **kwargs)
    thread.join(30)
    return answers["prefill"], decoded


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


#: What differs between any two runs, and the cache hit (the prefill server caches prompts
#: only, a colocated engine their outputs too: later prompts may hit more there).
_VARYING = ("id", "e2e_latency", "timestamps", "cached_tokens")


def comparable(out: Any) -> Any:
    """An answer without what differs between any two runs."""
    if isinstance(out, list):
        return [comparable(o) for o in out]
    meta = {k: v for k, v in out["meta_info"].items() if k not in _VARYING}
    return {**out, "meta_info": meta}


def assert_slots_back(*engines: Engine) -> None:
    """Nothing runs or waits, no slot is lost, and with the cache flushed every slot is free."""
    for engine in engines:
        wait_for(lambda e=engine: e.server_info()["num_running_reqs"] == 0)  # type: ignore[misc]
        engine.check_invariants()
        assert engine.flush_cache()
        pool = engine.runner.kv_pool
        assert engine.run_in_loop(lambda core: core.scheduler.pool.available) == pool.num_slots


# ------------------------------------------------------------------------- same answers


def test_decode_answers_as_a_colocated_engine_with_logprobs(
    pair: tuple[Engine, Engine], colocated: Engine
) -> None:
    prefill, decode = pair
    for prompt in PROMPTS[:2]:
        first, answer = both(prefill, decode, prompt, **LOGPROBS)
        expected = colocated.generate(prompt, GREEDY, **LOGPROBS)
        assert comparable(answer) == comparable(expected)
        # The prefill server answers the first token alone (the router ignores it).
        assert first["output_ids"] == expected["output_ids"][:1]
        assert first["meta_info"]["finish_reason"]["type"] == "length"
    assert_slots_back(prefill, decode)


def test_seeded_sampling_draws_what_a_colocated_engine_draws(
    pair: tuple[Engine, Engine], colocated: Engine
) -> None:
    prefill, decode = pair
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 10, "seed": 1234}
    prompt = "Seeded: sample from the prefill server on"
    _, answer = both(prefill, decode, prompt, sampling_params=params)
    assert comparable(answer) == comparable(colocated.generate(prompt, params))


def test_prefill_may_finish_before_the_decode_server_registers(
    pair: tuple[Engine, Engine], colocated: Engine
) -> None:
    prefill, decode = pair
    _, answer = both(prefill, decode, PROMPTS[2], prefill_first=True)
    assert comparable(answer) == comparable(colocated.generate(PROMPTS[2], GREEDY))


def test_batched_and_concurrent_requests_match_colocated(
    pair: tuple[Engine, Engine], colocated: Engine
) -> None:
    prefill, decode = pair
    # One batch of prompts (a room each) and concurrent single requests beside it.
    batch: dict[str, Any] = {}
    singles: list[Any] = [None] * len(PROMPTS)

    def run_batch() -> None:
        rooms = [next(_rooms) for _ in PROMPTS]
        batch["answer"] = both(prefill, decode, PROMPTS, **bootstrap(prefill, rooms))[1]

    def run_single(k: int) -> None:
        singles[k] = both(prefill, decode, PROMPTS[k], sampling_params={**GREEDY, "n": 1})[1]

    threads = [threading.Thread(target=run_batch)]
    threads += [threading.Thread(target=run_single, args=(k,)) for k in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # Batching changes the rounding of a step, so compare token ids one request at a time.
    expected = [colocated.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    assert [out["output_ids"] for out in batch["answer"]] == expected
    assert [out["output_ids"] for out in singles] == expected
    assert_slots_back(prefill, decode)


def test_long_prompt_prefilled_in_chunks_matches_colocated(
    pair: tuple[Engine, Engine], colocated: Engine
) -> None:
    prefill, decode = pair
    # Several chunks of chunked_prefill_size, and no prefix another test's prompt shares (a
    # cached prefix computed in another batch would round differently in each engine).
    prompt = "Quite long: " + " ".join(PROMPTS * 6)
    passes = prefill.server_info()["forward_passes"]
    _, answer = both(prefill, decode, prompt, **LOGPROBS)
    length = len(colocated.tokenizer.encode(prompt))
    assert length > 2 * COMMON["chunked_prefill_size"]
    assert prefill.server_info()["forward_passes"] - passes >= 3  # it was chunked
    assert comparable(answer) == comparable(colocated.generate(prompt, GREEDY, **LOGPROBS))


def test_a_repeated_prompt_is_served_from_the_prefill_cache(
    pair: tuple[Engine, Engine], colocated: Engine
) -> None:
    prefill, decode = pair
    prompt = "Zebra crossing: a prefix two requests of one tenant share"
    for _ in range(2):
        _, answer = both(prefill, decode, prompt)
        expected = colocated.generate(prompt, GREEDY)
        assert comparable(answer) == comparable(expected)
    # The prefill server's hit, reported by the decode server: all but the last token.
    cached = answer["meta_info"]["cached_tokens"]
    assert (
        cached == expected["meta_info"]["cached_tokens"] == answer["meta_info"]["prompt_tokens"] - 1
    )


def test_the_first_streamed_chunk_carries_the_first_token(pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pair
    fields = {"sampling_params": GREEDY, **bootstrap(prefill)}
    thread = threading.Thread(target=prefill.generate, args=(PROMPTS[0],), kwargs=fields)
    thread.start()
    chunks = list(decode.generate(PROMPTS[0], stream=True, **fields))
    thread.join(30)
    assert len(chunks[0]["output_ids"]) >= 1 and chunks[-1]["meta_info"]["finish_reason"]
    assert chunks[-1]["output_ids"][:1] == chunks[0]["output_ids"][:1]


def test_a_constrained_request_keeps_its_grammar_across_the_servers(
    pair: tuple[Engine, Engine], colocated: Engine
) -> None:
    prefill, decode = pair
    params = {"temperature": 0, "max_new_tokens": 12, "regex": "(yes|no)(, (maybe|never))+"}
    prompt = "Answer with words: "
    _, answer = both(prefill, decode, prompt, sampling_params=params)
    expected = colocated.generate(prompt, params)
    assert comparable(answer) == comparable(expected)
    assert answer["text"].startswith(("yes", "no"))


def test_the_servers_may_use_other_page_sizes(
    quick: tuple[Engine, Engine], model: Path, colocated: Engine
) -> None:
    prefill, _ = quick
    prompt = "Paged pool on the decode side, by fours"
    with Engine(str(model), disaggregation_mode="decode", **{**COMMON, "page_size": 4}) as decode:
        _, answer = both(prefill, decode, prompt, **LOGPROBS)
        assert_slots_back(decode)
    assert comparable(answer) == comparable(colocated.generate(prompt, GREEDY, **LOGPROBS))


# ------------------------------------------------------------ a data-parallel prefill server


@pytest.fixture(scope="module")
def replicated(model: Path) -> Iterator[tuple[list[Engine], Engine]]:
    """The two prefill replicas of a `--dp-size 2` prefill server (threads here: the options
    `radixlm serve` gives its replica processes) and a decode engine."""
    options = replica_options(
        {**COMMON, "disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 0}, 2
    )
    with (
        Engine(str(model), **{**options[0], "engine_process": False}) as first,
        Engine(str(model), **{**options[1], "engine_process": False}) as second,
        Engine(str(model), disaggregation_mode="decode", **COMMON) as decode,
    ):
        yield [first, second], decode


def test_each_prefill_replica_prefills_its_rooms(
    replicated: tuple[list[Engine], Engine], colocated: Engine
) -> None:
    replicas, decode = replicated
    ports = [r.info.static_info["disaggregation"]["bootstrap_port"] for r in replicas]
    assert ports[1] == ports[0] + 1
    assert replicas[1].info.static_info["disaggregation"]["bootstrap_ports"] == ports
    prompts = [f"Replicated {k}: the prefill server has two engines" for k in range(4)]
    answers: list[Any] = [None] * len(prompts)
    finished = [r.server_info()["finished_requests"] for r in replicas]
    rooms = [next(_rooms) for _ in prompts]  # two even ones, two odd ones

    def run(k: int) -> None:
        # The decode engine is given the server's first port, as a router gives it.
        fields = bootstrap(replicas[0], rooms[k])
        answers[k] = both(replicas[rooms[k] % 2], decode, prompts[k], **fields)[1]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    expected = [colocated.generate(p, GREEDY)["output_ids"] for p in prompts]
    assert [a["output_ids"] for a in answers] == expected
    assert [r.server_info()["finished_requests"] for r in replicas] == [n + 2 for n in finished]
    assert_slots_back(*replicas, decode)


def test_a_prefill_replica_refuses_another_replicas_room(
    replicated: tuple[list[Engine], Engine],
) -> None:
    replicas, _ = replicated
    room = 2 * next(_rooms) + 1  # replica 1's
    with pytest.raises(InvalidRequest, match="replica 1 of this data-parallel") as caught:
        replicas[0].generate(PROMPTS[0], GREEDY, **bootstrap(replicas[0], room))
    assert caught.value.field == "bootstrap_room"


def test_a_prefill_replica_sends_decode_engines_to_the_room_s_replica(
    replicated: tuple[list[Engine], Engine],
) -> None:
    replicas, _ = replicated
    ports = replicas[0].info.static_info["disaggregation"]["bootstrap_ports"]
    layout = pool_layout(replicas[0].runner.kv_pool, "LlamaForCausalLM")
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.connect(f"tcp://127.0.0.1:{ports[0]}")
        room = 2 * next(_rooms) + 1
        dealer.send(to_frame(Register(room, layout, "tcp")))
        assert dealer.poll(5000)
        assert from_frame(dealer.recv()) == Redirect(room, tuple(ports))
        dealer.send(to_frame(Register(room - 1, layout, "tcp")))
        assert dealer.poll(5000)
        assert from_frame(dealer.recv()) == Registered(room - 1, tuple(ports))
        dealer.send(to_frame(Cancel(room - 1, "a test")))


def test_a_lone_prefill_engine_speaks_as_before() -> None:
    # A server without replicas sends the frames of version 1 as they were.
    assert to_frame(Registered(7)) == b'{"v":1,"type":"registered","room":7}'
    assert from_frame(b'{"v":1,"type":"registered","room":7}') == Registered(7)


def test_free_port_range_finds_consecutive_free_ports() -> None:
    import socket

    first = free_port_range("127.0.0.1", 3)
    for port in range(first, first + 3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


# ------------------------------------------------------------------------------ failures


def test_decode_gives_up_when_no_prefill_server_answers(quick: tuple[Engine, Engine]) -> None:
    _, decode = quick
    with zmq.Context() as context, context.socket(zmq.REP) as socket:
        port = socket.bind_to_random_port("tcp://127.0.0.1")  # (taken, answered by no one)
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        answer = decode.generate(PROMPTS[0], GREEDY, bootstrap_room=next(_rooms), **fields)
    finish = answer["meta_info"]["finish_reason"]
    assert finish["type"] == "abort"
    assert "decode server" in finish["message"] and "did not answer" in finish["message"]
    assert answer["output_ids"] == []
    assert_slots_back(decode)


def test_decode_gives_up_when_the_prefill_server_gets_no_request(
    quick: tuple[Engine, Engine],
) -> None:
    prefill, decode = quick
    answer = decode.generate(PROMPTS[0], GREEDY, **bootstrap(prefill))
    finish = answer["meta_info"]["finish_reason"]
    assert finish["type"] == "abort"
    assert "sent no K/V" in finish["message"] or "no request" in finish["message"]
    assert_slots_back(prefill, decode)


def test_decode_gives_up_at_once_when_its_prefill_server_goes_away(
    pair: tuple[Engine, Engine],
) -> None:
    _, decode = pair  # (its timeout is a minute: this must not wait for it)
    with zmq.Context() as context:
        server = context.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        stream = decode.generate(
            PROMPTS[0], GREEDY, stream=True, bootstrap_room=next(_rooms), **fields
        )
        peer, frame = server.recv_multipart()  # the registration: taken, then the server stops
        room = json.loads(frame)["room"]
        server.send_multipart([peer, to_frame(Registered(room))])
        time.sleep(0.1)
        server.close(linger=0)
        started = time.monotonic()
        chunks = list(stream)
    finish = chunks[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "closed the connection" in finish["message"]
    assert time.monotonic() - started < 5
    assert_slots_back(decode)


def test_prefill_gives_up_when_no_decode_server_registers(quick: tuple[Engine, Engine]) -> None:
    prefill, _ = quick
    answer = prefill.generate(PROMPTS[1], GREEDY, **bootstrap(prefill))
    finish = answer["meta_info"]["finish_reason"]
    assert finish["type"] == "abort"
    assert (
        "prefill server" in finish["message"]
        and "no decode server registered" in (finish["message"])
    )
    assert_slots_back(prefill)


def test_prefill_frees_its_slots_when_the_decode_side_goes_away(
    quick: tuple[Engine, Engine],
) -> None:
    prefill, _ = quick
    fields = bootstrap(prefill)
    layout = pool_layout(prefill.runner.kv_pool, "LlamaForCausalLM")
    # A decode side that registers the room, then is gone before the K/V comes.
    with zmq.Context() as context:
        socket = context.socket(zmq.DEALER)
        socket.connect(f"tcp://127.0.0.1:{fields['bootstrap_port']}")
        socket.send(to_frame(Register(fields["bootstrap_room"], layout, "tcp")))
        socket.recv()  # Registered
        socket.close(linger=0)
    answer = prefill.generate(PROMPTS[2], GREEDY, **fields)
    finish = answer["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "decode server" in finish["message"]
    assert_slots_back(prefill)


def test_a_decode_server_shut_down_while_waiting_cancels_its_rooms(
    quick: tuple[Engine, Engine], model: Path
) -> None:
    prefill, _ = quick
    fields = bootstrap(prefill)
    decode = Engine(str(model), disaggregation_mode="decode", **COMMON)
    stream = decode.generate(PROMPTS[0], GREEDY, stream=True, **fields)
    wait_for(lambda: decode.server_info()["num_decode_transfer_queue_reqs"] == 1)
    decode.shutdown()
    with pytest.raises(Exception, match="shut down"):
        list(stream)
    answer = prefill.generate(PROMPTS[0], GREEDY, **fields)
    finish = answer["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "decode server gave up" in finish["message"]
    assert_slots_back(prefill)


def test_abort_of_a_request_waiting_for_its_kv(quick: tuple[Engine, Engine]) -> None:
    prefill, decode = quick
    fields = bootstrap(prefill)
    stream = decode.generate(PROMPTS[0], GREEDY, stream=True, rid="waiting", **fields)
    wait_for(lambda: decode.server_info()["num_decode_transfer_queue_reqs"] == 1)
    info = decode.server_info()
    assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
    assert decode.abort("waiting")
    chunks = list(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    # The prefill server heard of it: its half ends at once, without waiting for a timeout.
    answer = prefill.generate(PROMPTS[0], GREEDY, **fields)
    assert "gave up" in answer["meta_info"]["finish_reason"]["message"]
    assert_slots_back(prefill, decode)


def test_another_model_on_the_decode_side_is_refused_on_both_sides(
    quick: tuple[Engine, Engine], tmp_path: Path
) -> None:
    prefill, _ = quick
    other = build_tiny_model(tmp_path / "other", num_layers=3)
    with Engine(str(other), disaggregation_mode="decode", **COMMON) as decode:
        first, answer = both(prefill, decode, PROMPTS[0])
    for out, side in ((first, "prefill server"), (answer, "decode server")):
        finish = out["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and finish["message"].startswith(side)
        assert (
            "num_layers 2 vs 3" in finish["message"] or "num_layers 3 vs 2" in (finish["message"])
        )
    assert_slots_back(prefill)


# ------------------------------------------------------------------------- refused input


def test_a_decode_server_needs_the_bootstrap_fields(quick: tuple[Engine, Engine]) -> None:
    prefill, decode = quick
    fields = bootstrap(prefill)
    for missing in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        given = {k: v for k, v in fields.items() if k != missing}
        with pytest.raises(InvalidRequest, match="decode server") as caught:
            decode.generate(PROMPTS[0], GREEDY, **given)
        assert caught.value.field == missing
    with pytest.raises(InvalidRequest) as caught:
        prefill.generate(PROMPTS[0], GREEDY)
    assert caught.value.field == "bootstrap_room"


def test_a_colocated_engine_refuses_the_bootstrap_fields(colocated: Engine) -> None:
    with pytest.raises(InvalidRequest, match="not disaggregated") as caught:
        colocated.generate(PROMPTS[0], GREEDY, bootstrap_room=1)
    assert caught.value.field == "bootstrap_room"


def test_what_disaggregation_does_not_cover_is_refused(quick: tuple[Engine, Engine]) -> None:
    prefill, decode = quick
    with pytest.raises(InvalidRequest, match="n > 1") as caught:
        decode.generate(PROMPTS[0], {**GREEDY, "n": 2}, **bootstrap(prefill))
    assert caught.value.field == "n"
    with pytest.raises(InvalidRequest) as caught:
        prefill.generate(PROMPTS[0], GREEDY, return_hidden_states=True, **bootstrap(prefill))
    assert caught.value.field == "return_hidden_states"


def test_a_room_in_use_is_refused(quick: tuple[Engine, Engine]) -> None:
    prefill, decode = quick
    fields = bootstrap(prefill)
    stream = decode.generate(PROMPTS[0], GREEDY, stream=True, rid="first", **fields)
    wait_for(lambda: decode.server_info()["num_decode_transfer_queue_reqs"] == 1)
    with pytest.raises(InvalidRequest, match="in use") as caught:
        decode.generate(PROMPTS[1], GREEDY, **fields)
    assert caught.value.field == "bootstrap_room"
    decode.abort("first")
    list(stream)


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_rdma_backends_are_named_but_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"the {name} disaggregation transfer backend") as caught:
        create_backend(name)
    assert "tcp" in str(caught.value) and "shm" in str(caught.value)
