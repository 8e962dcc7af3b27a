"""SGLang's weight routes through the server on the real engine: `/update_weights_from_disk`,
`/update_weights_from_tensor` (tensors in safe forms, never pickles) and a trainer's gloo
group swap the policy (the next `/generate` answers with the new weights and version),
`/get_weights_by_name` reads a weight back, `/release_memory_occupation` and
`/resume_memory_occupation` follow verl's order, and bad bodies are 400s that name the field."""

from __future__ import annotations

import base64
import datetime
import multiprocessing
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from radixlm.runtime import Engine, FlattenedTensorBucket
from radixlm.runtime.fixtures import build_tiny_model, checkpoint_tensors
from radixlm.server.app import create_app

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
IDS = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("policies")
    return (
        build_tiny_model(root / "before", seed=0, init_std=0.3),
        build_tiny_model(root / "after", seed=1, init_std=0.3),
    )


@pytest.fixture
def client(policies: tuple[Path, Path]) -> Iterator[TestClient]:
    threads = torch.get_num_threads()
    engine = Engine(str(policies[0]), show_progress=False, cpu_threads=1, kv_cache_bytes=1 << 22)
    try:
        with TestClient(create_app(engine)) as http:
            yield http
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


def _generate(http: TestClient) -> dict:
    reply = http.post("/generate", json={"input_ids": IDS, "sampling_params": GREEDY})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _post(http: TestClient, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = http.post(path, json=body) if body is not None else http.post(path)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    assert answer["success"] is True, answer
    return answer


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def outputs(policies: tuple[Path, Path]) -> tuple[list[int], list[int]]:
    """What each policy answers to IDS."""
    found = []
    for path in policies:
        with Engine(str(path), show_progress=False, cpu_threads=1, kv_cache_bytes=1 << 22) as e:
            found.append(e.generate(input_ids=IDS, sampling_params=GREEDY)["output_ids"])
    assert found[0] != found[1]
    return found[0], found[1]


def test_update_weights_from_disk_over_http(
    client: TestClient, policies: tuple[Path, Path]
) -> None:
    _before, after = policies
    with Engine(str(after), show_progress=False, cpu_threads=1) as fresh:
        want = fresh.generate(input_ids=IDS, sampling_params=GREEDY)["output_ids"]
    first = _generate(client)
    assert first["meta_info"]["weight_version"] == "default" and first["output_ids"] != want
    reply = client.post(
        "/update_weights_from_disk", json={"model_path": str(after), "weight_version": "v2"}
    )
    assert reply.status_code == 200 and reply.json()["success"] is True
    second = _generate(client)
    assert second["output_ids"] == want and second["meta_info"]["weight_version"] == "v2"
    rows = client.post(
        "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 4}
    )
    assert rows.status_code == 200 and len(rows.json()) == 4


def test_bad_weight_requests_name_what_to_change(client: TestClient, tmp_path: Path) -> None:
    missing = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert missing.status_code == 200 and missing.json()["success"] is False
    assert str(tmp_path) in missing.json()["message"]
    extra = client.post("/update_weights_from_disk", json={"model_path": "x", "nope": 1})
    assert extra.status_code == 400 and "nope" in extra.text
    unknown = client.post("/get_weights_by_name", json={"name": "model.nothing"})
    assert unknown.status_code == 400 and "no weight named" in unknown.text
    assert _generate(client)["meta_info"]["weight_version"] == "default"


def test_pause_and_continue_over_http(client: TestClient) -> None:
    assert client.post("/pause_generation", json={"mode": "in_place"}).json() == {"success": True}
    bad = client.post("/pause_generation", json={"mode": "sometimes"})
    assert bad.status_code == 400 and "mode" in bad.text
    assert client.post("/continue_generation").json() == {"success": True}
    assert _generate(client)["meta_info"]["finish_reason"]["type"] == "length"


def test_release_and_resume_over_http_follow_verls_order(
    client: TestClient, policies: tuple[Path, Path], outputs: tuple[list[int], list[int]]
) -> None:
    """Release both, resume the weights, push the new policy in the body (named_tensors),
    resume the KV cache (an empty body: every tag); `/generate` answers with the new policy."""
    _before, after = policies
    _old, new = outputs
    _generate(client)
    _post(client, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert client.get("/get_server_info").json()["memory_released"] == ["weights", "kv_cache"]
    resumed = _post(client, "/resume_memory_occupation", {"tags": ["weights"]})
    assert "zeros" in resumed["message"]
    tensors = [
        {
            "name": n,
            "dtype": "float32",
            "shape": list(t.shape),
            "data": _base64(t.numpy().tobytes()),
        }
        for n, t in checkpoint_tensors(after)
    ]
    update = _post(
        client, "/update_weights_from_tensor", {"named_tensors": tensors, "weight_version": "v2"}
    )
    assert update["weight_version"] == "v2"
    _post(client, "/resume_memory_occupation")
    assert client.get("/get_server_info").json()["memory_released"] == []
    answer = _generate(client)
    assert answer["output_ids"] == new and answer["meta_info"]["weight_version"] == "v2"


def test_update_weights_from_tensor_reads_a_flattened_bucket_and_a_safetensors_file(
    client: TestClient, policies: tuple[Path, Path], outputs: tuple[list[int], list[int]]
) -> None:
    from safetensors.torch import save

    before, after = policies
    old, new = outputs
    bucket = FlattenedTensorBucket(named_tensors=checkpoint_tensors(after))
    metadata = [
        {"name": m.name, "shape": list(m.shape), "dtype": "float32", "start_idx": m.start_idx,
         "end_idx": m.end_idx, "numel": m.numel}
        for m in bucket.get_metadata()
    ]  # fmt: skip
    flat = _base64(bucket.get_flattened_tensor().numpy().tobytes())
    body = {
        "load_format": "flattened_bucket",
        "flattened_bucket": {"data": flat, "metadata": metadata},
    }
    _post(client, "/update_weights_from_tensor", body)
    assert _generate(client)["output_ids"] == new
    back = _post(
        client,
        "/update_weights_from_tensor",
        {"safetensors": _base64(save(dict(checkpoint_tensors(before))))},
    )
    assert back["weight_version"] == "2" and _generate(client)["output_ids"] == old


def test_pickles_and_malformed_weight_bodies_are_400s_naming_the_field(
    client: TestClient,
) -> None:
    def refused(path: str, body: dict[str, Any], param: str, text: str) -> None:
        reply = client.post(path, json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and text in error["message"], error

    norm = {"name": "model.norm.weight", "dtype": "float32", "shape": [64]}
    path = "/update_weights_from_tensor"
    refused(path, {"serialized_named_tensors": ["gASVAAA="]}, "serialized_named_tensors", "pickles")
    refused(
        path,
        {"named_tensors": [{**norm, "data": "not base64!"}]},
        "named_tensors[0].data",
        "base64",
    )
    short = {**norm, "data": _base64(bytes(8))}
    refused(path, {"named_tensors": [short]}, "named_tensors", "takes 256 bytes")
    both = {"named_tensors": [short], "safetensors": _base64(bytes(8))}
    refused(path, both, "safetensors", "exactly one of")
    refused(path, {"safetensors": _base64(b"nonsense")}, "safetensors", "not a safetensors file")
    refused("/release_memory_occupation", {"tags": ["gpu"]}, "tags.0", "")
    mismatched = {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]}
    refused("/update_weights_from_distributed", mismatched, "dtypes", "one entry per name")
    unknown = client.post(
        "/update_weights_from_distributed", json={**mismatched, "dtypes": ["float32"] * 2}
    )
    assert unknown.status_code == 200 and "init_weights_update_group" in unknown.json()["message"]
    assert _generate(client)["meta_info"]["weight_version"] == "default"


def _trainer(port: int, path: str) -> None:
    """Rank 0 of a gloo group: broadcasts its policy's tensors in order."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for _name, tensor in checkpoint_tensors(Path(path)):
        group.broadcast([tensor.contiguous()], options).wait()


def test_a_trainer_syncs_its_policy_over_http_and_a_gloo_group(
    client: TestClient, policies: tuple[Path, Path], outputs: tuple[list[int], list[int]]
) -> None:
    _before, after = policies
    _old, new = outputs
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer, args=(port, str(after)), daemon=True
    )
    trainer.start()
    try:
        group = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
        }
        _post(client, "/init_weights_update_group", group)
        tensors = checkpoint_tensors(after)
        body = {
            "names": [n for n, _ in tensors],
            "dtypes": ["float32"] * len(tensors),
            "shapes": [list(t.shape) for _, t in tensors],
            "weight_version": "synced",
        }
        assert _post(client, "/update_weights_from_distributed", body)["weight_version"] == "synced"
    finally:
        trainer.join(30)
    assert _generate(client)["output_ids"] == new
