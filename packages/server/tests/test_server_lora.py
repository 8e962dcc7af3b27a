"""LoRA adapters: the flags, the load / unload routes, /v1/models, and adapters named by
`model` (vLLM's `adapter`, SGLang's `base:adapter`) or `lora_path` on every generating route."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import server_fake_engine as fake  # loaded by conftest.py
from starlette.testclient import TestClient

from radixlm.server import ServerConfig, create_app, launcher
from radixlm.server.cli import build_parser, engine_kwargs

CONFIG = ServerConfig(served_model_name="toy", log_requests=False)
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def lora_engine(tokenizer: Any) -> Any:
    return fake.LoraFakeEngine(tokenizer, lora_paths={"sql": "/adapters/sql"})


@pytest.fixture
def lora_http(lora_engine: Any) -> Iterator[TestClient]:
    with TestClient(create_app(lora_engine, CONFIG)) as client:
        yield client


@pytest.fixture
def lora_openai(lora_http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=lora_http, max_retries=0
    )


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


# Flags.


def test_lora_flags_reach_the_engine_under_sglangs_names() -> None:
    args = build_parser().parse_args(
        ["--enable-lora", "--lora-paths", "sql=/a/sql", "/a/chat",
         '{"lora_name": "math", "lora_path": "/a/math"}', "--max-loras-per-batch", "4",
         "--max-lora-rank", "64", "--lora-target-modules", "q_proj", "v_proj"]
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "enable_lora": True,
        "lora_paths": {"sql": "/a/sql", "/a/chat": "/a/chat", "math": "/a/math"},
        "max_loras_per_batch": 4,
        "max_lora_rank": 64,
        "lora_target_modules": ["q_proj", "v_proj"],
        "engine_process": True,
        "engine_restarts": 3,
    }


def test_lora_flags_left_out_leave_the_engine_without_lora_keywords() -> None:
    kwargs = engine_kwargs(build_parser().parse_args(["--model-path", "m"]))
    assert not [key for key in kwargs if "lora" in key]


def test_lora_paths_may_be_given_several_times() -> None:
    args = build_parser().parse_args(["--lora-paths", "a=/a", "--lora-paths", "b=/b"])
    assert engine_kwargs(args)["lora_paths"] == {"a": "/a", "b": "/b"}


def test_an_adapter_name_given_twice_is_a_flag_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lora-paths", "a=/one", "a=/two"])
    assert "'a' is given twice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("=/path", "has no lora_name"),
        ("name=", "has no lora_path"),
        ("{not json", "is not a JSON object"),
        ('{"lora_name": "a"}', "has no lora_path"),
        ('{"lora_name": "a", "lora_path": "/a", "rank": 8}', "unknown keys ['rank']"),
        ('{"lora_name": "a", "lora_path": "/a", "pinned": true}', "pinned adapters"),
    ],
)
def test_a_malformed_lora_paths_item_is_a_flag_error(
    item: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lora-paths", item])
    assert says in capsys.readouterr().err


def test_a_json_item_may_say_pinned_false() -> None:
    item = '{"lora_name": "a", "lora_path": "/a", "pinned": false}'
    assert engine_kwargs(build_parser().parse_args(["--lora-paths", item]))["lora_paths"] == {
        "a": "/a"
    }


@pytest.mark.parametrize("flag", ["--max-loras-per-batch", "--max-lora-rank"])
def test_lora_sizes_must_be_positive(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag, "0"])
    assert "must be 1 or more" in capsys.readouterr().err


def test_lora_target_modules_all_stands_alone(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["--lora-target-modules", "all"])
    assert engine_kwargs(args)["lora_target_modules"] == ["all"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lora-target-modules", "all", "q_proj"])
    assert "give all alone" in capsys.readouterr().err


def test_lora_target_modules_are_checked_against_the_runtimes_list(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    declared = {"lora_target_modules": ("q_proj", "v_proj")}
    monkeypatch.setattr(launcher, "engine_choices", lambda: declared)
    parser = build_parser()
    assert parser.parse_args(["--lora-target-modules", "all"]).lora_target_modules == ["all"]
    assert parser.parse_args(["--lora-target-modules", "v_proj"]).lora_target_modules == ["v_proj"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-target-modules", "qkv_proj"])
    assert "invalid choice" in capsys.readouterr().err


# Loading and unloading.


def test_load_lora_adapter_loads_it_and_lists_the_adapters(
    lora_http: TestClient, lora_engine: Any
) -> None:
    response = lora_http.post(
        "/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/chat"}
    )
    assert response.status_code == 200
    assert response.json() == {
        "success": True,
        "loaded_adapters": {"sql": "/adapters/sql", "chat": "/adapters/chat"},
    }
    assert lora_engine.adapter_calls == [("load", "chat", "/adapters/chat")]


def test_unload_lora_adapter_unloads_it_and_lists_the_rest(
    lora_http: TestClient, lora_engine: Any
) -> None:
    response = lora_http.post("/unload_lora_adapter", json={"lora_name": "sql"})
    assert response.status_code == 200
    assert response.json() == {"success": True, "loaded_adapters": {}}
    assert lora_engine.adapter_calls == [("unload", "sql")]


def test_the_adapters_an_engine_answers_with_are_the_ones_reported(
    lora_http: TestClient, lora_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # radixlm's engine answers a load with the adapters then loaded (here: at once, no await).
    answer = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    monkeypatch.setattr(lora_engine, "load_lora_adapter", lambda name, path: answer)
    response = lora_http.post("/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/c"})
    assert response.json() == {"success": True, "loaded_adapters": answer}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"lora_name": "sql", "lora_path": "/adapters/other"}, "lora_name", "already loaded"),
        ({"lora_name": "x", "lora_path": "/adapters/missing"}, "lora_path", "no LoRA adapter at"),
        ({"lora_name": "x", "lora_path": "/adapters/rank64"}, "lora_path", "max_lora_rank"),
        ({"lora_name": "x"}, "lora_path", "required"),
        ({"lora_name": "", "lora_path": "/a"}, "lora_name", "at least 1 character"),
        ({"lora_name": "x", "lora_path": "/a", "rank": 8}, "rank", "unknown field"),
        ({"lora_name": "x", "lora_path": "/a", "pinned": True}, "pinned", "not supported"),
        ({"lora_name": "toy", "lora_path": "/a"}, "lora_name", "names the base model"),
        ({"lora_name": "default", "lora_path": "/a"}, "lora_name", "names the base model"),
    ],
)
def test_a_refused_load_is_a_400_naming_the_field(
    lora_http: TestClient, lora_engine: Any, body: dict[str, Any], param: str, says: str
) -> None:
    error = error_of(lora_http.post("/load_lora_adapter", json=body), 400)
    assert error["param"] == param and says in error["message"]
    assert lora_engine.lora_adapters() == {"sql": "/adapters/sql"}


def test_unloading_an_unknown_adapter_is_a_400_naming_lora_name(lora_http: TestClient) -> None:
    error = error_of(lora_http.post("/unload_lora_adapter", json={"lora_name": "nope"}), 400)
    assert error["param"] == "lora_name" and "'nope'" in error["message"]
    error = error_of(lora_http.post("/unload_lora_adapter", json={}), 400)
    assert error["param"] == "lora_name"


def test_an_engine_without_lora_says_so(tokenizer: Any) -> None:
    with TestClient(create_app(fake.FakeEngine(tokenizer), CONFIG)) as client:
        for route, body in (
            ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
            ("/unload_lora_adapter", {"lora_name": "a"}),
        ):
            error = error_of(client.post(route, json=body), 400)
            assert error["message"] == "this engine does not support LoRA adapters"
            assert error["code"] == "lora_not_supported"
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["toy"]
        chat = {"model": "toy:a", "messages": USER}
        error = error_of(client.post("/v1/chat/completions", json=chat), 404)
        assert "this server serves 'toy' (see /v1/models)" in error["message"]


# The model list.


def test_models_lists_the_base_model_then_each_adapter(
    lora_http: TestClient, lora_openai: openai.OpenAI
) -> None:
    lora_http.post("/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/a/chat"})
    data = lora_http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["toy", "sql", "chat"]
    assert data[1] == {
        "id": "sql",
        "object": "model",
        "created": 0,
        "owned_by": "radixlm",
        "root": "/adapters/sql",
        "parent": "toy",
    }
    assert [m.id for m in lora_openai.models.list().data] == ["toy", "sql", "chat"]


def test_an_adapter_is_retrieved_by_name(lora_openai: openai.OpenAI) -> None:
    card = lora_openai.models.retrieve("sql")
    assert card.id == "sql" and card.model_extra == {"root": "/adapters/sql", "parent": "toy"}
    with pytest.raises(openai.NotFoundError):
        lora_openai.models.retrieve("chat")


# Requests naming an adapter.


@pytest.mark.parametrize("model", ["sql", "toy:sql", "default:sql"])
def test_chat_naming_an_adapter_runs_on_it_and_echoes_the_name(
    lora_openai: openai.OpenAI, lora_engine: Any, model: str
) -> None:
    reply = lora_openai.chat.completions.create(model=model, messages=USER, max_tokens=3)  # type: ignore[arg-type]
    assert reply.model == model
    assert lora_engine.received[-1].lora_path == "sql"


def test_a_streamed_chat_on_an_adapter_echoes_its_name_in_every_chunk(
    lora_openai: openai.OpenAI, lora_engine: Any
) -> None:
    stream = lora_openai.chat.completions.create(
        model="toy:sql",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=3,
        stream=True,
    )
    assert {chunk.model for chunk in stream} == {"toy:sql"}
    assert lora_engine.received[-1].lora_path == "sql"


def test_completions_on_an_adapter_send_it_with_every_prompt(
    lora_openai: openai.OpenAI, lora_engine: Any
) -> None:
    reply = lora_openai.completions.create(model="sql", prompt=["a", "b"], max_tokens=2)
    assert reply.model == "sql"
    assert [r.lora_path for r in lora_engine.received[-2:]] == ["sql", "sql"]


def test_responses_on_an_adapter_run_on_it(lora_openai: openai.OpenAI, lora_engine: Any) -> None:
    reply = lora_openai.responses.create(model="toy:sql", input="Hello", max_output_tokens=3)
    assert reply.model == "toy:sql"
    assert lora_engine.received[-1].lora_path == "sql"


@pytest.mark.parametrize("model", ["toy", "default", None])
def test_the_base_model_runs_without_an_adapter(
    lora_http: TestClient, lora_engine: Any, model: str | None
) -> None:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 2}
    if model is not None:
        body["model"] = model
    reply = lora_http.post("/v1/chat/completions", json=body).json()
    assert reply["model"] == "toy"
    assert lora_engine.received[-1].lora_path is None


@pytest.mark.parametrize("model", ["chat", "toy:chat", "other:sql"])
def test_an_unknown_model_is_a_404_naming_the_base_model_and_adapters(
    lora_http: TestClient, model: str
) -> None:
    body = {"model": model, "prompt": "a", "max_tokens": 1}
    error = error_of(lora_http.post("/v1/completions", json=body), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert "serves 'toy' and the LoRA adapter 'sql'" in error["message"]
    assert "model='toy:sql'" in error["message"]


def test_sglangs_lora_path_field_picks_the_adapter(
    lora_openai: openai.OpenAI, lora_engine: Any
) -> None:
    reply = lora_openai.chat.completions.create(
        model="toy",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"lora_path": "sql"},
    )
    assert reply.model == "toy"
    assert lora_engine.received[-1].lora_path == "sql"


def test_lora_path_naming_another_adapter_than_model_is_a_400(lora_http: TestClient) -> None:
    body = {"model": "sql", "prompt": "a", "lora_path": "chat"}
    error = error_of(lora_http.post("/v1/completions", json=body), 400)
    assert error["param"] == "lora_path" and "'chat'" in error["message"]


def test_the_engines_refusal_of_an_adapter_names_the_field_the_client_used(
    lora_http: TestClient, lora_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # lora_path naming no adapter: the engine refuses it.
    body = {"model": "toy", "prompt": "a", "lora_path": "nope"}
    error = error_of(lora_http.post("/v1/completions", json=body), 400)
    assert error["param"] == "lora_path" and "'nope'" in error["message"]
    # An adapter unloaded between the server's check and the engine's: reported as `model`.
    monkeypatch.setattr(
        lora_engine, "lora_adapters", lambda: {"sql": "/adapters/sql", "gone": "/adapters/gone"}
    )
    for route, body in (
        ("/v1/completions", {"model": "gone", "prompt": "a"}),
        ("/v1/chat/completions", {"model": "toy:gone", "messages": USER}),
        ("/v1/responses", {"model": "gone", "input": "a"}),
    ):
        error = error_of(lora_http.post(route, json=body), 400)
        assert error["param"] == "model" and "'gone'" in error["message"], route


# /generate.


def test_generate_passes_lora_path_to_the_engine(lora_http: TestClient, lora_engine: Any) -> None:
    body = {"text": "a", "lora_path": "sql", "sampling_params": {"max_new_tokens": 2}}
    assert lora_http.post("/generate", json=body).status_code == 200
    assert lora_engine.received[-1].lora_path == "sql"


def test_a_generate_batch_sends_each_prompt_its_own_adapter(
    lora_http: TestClient, lora_engine: Any
) -> None:
    body = {
        "text": ["a", "b", "c"],
        "rid": ["lora-a", "lora-b", "lora-c"],
        "lora_path": ["sql", None, "sql"],
        "sampling_params": {"max_new_tokens": 2},
    }
    assert lora_http.post("/generate", json=body).status_code == 200
    sent = {r.rid: r.lora_path for r in lora_engine.received[-3:]}
    assert sent == {"lora-a": "sql", "lora-b": None, "lora-c": "sql"}


def test_generate_with_an_unknown_adapter_is_a_400_naming_lora_path(
    lora_http: TestClient,
) -> None:
    body = {"text": ["a", "b"], "lora_path": ["sql", "nope"]}
    error = error_of(lora_http.post("/generate", json=body), 400)
    assert error["param"] == "lora_path" and "'nope'" in error["message"]
