"""The command line, the launcher (on a stand-in runtime) and composing create_app."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import server_fake_engine as fake  # loaded by conftest.py
from starlette.testclient import TestClient

from radixlm.server import ServerConfig, create_app, launcher
from radixlm.server import cli as cli_module
from radixlm.server.cli import build_parser, engine_kwargs, main, serve_main, server_config


def test_serve_without_a_model_path_or_builtin_model_says_what_to_pass(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    install_runtime(monkeypatch, types.ModuleType("radixlm.runtime"))
    assert serve_main([]) == 2
    message = capsys.readouterr().err
    assert "--model-path" in message and "built-in default model" in message


def test_serve_without_a_model_path_serves_the_builtin_model(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    built: dict[str, Any] = {}

    def engine_factory(model_path: str, **kwargs: Any) -> Any:
        built.update(model_path=model_path)
        return fake.FakeEngine(tokenizer)

    runtime = types.ModuleType("radixlm.runtime")
    runtime.Engine = engine_factory  # type: ignore[attr-defined]
    runtime.builtin_model_path = lambda: "/builtin/demo"  # type: ignore[attr-defined]
    runtime.BUILTIN_MODEL_NAME = "radixlm-demo"  # type: ignore[attr-defined]
    install_runtime(monkeypatch, runtime)
    served: dict[str, Any] = {}
    install_uvicorn(monkeypatch, lambda server: served.update(app=server.config.app))
    assert serve_main([]) == 0
    assert built == {"model_path": "/builtin/demo"}
    assert served["app"].state.radixlm.served_model_name == "radixlm-demo"


def test_radixlm_without_a_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main([])
    assert raised.value.code == 0
    assert "serve" in capsys.readouterr().out


def test_python_dash_m_shows_the_serve_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "radixlm.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for flag in (
        "--max-queued-requests",
        "--tool-call-parser",
        "--json-whitespace",
        "--api-key",
        "--strict-constraints",
        "--max-constraint-bytes",
        "--allow-media-urls",
        "--media-url-allowlist",
    ):
        assert flag in result.stdout


def test_flags_mirror_sglang_and_reach_the_engine_only_when_given() -> None:
    args = build_parser().parse_args(
        [
            "--model-path", "m", "--page-size", "16", "--schedule-policy", "fcfs",
            "--disable-radix-cache", "--max-queued-requests", "8", "--json-whitespace", "any",
            "--enable-custom-logit-processor",
        ]
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "page_size": 16,
        "schedule_policy": "fcfs",
        "disable_radix_cache": True,
        "max_queued_requests": 8,
        "json_whitespace": "any",
        "enable_custom_logit_processor": True,
        "engine_process": True,
        "engine_restarts": 3,
    }


def test_grammar_flags_reach_the_engine() -> None:
    args = build_parser().parse_args(
        ["--grammar-backend", "llguidance", "--strict-constraints", "--max-constraint-bytes",
         "4096", "--grammar-compile-timeout", "2.5"]
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "grammar_backend": "llguidance",
        "strict_constraints": True,
        "max_constraint_bytes": 4096,
        "grammar_compile_timeout": 2.5,
        "engine_process": True,
        "engine_restarts": 3,
    }
    # The engine's defaults apply, but for where it runs.
    assert engine_kwargs(build_parser().parse_args([])) == {
        "engine_process": True,
        "engine_restarts": 3,
    }


def test_json_schema_dir_reaches_the_engine_as_an_absolute_directory(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "schemas").mkdir()
    monkeypatch.chdir(tmp_path)  # engine processes and replicas may start elsewhere
    args = build_parser().parse_args(["--json-schema-dir", "schemas"])
    assert engine_kwargs(args)["json_schema_dir"] == str((tmp_path / "schemas").resolve())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--json-schema-dir", "absent"])
    assert "not a directory: absent" in capsys.readouterr().err


def test_hub_revision_and_download_dir_reach_the_engine() -> None:
    args = build_parser().parse_args(
        ["--model-path", "org/name", "--revision", "r", "--download-dir", "d"]
    )
    assert engine_kwargs(args) == {
        "revision": "r",
        "download_dir": "d",
        "engine_process": True,
        "engine_restarts": 3,
    }


def test_media_flags_reach_the_engine() -> None:
    args = build_parser().parse_args(
        ["--allow-media-urls", "--media-url-allowlist", "images.internal", "10.0.0.0/8",
         "--allowed-local-media-path", "/data/images", "--max-media-bytes", "1048576",
         "--media-fetch-timeout", "2.5", "--max-media-redirects", "0",
         "--max-image-pixels", "1000000", "--mm-encoder-cache-size", "0"]
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "allow_media_urls": True,
        "media_url_allowlist": ["images.internal", "10.0.0.0/8"],
        "allowed_local_media_path": "/data/images",
        "max_media_bytes": 1048576,
        "media_fetch_timeout": 2.5,
        "max_media_redirects": 0,
        "max_image_pixels": 1000000,
        "mm_encoder_cache_size": 0,
        "engine_process": True,
        "engine_restarts": 3,
    }


def test_media_flags_are_the_engines_keywords() -> None:
    config = pytest.importorskip("radixlm.runtime.config")
    media = {
        "allow_media_urls",
        "media_url_allowlist",
        "allowed_local_media_path",
        "max_media_bytes",
        "media_fetch_timeout",
        "max_media_redirects",
        "max_image_pixels",
        "mm_encoder_cache_size",
    }
    assert media <= set(cli_module.ENGINE_FLAGS) and media <= set(config.ENGINE_KWARGS)


def stand_in_builtins(vision_path: Callable[[], str]) -> types.ModuleType:
    """A stand-in radixlm.runtime with both built-in models, recording the engine it builds."""
    runtime = types.ModuleType("radixlm.runtime")
    runtime.built = {}  # type: ignore[attr-defined]

    def engine_factory(model_path: str, **kwargs: Any) -> Any:
        runtime.built.update(model_path=model_path)  # type: ignore[attr-defined]
        return runtime.make_engine()  # type: ignore[attr-defined]

    runtime.Engine = engine_factory  # type: ignore[attr-defined]
    runtime.BUILTIN_MODEL_NAME = "radixlm-demo"  # type: ignore[attr-defined]
    runtime.builtin_model_path = lambda: "/builtin/demo"  # type: ignore[attr-defined]
    runtime.BUILTIN_VISION_MODEL_NAME = "radixlm-demo-vision"  # type: ignore[attr-defined]
    runtime.builtin_vision_model_path = vision_path  # type: ignore[attr-defined]
    return runtime


def test_model_path_naming_the_builtin_vision_model_serves_it(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any, tmp_path: Any
) -> None:
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    runtime = stand_in_builtins(lambda: "/builtin/vision")
    runtime.make_engine = lambda: fake.FakeEngine(tokenizer, vision=True)  # type: ignore[attr-defined]
    install_runtime(monkeypatch, runtime)
    served: dict[str, Any] = {}
    install_uvicorn(monkeypatch, lambda server: served.update(app=server.config.app))
    assert serve_main(["--model-path", "radixlm-demo-vision"]) == 0
    assert runtime.built == {"model_path": "/builtin/vision"}  # type: ignore[attr-defined]
    assert served["app"].state.radixlm.served_model_name == "radixlm-demo-vision"
    # --served-model-name still wins.
    assert serve_main(["--model-path", "radixlm-demo-vision", "--served-model-name", "v"]) == 0
    assert served["app"].state.radixlm.served_model_name == "v"


def test_a_directory_named_like_a_builtin_model_is_served_as_a_path(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any, tmp_path: Any
) -> None:
    (tmp_path / "radixlm-demo-vision").mkdir()
    monkeypatch.chdir(tmp_path)
    runtime = stand_in_builtins(lambda: "/builtin/vision")
    runtime.make_engine = lambda: fake.FakeEngine(tokenizer)  # type: ignore[attr-defined]
    install_runtime(monkeypatch, runtime)
    install_uvicorn(monkeypatch, lambda server: None)
    assert serve_main(["--model-path", "radixlm-demo-vision"]) == 0
    assert runtime.built == {"model_path": "radixlm-demo-vision"}  # type: ignore[attr-defined]


def test_a_missing_builtin_vision_model_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    monkeypatch.chdir(tmp_path)

    def missing() -> str:
        raise FileNotFoundError("the built-in vision model is missing from /x; rebuild it")

    install_runtime(monkeypatch, stand_in_builtins(missing))
    assert serve_main(["--model-path", "radixlm-demo-vision"]) == 2
    message = capsys.readouterr().err
    assert "'radixlm-demo-vision' is not available" in message and "rebuild it" in message


def test_engine_mode_flags_choose_a_thread_or_a_restarted_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["--engine-mode", "thread", "--engine-restarts", "0"])
    assert engine_kwargs(args) == {"engine_process": False, "engine_restarts": 0}
    assert (
        engine_kwargs(build_parser().parse_args(["--engine-restarts", "7"]))["engine_restarts"] == 7
    )
    for bad in (["--engine-mode", "fork"], ["--engine-restarts", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    assert "must be 0 or more" in capsys.readouterr().err


def test_engine_flag_choices_are_the_ones_the_runtime_declares(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from radixlm.server import launcher

    declared = {"grammar_backend": ("auto", "xgrammar"), "quantization_group_size": (32, 64)}
    monkeypatch.setattr(launcher, "engine_choices", lambda: declared)
    parser = build_parser()
    assert parser.parse_args(["--grammar-backend", "xgrammar"]).grammar_backend == "xgrammar"
    assert parser.parse_args(["--quantization-group-size", "64"]).quantization_group_size == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["--grammar-backend", "guidance"])
    assert "invalid choice" in capsys.readouterr().err
    # Without the runtime installed there is nothing to offer: the engine checks the value.
    monkeypatch.setattr(launcher, "engine_choices", lambda: {})
    assert build_parser().parse_args(["--grammar-backend", "guidance"]).grammar_backend


def test_server_flags_build_the_server_config(tmp_path: Any) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    args = build_parser().parse_args(
        ["--model-path", "m", "--port", "8001", "--api-key", "k", "--served-model-name", "s",
         "--chat-template", str(template), "--tool-call-parser", "llama3", "--enable-metrics"]
    )  # fmt: skip
    config = server_config(args)
    assert (config.port, config.api_key, config.served_model_name) == (8001, "k", "s")
    assert config.chat_template == "{{ messages[0].content }}"
    assert config.tool_call_parser == "llama3" and config.enable_metrics


def test_max_request_bytes_flag_sets_the_body_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert server_config(build_parser().parse_args([])).max_request_bytes == 32 * 1024 * 1024
    args = build_parser().parse_args(["--max-request-bytes", "1048576"])
    assert server_config(args).max_request_bytes == 1048576
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-request-bytes", "0"])
    assert "must be a positive number of bytes" in capsys.readouterr().err


def install_runtime(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> None:
    monkeypatch.setitem(sys.modules, "radixlm.runtime", module)


def test_launcher_explains_a_missing_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    install_runtime(monkeypatch, types.ModuleType("radixlm.runtime"))
    with pytest.raises(launcher.LaunchError, match="radixlm-runtime"):
        launcher.build_engine("some/model", {})


def install_engine(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[], Any], built: dict[str, Any]
) -> None:
    """A stand-in radixlm.runtime whose Engine records its arguments and returns `make()`."""

    def engine_factory(model_path: str, **kwargs: Any) -> Any:
        built.update(model_path=model_path, kwargs=kwargs)
        return make()

    runtime = types.ModuleType("radixlm.runtime")
    runtime.Engine = engine_factory  # type: ignore[attr-defined]
    install_runtime(monkeypatch, runtime)


def install_uvicorn(monkeypatch: pytest.MonkeyPatch, serve: Callable[[Any], None]) -> None:
    """uvicorn.Server.run replaced by `serve(server)` (which marks the server started)."""
    uvicorn = pytest.importorskip("uvicorn")

    def run(self: Any, sockets: Any = None) -> None:
        self.started = True
        serve(self)

    monkeypatch.setattr(uvicorn.Server, "run", run)


def test_serve_builds_the_runtime_engine_and_runs_uvicorn(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    built: dict[str, Any] = {}
    install_engine(monkeypatch, lambda: fake.FakeEngine(tokenizer), built)
    served: dict[str, Any] = {}
    install_uvicorn(monkeypatch, lambda server: served.update(config=server.config))
    status = serve_main(["--model-path", "/models/x", "--port", "8123", "--page-size", "4"])
    assert status == 0
    assert built == {
        "model_path": "/models/x",
        "kwargs": {"page_size": 4, "engine_process": True, "engine_restarts": 3},
    }
    config = served["config"]
    assert config.port == 8123 and config.host == "127.0.0.1"
    assert config.app.state.radixlm.config.port == 8123
    banner = capsys.readouterr().out
    assert "curl http://127.0.0.1:8123/generate" in banner and "OpenAI(" in banner


def test_serve_exits_with_status_1_once_the_engine_is_dead_for_good(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = fake.FakeEngine(tokenizer)
    engine.failed = False
    engine.shut_down = False
    engine.shutdown = lambda: setattr(engine, "shut_down", True)
    install_engine(monkeypatch, lambda: engine, {})

    def serve(server: Any) -> None:
        engine.failed = True  # its process died with no restart left
        deadline = time.monotonic() + 10
        while not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.01)

    install_uvicorn(monkeypatch, serve)
    assert serve_main(["--model-path", "/models/x"]) == 1
    assert engine.shut_down
    assert "no restart left" in caplog.text


def test_create_app_refuses_what_is_not_an_engine() -> None:
    with pytest.raises(TypeError, match="EngineClient"):
        create_app(object(), ServerConfig())  # type: ignore[arg-type]


def test_an_app_takes_routes_of_its_own(tokenizer: Any) -> None:
    app = create_app(fake.FakeEngine(tokenizer), ServerConfig())

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    with TestClient(app) as client:
        assert client.get("/hello").json() == {"hello": "world"}
        answer = client.post("/generate", json={"text": "<<say:composed:say>>"})
        assert answer.json()["text"] == "composed"


def test_openapi_schema_documents_the_request_bodies(tokenizer: Any) -> None:
    with TestClient(create_app(fake.FakeEngine(tokenizer))) as client:
        schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in body["content"]["application/json"]["schema"]["properties"]
    assert "/generate" in schema["paths"]


@pytest.mark.parametrize(
    "bad",
    [
        {"tool_call_parser": "mistral"},
        {"port": 0},
        {"api_key": ""},
        {"log_level": "loud"},
        {"max_request_bytes": 0},
    ],
)
def test_server_config_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**bad)


def test_dp_size_starts_replicas_behind_the_router(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    asked: dict[str, Any] = {}

    def build_replicas(
        model_path: str, kwargs: dict[str, Any], dp_size: int, policy: str, tracer: Any = None
    ) -> Any:
        assert tracer is None  # no --otlp-traces-endpoint
        asked.update(model_path=model_path, kwargs=kwargs, dp_size=dp_size, policy=policy)
        return fake.FakeEngine(tokenizer)

    monkeypatch.setattr(launcher, "build_replicas", build_replicas)
    install_uvicorn(monkeypatch, lambda server: None)
    argv = ["--model-path", "/m", "--dp-size", "2", "--router-policy", "round_robin"]
    assert serve_main(argv) == 0
    assert asked == {
        "model_path": "/m",
        "kwargs": {"engine_process": True, "engine_restarts": 3},
        "dp_size": 2,
        "policy": "round_robin",
    }
    args = build_parser().parse_args([])
    assert args.dp_size == 1 and args.router_policy == "cache_aware"
    for bad in (["--dp-size", "0"], ["--router-policy", "fastest"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_otlp_traces_endpoint_turns_tracing_on_and_is_off_by_default() -> None:
    args = build_parser().parse_args(["--otlp-traces-endpoint", "http://collector:4318/v1/traces"])
    assert server_config(args).otlp_traces_endpoint == "http://collector:4318/v1/traces"
    assert "otlp_traces_endpoint" not in engine_kwargs(args)
    assert server_config(build_parser().parse_args([])).otlp_traces_endpoint is None


def test_disaggregation_flags_reach_the_engine_with_the_server_host() -> None:
    args = build_parser().parse_args(
        ["--host", "0.0.0.0", "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", "9000", "--disaggregation-transfer-backend", "shm",
         "--disaggregation-transfer-timeout", "5"]
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "disaggregation_mode": "prefill",
        "disaggregation_bootstrap_port": 9000,
        "disaggregation_transfer_backend": "shm",
        "disaggregation_transfer_timeout": 5.0,
        "disaggregation_bootstrap_host": "0.0.0.0",  # where the HTTP server listens
        "engine_process": True,
        "engine_restarts": 3,
    }
    decode = engine_kwargs(build_parser().parse_args(["--disaggregation-mode", "decode"]))
    assert "disaggregation_bootstrap_host" not in decode


def test_disaggregation_combines_with_replicas(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    asked: dict[str, Any] = {}

    def build_replicas(
        model_path: str, kwargs: dict[str, Any], dp_size: int, policy: str, tracer: Any = None
    ) -> Any:
        asked.update(kwargs=kwargs, dp_size=dp_size)
        return fake.FakeEngine(tokenizer)

    monkeypatch.setattr(launcher, "build_replicas", build_replicas)
    install_uvicorn(monkeypatch, lambda server: None)
    argv = ["--model-path", "/m", "--dp-size", "2", "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", "9000"]  # fmt: skip
    assert serve_main(argv) == 0
    assert asked["dp_size"] == 2
    assert asked["kwargs"]["disaggregation_mode"] == "prefill"
    assert asked["kwargs"]["disaggregation_bootstrap_port"] == 9000


def test_ray_serve_pd_flags_reach_the_launcher(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    called: dict[str, Any] = {}

    def ray_serve(model_path: str, config: Any, kwargs: dict[str, Any], **options: Any) -> int:
        called.update(kwargs=kwargs, **options)
        return 0

    monkeypatch.setattr(launcher, "ray_serve", ray_serve)
    argv = ["--model-path", str(tmp_path), "--pd-disaggregation", "--num-prefill-replicas", "2"]
    argv += ["--num-decode-replicas", "3", "--disaggregation-transfer-backend", "shm"]
    assert cli_module.ray_serve_main(argv) == 0
    assert called["pd_replicas"] == (2, 3)
    assert called["transfer_backend"] == "shm"
    assert not any(k.startswith("disaggregation_") for k in called["kwargs"])
    called.clear()
    assert cli_module.ray_serve_main(["--model-path", str(tmp_path)]) == 0
    assert called["pd_replicas"] is None


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--pd-disaggregation", "--disaggregation-mode", "prefill"], "drop --disaggregation-mode"),
        (["--pd-disaggregation", "--disaggregation-bootstrap-port", "9000"], "bootstrap-port"),
        (["--disaggregation-mode", "decode"], "use --pd-disaggregation"),
    ],
)
def test_ray_serve_refuses_a_disaggregation_mode_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
    extra: list[str],
    says: str,
) -> None:
    monkeypatch.setattr(launcher, "ray_serve", lambda *a, **k: pytest.fail("launched"))
    assert cli_module.ray_serve_main(["--model-path", str(tmp_path), *extra]) == 2
    assert says in capsys.readouterr().err
