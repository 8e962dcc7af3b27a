"""SGLang's /generate with `input_embeds` and `return_hidden_states`, end to end on the real
tiny engine: JSON bodies in, SGLang's shapes out, nothing leaked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import torch

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def _table(server: Any) -> torch.Tensor:
    """The model's embedding table, read from its checkpoint (the engine core may run in
    another process)."""
    from safetensors.torch import load_file

    for shard in sorted(Path(server.engine.config.model_path).glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            if name.endswith("embed_tokens.weight"):
                return tensor.float()
    raise AssertionError("no embed_tokens.weight in the checkpoint")


def _ids(server: Any, text: str) -> list[int]:
    return list(server.engine.tokenizer.encode(text))


def test_a_json_embeddings_prompt_answers_as_its_token_ids_do(
    http: httpx.Client, server: Any
) -> None:
    ids = _ids(server, "the radix tree caches the prefix")
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
    by_embeds = http.post(
        "/generate",
        json={"input_embeds": _table(server)[ids].tolist(), "sampling_params": GREEDY},
    )
    assert by_ids.status_code == by_embeds.status_code == 200, by_embeds.text
    assert by_embeds.json()["output_ids"] == by_ids.json()["output_ids"]
    assert by_embeds.json()["text"] == by_ids.json()["text"]
    assert by_embeds.json()["meta_info"]["prompt_tokens"] == len(ids)
    server.assert_no_leaks()


def test_a_batch_of_embeddings_prompts_streams(http: httpx.Client, server: Any) -> None:
    prompts = [_ids(server, t) for t in ("hello world", "the cache is a tree")]
    body = {
        "input_embeds": [_table(server)[p].tolist() for p in prompts],
        "sampling_params": GREEDY,
        "stream": True,
    }
    finals: dict[int, dict[str, Any]] = {}
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[len("data:") :])
                finals[chunk["index"]] = chunk
    alone = [
        http.post("/generate", json={"input_ids": p, "sampling_params": GREEDY}).json()
        for p in prompts
    ]
    assert [finals[i]["output_ids"] for i in (0, 1)] == [a["output_ids"] for a in alone]
    server.assert_no_leaks()


def test_hidden_states_come_back_in_sglang_shape(http: httpx.Client, server: Any) -> None:
    ids = _ids(server, "hidden states over http")
    response = http.post(
        "/generate",
        json={"input_ids": ids, "sampling_params": GREEDY, "return_hidden_states": True},
    )
    assert response.status_code == 200, response.text
    out = response.json()
    entries = out["meta_info"]["hidden_states"]
    width = server.engine.info.hidden_size
    assert len(entries) == GREEDY["max_new_tokens"]
    assert [len(row) for row in entries[0]] == [width] * len(ids)
    assert all(len(vector) == width for vector in entries[1:])
    plain = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert "hidden_states" not in plain["meta_info"]
    assert plain["output_ids"] == out["output_ids"]


def test_embeddings_of_the_wrong_width_are_a_400_naming_the_field(
    http: httpx.Client, server: Any
) -> None:
    response = http.post(
        "/generate", json={"input_embeds": [[0.5, 0.25]], "sampling_params": GREEDY}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "input_embeds"
    assert str(server.engine.info.hidden_size) in error["message"]
    server.assert_no_leaks()
