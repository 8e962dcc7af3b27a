"""What the HTTP router's tests run against: fake worker servers that record what they get, and
live uvicorn servers (workers and the router) on free local ports. Loaded by conftest.py as the
module `router_fakes`."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixlm.router.workers import HealthConfig


class LiveServer:
    """A uvicorn server in a thread, on a socket bound to a free port (`url` known at once)."""

    def __init__(self, app: Any, lifespan: str = "off") -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_keep_alive=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving: connections to `url` are refused from now on."""
        stop_all([self])


def stop_all(servers: list[LiveServer]) -> None:
    """Stop the servers, all at once (each takes a few tenths of a second to wind down)."""
    for server in servers:
        server.server.should_exit = True
    for server in servers:
        server.thread.join(timeout=10)
        server.socket.close()


def dead_url() -> str:
    """The URL of a local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


class FakeWorker:
    """A worker server that records every generate body (parsed and raw) and abort, and
    answers as radixlm's servers do: a JSON answer, or a stream of `data:` events ending with
    `data: [DONE]` (what it sent is kept in `sent`).

    `fail`: answer every generate request with this status and an OpenAI-shaped error.
    `hold`: keep a request open until it is aborted (by rid) or its client goes away.
    `error_in_stream`: answer 200 with a stream holding an error event.
    `break_stream`: drop the connection after a stream's first event.
    `delay`: seconds before the answer (a stream: before each event; a failure: before it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict[str, Any]] = []
        self.raw: list[bytes] = []
        self.routes: list[str] = []
        self.aborts: list[str] = []
        self.disconnected: list[str] = []
        self.sent: list[bytes] = []
        self.health_status = 200
        self.fail: int | None = None
        self.hold = False
        self.error_in_stream = False
        self.break_stream = False
        self.delay = 0.0
        self.flushed = 0
        self.server = LiveServer(self.app()).start()
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()

    def error_body(self) -> dict[str, Any]:
        message = f"{self.name} refused the request"
        return {"error": {"message": message, "type": "server_error", "param": None, "code": 500}}

    def events(self, rid: str) -> list[bytes]:
        out = [
            f"data: {json.dumps({'text': f'{self.name}-{i}', 'rid': rid})}\n\n".encode()
            for i in range(3)
        ]
        if self.error_in_stream:
            out.append(f"data: {json.dumps(self.error_body())}\n\n".encode())
        return [*out, b"data: [DONE]\n\n"]

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            raw = await request.body()
            body = json.loads(raw)
            self.raw.append(raw)
            self.bodies.append(body)
            self.routes.append(request.url.path)
            rid = body.get("rid") if isinstance(body.get("rid"), str) else "none"
            if self.hold:
                deadline = time.monotonic() + 10
                while rid not in self.aborts and time.monotonic() < deadline:
                    if await request.is_disconnected():
                        self.disconnected.append(rid)
                        break
                    await asyncio.sleep(0.01)
                return JSONResponse({"text": "", "meta_info": {"finish_reason": "abort"}})
            if self.fail is not None:
                await asyncio.sleep(self.delay)
                return JSONResponse(self.error_body(), status_code=self.fail)
            if self.delay and not body.get("stream"):
                await asyncio.sleep(self.delay)
            if body.get("stream"):
                return StreamingResponse(self.stream(rid), media_type="text/event-stream")
            answer = json.dumps({"text": self.name, "rid": rid}).encode()
            self.sent.append(answer)
            return Response(answer, media_type="application/json")

        for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.add_api_route(route, generate, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.health_status)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake", "owned_by": self.name}]}

        @app.get("/get_server_info")
        async def server_info() -> dict[str, Any]:
            return {"name": self.name, "num_running_reqs": 0}

        @app.post("/abort_request")
        async def abort(request: Request) -> dict[str, Any]:
            self.aborts.append((await request.json())["rid"])
            return {"success": True}

        @app.post("/flush_cache")
        async def flush() -> dict[str, Any]:
            self.flushed += 1
            return {"success": True}

        return app

    async def stream(self, rid: str) -> AsyncIterator[bytes]:
        for event in self.events(rid):
            if self.delay:
                await asyncio.sleep(self.delay)
            self.sent.append(event)
            yield event
            if self.break_stream:
                raise ConnectionAbortedError("the fake worker breaks off its stream")


#: Health checks quick enough for tests: every 0.1 s, two failures out, one success in.
QUICK_HEALTH = HealthConfig(interval_s=0.1, timeout_s=1.0, failure_threshold=2, success_threshold=1)
