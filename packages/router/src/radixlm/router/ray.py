"""radixlm on a Ray cluster: Ray Serve deployments, routed by radixlm.router's policies.

Needs the `ray` extra (`pip install "radixlm-router[ray]"`). `build_app(...)` returns a Ray
Serve application of two deployments:

- `EngineReplica`: one radixlm engine per replica (`num_replicas`, or Ray Serve's
  `autoscaling_config`; `ray_actor_options` for the GPUs / CPUs each takes). Its request router
  is `RadixlmRequestRouter`, a `ray.serve.request_router.RequestRouter` whose
  `choose_replicas` applies a `radixlm.router` policy (`cache_aware` by default) to the
  request's routing key, with each replica's queue length (Ray's own probe / cache) as its
  load. Ray Serve health-checks each replica (`check_health`: the engine serves) and restarts
  one that fails.
- `Ingress`: the HTTP routes, built by the caller's `app_factory(engine_client)` — radixlm's
  own server (`radixlm ray-serve` passes `radixlm.server.create_app`), so the OpenAI and
  native routes, streaming included, are those of one `radixlm serve`. `RayEngineClient` is
  the engine they talk to: it computes each request's routing key (token ids, with the
  replicas' tokenizer) and streams the chosen replica's chunks back. A replica that dies under
  a request ends it with `EngineUnavailable` (a 503 with `Retry-After`); new requests go to
  the others.

This package does not import the runtime or the server (the dependency graph): the engine
class and the app factory are passed in (`engine_factory`, `app_factory`) and travel to the
replicas by reference.

Each ingress replica routes with its own trees; with several ingress replicas each one's trees
record what it sent (approximate, as all the trees are).

`build_pd_app(...)` runs prefill/decode disaggregation on Ray Serve: two pools of
`EngineReplica` (`radixlm-prefill`, engines with `disaggregation_mode="prefill"`, routed
cache-aware; `radixlm-decode`, `disaggregation_mode="decode"`, routed to the shortest queue)
behind the same ingress, whose `RayPDEngineClient` pairs a prefill and a decode replica per
request: it picks the bootstrap room, asks a prefill replica (`EngineReplica.prefill`), which
answers first with its bootstrap endpoint (its node's address, a free port) and then computes
the prompt, and streams the decode replica's answer. A prefill half that fails ends the decode
half and is the client's error; a decode half that ends, fails or is aborted ends the prefill
half too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ray import serve
from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from radixlm.router.keys import prompt_key
from radixlm.router.router import Router
from radixlm.sampling import EngineUnavailable, FinishReason, GenerateChunk, GenerateRequest

logger = logging.getLogger("radixlm.router.ray")

#: The keyword argument of `EngineReplica.generate` that carries the routing key.
ROUTING_KEY = "routing_key"
#: Tries of a request whose replica died before it answered anything.
_ATTEMPTS = 2
#: Seconds between refreshes of the ingress's copy of a replica's server info.
_INFO_REFRESH_S = 1.0


class RadixlmRequestRouter(FIFOMixin, RequestRouter):
    """A Ray Serve request router that picks replicas with a radixlm.router policy.

    Configure it with `RequestRouterConfig(request_router_class=RadixlmRequestRouter,
    request_router_kwargs={"policy": "cache_aware", ...policy options})`; requests carry
    their key as the `routing_key` keyword argument (`RayEngineClient` sends it)."""

    def initialize_state(self, policy: str = "cache_aware", **options: Any) -> None:
        self._radix = Router(policy, (), **options)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        key: Sequence[int] = []
        namespace = None
        if pending_request is not None:
            key = pending_request.kwargs.get(ROUTING_KEY) or []
            namespace = pending_request.kwargs.get("namespace")
        queue_lens: dict[str, int | None] = {}
        cache = getattr(self, "_replica_queue_len_cache", None)
        for replica_id, replica in by_id.items():
            queue_lens[replica_id] = cache.get(replica.replica_id) if cache is not None else None
        ranks = self._radix.rank(list(by_id), key, queue_lens, namespace)
        return [[by_id[i] for i in rank] for rank in ranks]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._radix.remove(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id.to_full_id_str() for r in replicas}
        for replica in self._radix.replicas:
            if replica.id not in current:
                self._radix.remove(replica.id)


class EngineReplica:
    """One radixlm engine (`engine_factory(model_path, **engine_kwargs)`, i.e.
    `radixlm.runtime.Engine`) as a Ray Serve replica."""

    def __init__(
        self, engine_factory: Callable[..., Any], model_path: str, engine_kwargs: dict[str, Any]
    ) -> None:
        kwargs = dict(engine_kwargs)
        if kwargs.get("disaggregation_mode") == "prefill":
            # Decode replicas on other nodes reach this one at its node's address.
            kwargs.setdefault("disaggregation_bootstrap_host", _node_address())
        self.engine = engine_factory(model_path, **kwargs)

    async def generate(
        self, request: GenerateRequest, routing_key: Any = None, namespace: Any = None
    ) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.engine.generate(request):
            yield chunk

    async def prefill(
        self, request: GenerateRequest, routing_key: Any = None, namespace: Any = None
    ) -> AsyncIterator[tuple[str, int] | GenerateChunk]:
        """The prefill half of a disaggregated request (a replica whose engine has
        `disaggregation_mode="prefill"`): first this replica's bootstrap endpoint, `(host,
        port)`, for the decode half; then the chunks of its own answer (the first token), with
        `request`'s bootstrap fields naming this endpoint. `request` carries its room(s)."""
        info = self.engine.server_info().get("disaggregation") or {}
        if info.get("mode") != "prefill":
            raise RuntimeError("this replica's engine is not a prefill engine")
        host, port = str(info["bootstrap_host"]), int(info["bootstrap_port"])
        yield (host, port)
        async for chunk in self.engine.generate(with_endpoint(request, host, port)):
            yield chunk

    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.engine.model_info()
        return info

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.engine.server_info()
        return info

    async def flush_cache(self) -> bool:
        return bool(await self.engine.flush_cache())

    def pid(self) -> int:
        """This replica's process (tests kill it)."""
        import os

        return os.getpid()

    def check_health(self) -> None:
        """Ray Serve's health check: raising marks the replica unhealthy (it is restarted)."""
        if not getattr(self.engine, "healthy", True):
            raise RuntimeError("the radixlm engine of this replica is not serving")

    def __del__(self) -> None:
        stop = getattr(getattr(self, "engine", None), "shutdown", None)
        if callable(stop):
            stop()


class RayEngineClient:
    """The engine the HTTP routes see: every request goes to an `EngineReplica` through a
    Ray Serve deployment handle, with its routing key."""

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        model_info: dict[str, Any],
        server_info: dict[str, Any] | None = None,
    ) -> None:
        self.handle = handle
        self._tokenizer = tokenizer
        self._model_info = model_info
        self._streams: dict[str, Any] = {}
        self._aborted: set[str] = set()
        self._info: dict[str, Any] = dict(server_info or {})
        self._info_at = 0.0
        #: The ingress replica's event loop (server_info may be called from other threads).
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):  # built outside a loop (tests)
            self._loop = asyncio.get_running_loop()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    healthy = True  # Ray Serve replaces unhealthy replicas; the ingress itself serves

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        import ray.exceptions
        from ray.serve.exceptions import RequestCancelledError

        key = await self._routing_key(request)
        rid = str(request.rid)
        last: dict[int, GenerateChunk] = {}
        attempts = 0
        while True:
            attempts += 1
            stream = self.handle.options(stream=True).generate.remote(
                request, routing_key=key, namespace=request.lora_path
            )
            self._streams[rid] = stream
            ended = False  # the replica's stream ran to its end (or was cancelled already)
            try:
                async for chunk in stream:
                    last[chunk.index] = chunk
                    yield chunk
                ended = True
                return
            except RequestCancelledError:
                ended = True
                if rid not in self._aborted:
                    raise
                for chunk in _ended_by_abort(last):
                    yield chunk
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
                ended = True  # its replica is gone: nothing left to cancel
                # Nothing sent yet: the request can go to another replica, once.
                if not last and attempts < _ATTEMPTS:
                    logger.warning("a replica died before answering %s; retrying", rid)
                    continue
                raise EngineUnavailable(
                    f"the replica serving this request died ({type(error).__name__}); retry: "
                    "the others serve, and Ray Serve restarts it"
                ) from None
            finally:
                self._streams.pop(rid, None)
                self._aborted.discard(rid)
                if not ended:  # the client left mid-stream: the replica stops the request
                    stream.cancel()

    async def _routing_key(self, request: GenerateRequest) -> list[int]:
        """The request's token ids for the routing policy (its text tokenized off the loop)."""
        flat = [i for i in request.input_ids or () if isinstance(i, int)]
        text = request.text if isinstance(request.text, str) else None
        if flat or text is None:
            return prompt_key(flat)
        return await asyncio.to_thread(prompt_key, None, text, self._tokenizer)

    async def abort(self, rid: str) -> bool:
        stream = self._streams.get(rid)
        if stream is None:
            return False
        self._aborted.add(rid)
        stream.cancel()
        return True

    async def flush_cache(self) -> bool:
        """Not through one handle: it reaches one replica, not all (False: not flushed)."""
        return False

    def model_info(self) -> dict[str, Any]:
        return dict(self._model_info)

    def server_info(self) -> dict[str, Any]:
        """One replica's figures (refreshed in the background at most every second)."""
        now = time.monotonic()
        if now - self._info_at >= _INFO_REFRESH_S and self._loop is not None:
            self._info_at = now
            asyncio.run_coroutine_threadsafe(self._refresh_info(), self._loop)
        return {**self._info, "ray_serve": True}

    async def _refresh_info(self) -> None:
        try:
            self._info = dict(await self.handle.server_info.remote())
        except Exception as error:  # a replica restarting: keep the last figures
            logger.debug("server_info from a replica failed: %s", error)


def _ended_by_abort(last: dict[int, GenerateChunk]) -> list[GenerateChunk]:
    """After an abort: the last chunk of each sequence that had not finished, ended with
    finish reason abort."""
    return [
        chunk._replace(finish_reason=FinishReason(type="abort"))
        for chunk in last.values()
        if chunk.finish_reason is None
    ]


def with_endpoint(request: GenerateRequest, host: str, port: int) -> GenerateRequest:
    """`request` with its bootstrap host and port naming a prefill engine (one per prompt in a
    batch; its rooms are kept)."""
    if request.is_single:
        return request.model_copy(update={"bootstrap_host": host, "bootstrap_port": port})
    size = request.batch_size
    return request.model_copy(
        update={"bootstrap_host": [host] * size, "bootstrap_port": [port] * size}
    )


def with_rooms(request: GenerateRequest) -> GenerateRequest:
    """`request` with fresh bootstrap rooms (one per prompt, distinct), which pair its prefill
    and decode halves."""
    if request.is_single:
        return request.model_copy(update={"bootstrap_room": random.getrandbits(63)})
    rooms: set[int] = set()
    while len(rooms) < request.batch_size:
        rooms.add(random.getrandbits(63))
    return request.model_copy(update={"bootstrap_room": list(rooms)})


class RayPDEngineClient(RayEngineClient):
    """The engine the HTTP routes see under prefill/decode disaggregation: each request goes
    to a prefill replica and a decode replica (two Ray Serve deployments), with the same
    bootstrap room; the client gets the decode replica's chunks."""

    def __init__(
        self,
        prefill: Any,
        decode: Any,
        tokenizer: Any,
        model_info: dict[str, Any],
        server_info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(decode, tokenizer, model_info, server_info)
        self.prefill_handle = prefill

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        import ray.exceptions
        from ray.serve.exceptions import RequestCancelledError

        key = await self._routing_key(request)
        rid = str(request.rid)
        request = with_rooms(request)
        prefill = self.prefill_handle.options(stream=True).prefill.remote(
            request, routing_key=key, namespace=request.lora_path
        )
        died = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
        try:
            host, port = await prefill.__anext__()
        except died as error:
            raise _prefill_died(error) from None
        failed = asyncio.ensure_future(_failure_of(prefill))
        decode = self.handle.options(stream=True).generate.remote(
            with_endpoint(request, host, port), routing_key=key, namespace=request.lora_path
        )
        self._streams[rid] = decode
        last: dict[int, GenerateChunk] = {}
        chunks = decode.__aiter__()
        ended = False  # the decode half's stream ran to its end
        try:
            while True:
                following = asyncio.ensure_future(chunks.__anext__())
                if not failed.done():
                    await asyncio.wait({following, failed}, return_when=asyncio.FIRST_COMPLETED)
                failure = failed.result() if failed.done() else None
                if failure is not None and not following.done():
                    # The prefill half failed while the decode half waits: its error is the
                    # answer (as the HTTP router's PD mode ends a stream with it).
                    following.cancel()
                    decode.cancel()
                    raise failure
                try:
                    chunk = await following
                except StopAsyncIteration:
                    ended = True
                    return
                last[chunk.index] = chunk
                yield chunk
        except RequestCancelledError:
            if rid not in self._aborted:
                raise
            for chunk in _ended_by_abort(last):
                yield chunk
        except died as error:
            raise EngineUnavailable(
                f"the decode replica serving this request died ({type(error).__name__}); retry: "
                "the others serve, and Ray Serve restarts it"
            ) from None
        finally:
            self._streams.pop(rid, None)
            self._aborted.discard(rid)
            if not ended:  # the client left, or an error: the decode replica stops too
                decode.cancel()
            if not failed.done():  # the prefill half has nothing left to do for the client
                prefill.cancel()
                failed.cancel()


async def _failure_of(prefill: Any) -> BaseException | None:
    """Read the rest of a prefill half's answer: the error it raised, or None once it ended
    (or was cancelled)."""
    import ray.exceptions
    from ray.serve.exceptions import RequestCancelledError

    try:
        async for _chunk in prefill:
            pass
    except RequestCancelledError:
        return None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
        return _prefill_died(error)
    except Exception as error:  # its own error: a refused request, a failed transfer
        return error
    return None


def _prefill_died(error: BaseException) -> EngineUnavailable:
    return EngineUnavailable(
        f"the prefill replica of this request died ({type(error).__name__}); retry"
    )


def _node_address() -> str:
    """The address of the Ray node this process runs on."""
    import ray.util

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


class Ingress:
    """The HTTP routes of one `radixlm serve`, over the engine replicas (with `prefill`, the
    prefill pool of prefill/decode disaggregation, `engine` being the decode pool)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, engine: Any, app_factory: Callable[[Any], Any], prefill: Any = None
    ) -> None:
        tokenizer = await engine.tokenizer.remote()
        model_info = await engine.model_info.remote()
        server_info = await engine.server_info.remote()
        if prefill is None:
            self.client = RayEngineClient(engine, tokenizer, model_info, server_info)
        else:
            self.client = RayPDEngineClient(prefill, engine, tokenizer, model_info, server_info)
        self.app_factory = app_factory

    def __serve_build_asgi_app__(self) -> Any:
        return self.app_factory(self.client)


def build_app(
    model_path: str,
    engine_factory: Callable[..., Any],
    app_factory: Callable[[Any], Any],
    engine_kwargs: dict[str, Any] | None = None,
    num_replicas: int | str = 1,
    ray_actor_options: dict[str, Any] | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    policy: str = "cache_aware",
    policy_options: dict[str, Any] | None = None,
    max_ongoing_requests: int = 256,
) -> Any:
    """The Ray Serve application (pass it to `serve.run`). `num_replicas` may be "auto" with
    an `autoscaling_config` (Ray Serve's own)."""
    from ray.serve.config import RequestRouterConfig

    from radixlm.router.policies import make_policy

    make_policy(policy, **(policy_options or {}))  # a bad policy fails here, not on a replica
    router_config = RequestRouterConfig(
        request_router_class="radixlm.router.ray:RadixlmRequestRouter",  # type: ignore[arg-type]
        request_router_kwargs={"policy": policy, **(policy_options or {})},
    )
    options: dict[str, Any] = {
        "name": "radixlm-engine",
        "request_router_config": router_config,
        "max_ongoing_requests": max_ongoing_requests,
        "ray_actor_options": ray_actor_options or {"num_cpus": 1},
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    replica = serve.deployment(**options)(EngineReplica)
    ingress = serve.deployment(name="radixlm-ingress", ray_actor_options={"num_cpus": 0})(
        serve.ingress()(Ingress)
    )
    return ingress.bind(
        replica.bind(engine_factory, model_path, dict(engine_kwargs or {})), app_factory
    )


def build_pd_app(
    model_path: str,
    engine_factory: Callable[..., Any],
    app_factory: Callable[[Any], Any],
    engine_kwargs: dict[str, Any] | None = None,
    num_prefill_replicas: int = 1,
    num_decode_replicas: int = 1,
    ray_actor_options: dict[str, Any] | None = None,
    policy: str = "cache_aware",
    policy_options: dict[str, Any] | None = None,
    decode_policy: str = "shortest_queue",
    transfer_backend: str = "tcp",
    max_ongoing_requests: int = 256,
) -> Any:
    """The Ray Serve application of prefill/decode disaggregation (pass it to `serve.run`):
    `num_prefill_replicas` prefill engines (routed by `policy`, cache-aware by default) and
    `num_decode_replicas` decode engines (routed by `decode_policy`) behind one ingress, the
    K/V going over `transfer_backend` (`tcp` between any two nodes; `shm` only when every
    replica is on one host). `engine_kwargs` are both pools' (without the disaggregation
    ones, which this sets: each prefill replica listens on its node's address, on a free
    port)."""
    from ray.serve.config import RequestRouterConfig

    from radixlm.router.policies import make_policy

    kwargs = dict(engine_kwargs or {})
    allowed = {"disaggregation_transfer_timeout"}
    taken = sorted(k for k in kwargs if k.startswith("disaggregation_") and k not in allowed)
    if taken:
        raise ValueError(
            f"build_pd_app sets the disaggregation keywords of each pool itself: drop "
            f"{', '.join(taken)} (give transfer_backend instead)"
        )
    for name, count in (("prefill", num_prefill_replicas), ("decode", num_decode_replicas)):
        if count < 1:
            raise ValueError(f"num_{name}_replicas must be at least 1; got {count}")
    make_policy(policy, **(policy_options or {}))  # a bad policy fails here, not on a replica
    make_policy(decode_policy)

    def pool(name: str, count: int, routing: dict[str, Any], mode: str) -> Any:
        options: dict[str, Any] = {
            "name": name,
            "num_replicas": count,
            "max_ongoing_requests": max_ongoing_requests,
            "ray_actor_options": ray_actor_options or {"num_cpus": 1},
            "request_router_config": RequestRouterConfig(
                request_router_class="radixlm.router.ray:RadixlmRequestRouter",  # type: ignore[arg-type]
                request_router_kwargs=routing,
            ),
        }
        pool_kwargs = {
            **kwargs,
            "disaggregation_mode": mode,
            "disaggregation_transfer_backend": transfer_backend,
        }
        if mode == "prefill":
            pool_kwargs["disaggregation_bootstrap_port"] = 0  # several may share a node
        return serve.deployment(**options)(EngineReplica).bind(
            engine_factory, model_path, pool_kwargs
        )

    prefill = pool(
        "radixlm-prefill",
        num_prefill_replicas,
        {"policy": policy, **(policy_options or {})},
        "prefill",
    )
    decode = pool("radixlm-decode", num_decode_replicas, {"policy": decode_policy}, "decode")
    ingress = serve.deployment(name="radixlm-ingress", ray_actor_options={"num_cpus": 0})(
        serve.ingress()(Ingress)
    )
    return ingress.bind(decode, app_factory, prefill)
