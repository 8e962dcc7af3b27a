"""SGLang's weight routes through the server on the real engine: `/update_weights_from_disk`
swaps the policy (the next `/generate` answers with the new weights and version),
`/get_weights_by_name` reads a weight back, and bad bodies are 400s that name the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model
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
    engine = Engine(str(policies[0]), show_progress=False, cpu_threads=1)
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
