"""DataParallelEngine: N engine replicas behind one engine interface, routed by a policy.

    replicas = [Engine(path, engine_process=True) for _ in range(2)]
    engine = DataParallelEngine(replicas, "cache_aware")
    app = create_app(engine, ServerConfig())       # radixlm serve --dp-size 2 does this

Each replica is anything with the server's `EngineClient` members (`generate(GenerateRequest)`
as an async iterator, `abort`, `flush_cache`, `model_info`, `server_info`, `tokenizer`, and
optionally `healthy`, `failed`, `beam_search`, `shutdown`, and the LoRA members
`load_lora_adapter` / `unload_lora_adapter` / `lora_adapters`, passed to every replica); so is
this object, and the HTTP API
in front of it is the one of a single replica. A request's key is its prompt's token ids
(`input_ids`, or its text encoded with the replicas' tokenizer — the tokens their caches see;
see `radixlm.router.keys`). A replica that is not healthy is out of routing until it is again
(its engine process restarts): requests in flight there end with its `EngineUnavailable` (a
503 the client may retry), new ones go to the others.

With `follow_bootstrap_room` (the replicas of a prefill server of prefill/decode
disaggregation, as SGLang's `follow_bootstrap_room` load balancing), a request with a
`bootstrap_room` goes to replica `room % N`, the one decode engines register that room at;
when that replica is down, the request fails (a 503) rather than go where no decode engine
will look for it.

Given an OpenTelemetry `tracer_provider`, each routing decision is a span (`route`, a child
of the span current where the request is routed, e.g. the server's HTTP span) naming the
replica, the policy, its reason and how many prompt tokens the chosen replica's tree
matched; the replica then runs in that same trace context. Without one, nothing of
OpenTelemetry is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from radixlm.router._version import __version__
from radixlm.router.keys import prompt_key
from radixlm.router.policies import CacheAwareDecision, Policy
from radixlm.router.router import NoReplicaAvailable, Router
from radixlm.sampling import (
    EmbeddingOutput,
    EmbeddingRequest,
    EngineUnavailable,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
)

#: Seconds between reads of the replicas' load (at most; read when routing).
_REFRESH_S = 0.05
#: A text prompt longer than this many characters is tokenized off the event loop.
_INLINE_TEXT_CHARS = 2048


class DataParallelEngine:
    """Replicas behind one `EngineClient`; `router` picks the replica of each request."""

    def __init__(
        self,
        replicas: Sequence[Any],
        policy: Policy | str = "cache_aware",
        *,
        tokenizer: Any = None,
        match_on: str = "tokens",
        tracer_provider: Any = None,
        follow_bootstrap_room: bool = False,
        **policy_options: Any,
    ) -> None:
        """`match_on="tokens"` keys requests by token ids (the tokenizer is the first
        replica's unless given); `"text"` by the prompt text's bytes (a chat, which the server
        sends as token ids, is still keyed by them). `tracer_provider`: an OpenTelemetry
        TracerProvider for the routing spans (None: no spans). `follow_bootstrap_room`: a
        request with a `bootstrap_room` goes to replica room % N (see the module)."""
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        if match_on not in ("tokens", "text"):
            raise ValueError(f"match_on must be 'tokens' or 'text'; got {match_on!r}")
        self.replicas = list(replicas)
        self.router = Router(policy, [str(i) for i in range(len(self.replicas))], **policy_options)
        self.match_on = match_on
        self.follow_bootstrap_room = follow_bootstrap_room
        self._tokenizer = tokenizer if tokenizer is not None else self.replicas[0].tokenizer
        self._owners: dict[str, int] = {}  # rid -> replica index, while it runs
        self._lock = threading.Lock()
        self._refreshed = 0.0
        self._tracer: Any = (
            None
            if tracer_provider is None
            else tracer_provider.get_tracer("radixlm.router", __version__)
        )

    # --------------------------------------------------------------------------- state

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def healthy(self) -> bool:
        """At least one replica serves."""
        return any(bool(getattr(r, "healthy", True)) for r in self.replicas)

    @property
    def failed(self) -> bool:
        """Every replica is down for good (no restart left)."""
        return all(bool(getattr(r, "failed", False)) for r in self.replicas)

    def refresh(self, force: bool = False) -> None:
        """Read each replica's health (every time: a property read) and load (at most every
        50 ms, unless `force`) into the router."""
        now = time.monotonic()
        loads = force or now - self._refreshed >= _REFRESH_S
        if loads:
            self._refreshed = now
        for index, replica in enumerate(self.replicas):
            replica_id = str(index)
            if not getattr(replica, "healthy", True):
                self.router.mark_down(replica_id)
                continue
            self.router.mark_up(replica_id)
            if loads:
                live = _live_stats(replica)
                self.router.report(
                    replica_id,
                    running=int(live.get("num_running_reqs", 0)),
                    queued=int(live.get("num_queued_reqs", 0)),
                    token_usage=float(live.get("token_usage", 0.0)),
                )

    # ------------------------------------------------------------------------- routing

    async def _key(self, request: GenerateRequest | EmbeddingRequest) -> list[int]:
        input_ids = request.input_ids
        text = request.text
        if input_ids is not None or text is None:
            # A single request's ids are one flat list (the server splits batches).
            flat = [i for i in input_ids or () if isinstance(i, int)]
            return prompt_key(flat)
        assert isinstance(text, str)  # the server sends single requests
        if self.match_on == "text":
            return prompt_key(text=text)
        if len(text) <= _INLINE_TEXT_CHARS:
            return prompt_key(text=text, tokenizer=self._tokenizer)
        return await asyncio.to_thread(prompt_key, None, text, self._tokenizer)

    async def route(self, request: GenerateRequest | EmbeddingRequest) -> int:
        """The index of the replica `request` goes to (a 503 when none serves); a `route`
        span when tracing."""
        if self._tracer is None:
            return await self._route(request, None)
        with self._tracer.start_as_current_span("route") as span:
            return await self._route(request, span)

    async def _route(self, request: GenerateRequest | EmbeddingRequest, span: Any) -> int:
        room = getattr(request, "bootstrap_room", None)
        if self.follow_bootstrap_room and isinstance(room, int):
            return self._route_by_room(room, span)
        key = await self._key(request)
        self.refresh()
        try:
            replica = self.router.choose(key, namespace=getattr(request, "lora_path", None))
        except NoReplicaAvailable as error:
            raise EngineUnavailable(str(error)) from None
        if span is not None:
            policy = self.router.policy
            attributes: dict[str, Any] = {
                "radixlm.router.replica": int(replica.id),
                "radixlm.router.policy": policy.name,
                "radixlm.router.prompt_tokens": len(key),
            }
            if isinstance(request.rid, str):
                attributes["gen_ai.request.id"] = request.rid
            # The policy's own account of this choice (no await since it chose).
            decision = getattr(policy, "last", None)
            if isinstance(decision, CacheAwareDecision) and decision.replica == replica.id:
                attributes["radixlm.router.reason"] = decision.reason
                attributes["radixlm.router.matched_tokens"] = decision.matched
            span.set_attributes(attributes)
        return int(replica.id)

    def _route_by_room(self, room: int, span: Any) -> int:
        index = room % len(self.replicas)
        self.refresh()
        if not self.router.replica(str(index)).healthy:
            raise EngineUnavailable(
                f"replica {index}, which prefills bootstrap_room {room} (room % "
                f"{len(self.replicas)}), is down; retry with another room"
            )
        if span is not None:
            span.set_attributes(
                {
                    "radixlm.router.replica": index,
                    "radixlm.router.policy": "follow_bootstrap_room",
                }
            )
        return index

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Route one single request and stream its chunks from the chosen replica."""
        index = await self.route(request)
        replica_id = str(index)
        rid = request.rid if isinstance(request.rid, str) else None
        self.router.begin(replica_id)
        if rid is not None:
            with self._lock:
                self._owners[rid] = index
        try:
            async for chunk in self.replicas[index].generate(request):
                yield chunk
        except EngineUnavailable:
            self.refresh(force=True)  # take a replica that went down out of routing now
            raise
        finally:
            self.router.end(replica_id)
            if rid is not None:
                with self._lock:
                    self._owners.pop(rid, None)

    async def encode(self, request: EmbeddingRequest) -> EmbeddingOutput:
        """Route one single encode request (a pooling model's) by its prefix, as `generate`
        routes (a decoder embedder's replicas cache shared instruction prefixes)."""
        index = await self.route(request)
        encode = getattr(self.replicas[index], "encode", None)
        if encode is None:
            raise InvalidRequest("text", "this engine does not serve pooling models")
        self.router.begin(str(index))
        try:
            output: EmbeddingOutput = await encode(request)
            return output
        except EngineUnavailable:
            self.refresh(force=True)
            raise
        finally:
            self.router.end(str(index))

    async def beam_search(
        self, request: GenerateRequest, beam_width: int, **options: Any
    ) -> list[GenerateChunk]:
        index = await self.route(request)
        search = getattr(self.replicas[index], "beam_search", None)
        if search is None:
            raise NotImplementedError("this engine does not support beam search")
        self.router.begin(str(index))
        try:
            result: list[GenerateChunk] = await search(request, beam_width, **options)
            return result
        finally:
            self.router.end(str(index))

    # ------------------------------------------------------------------------ commands

    async def abort(self, rid: str) -> bool:
        with self._lock:
            index = self._owners.get(rid)
        if index is None:
            return False
        return bool(await self.replicas[index].abort(rid))

    async def flush_cache(self) -> bool:
        """Flush every replica's cache (False if any has requests running); the router's
        trees are cleared too, as they stand for those caches."""
        results = [bool(await replica.flush_cache()) for replica in self.replicas]
        for index, done in enumerate(results):
            if done:
                self.router.forget(str(index))
        return all(results)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """Load a LoRA adapter on every replica (all or none: when one refuses it, those
        that loaded it unload it again and the refusal is raised); the adapters loaded."""
        done: list[Any] = []
        loaded: dict[str, str] = {}
        try:
            for replica in self.replicas:
                loaded = dict(await replica.load_lora_adapter(lora_name, lora_path))
                done.append(replica)
        except BaseException:
            for replica in done:
                with contextlib.suppress(Exception):
                    await replica.unload_lora_adapter(lora_name)
            raise
        return loaded

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Unload an adapter from every replica (requests running on it finish)."""
        left: dict[str, str] = {}
        errors: list[BaseException] = []
        for replica in self.replicas:
            try:
                left = dict(await replica.unload_lora_adapter(lora_name))
            except Exception as error:  # unload the others anyway
                errors.append(error)
        if len(errors) == len(self.replicas):
            raise errors[0]
        return left

    def lora_adapters(self) -> dict[str, str]:
        """The adapters loaded (every replica holds the same ones)."""
        read = getattr(self.replicas[0], "lora_adapters", None)
        return dict(read()) if read is not None else {}

    def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = dict(self.replicas[0].model_info())
        info["dp_size"] = len(self.replicas)
        return info

    def server_info(self) -> dict[str, Any]:
        """The first replica's configuration, the sums of the live figures, and each
        replica's own figures and routing state under `replicas`."""
        self.refresh(force=True)
        infos = [_safe_info(replica) for replica in self.replicas]
        base = next((i for i in infos if i), {})
        out: dict[str, Any] = {
            key: value for key, value in base.items() if key not in _SUMMED and key != "healthy"
        }
        for key in _SUMMED:
            out[key] = sum(i.get(key, 0) for i in infos)
        prompt, cached = out.get("prompt_tokens", 0), out.get("cached_tokens", 0)
        out["cache_hit_rate"] = cached / prompt if prompt else 0.0
        usages = [i.get("token_usage", 0.0) for i in infos if i]
        out["token_usage"] = sum(usages) / len(usages) if usages else 0.0
        out["healthy"] = self.healthy
        for key in _SUMMED_WHERE_REPORTED:
            if any(key in info for info in infos):
                out[key] = sum(i.get(key, 0) for i in infos)
        out["dp_size"] = len(self.replicas)
        out["router_policy"] = (
            "follow_bootstrap_room" if self.follow_bootstrap_room else self.router.policy.name
        )
        states = {s["id"]: s for s in self.router.snapshot()}
        out["replicas"] = [
            {
                **states.get(str(index), {}),
                **{key: info.get(key) for key in _PER_REPLICA if key in info},
            }
            for index, info in enumerate(infos)
        ]
        return out

    def shutdown(self) -> None:
        for replica in self.replicas:
            stop = getattr(replica, "shutdown", None)
            if callable(stop):
                stop()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# Live figures summed over the replicas.
_SUMMED = (
    "num_running_reqs",
    "num_queued_reqs",
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "finished_requests",
    "num_retractions",
    "max_total_num_tokens",
)
# Live figures summed over the replicas where they report them: prefill/decode
# disaggregation's queues (SGLang's names).
_SUMMED_WHERE_REPORTED = (
    "num_prefill_prealloc_queue_reqs",
    "num_prefill_inflight_queue_reqs",
    "num_decode_prealloc_queue_reqs",
    "num_decode_transfer_queue_reqs",
)
# Figures listed per replica.
_PER_REPLICA = (
    "num_running_reqs",
    "num_queued_reqs",
    "token_usage",
    "cache_hit_rate",
    "prompt_tokens",
    "cached_tokens",
    "max_total_num_tokens",
    "engine_pid",
    *_SUMMED_WHERE_REPORTED,
)


def _live_stats(replica: Any) -> dict[str, Any]:
    """A replica's live figures, as cheaply as it offers them (`live_stats()` when it has
    it, else `server_info()`); empty when it cannot answer."""
    live = getattr(replica, "live_stats", None)
    try:
        result = live() if callable(live) else replica.server_info()
    except Exception:
        return {}
    return dict(result) if isinstance(result, dict) else {}


def _safe_info(replica: Any) -> dict[str, Any]:
    if not getattr(replica, "healthy", True):
        return {}
    try:
        info = replica.server_info()
    except Exception:
        return {}
    if isinstance(info, dict):
        info = dict(info)
        pid = getattr(replica, "engine_pid", None)
        if pid is not None:
            info["engine_pid"] = pid
        return info
    return {}
