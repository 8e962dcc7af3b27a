"""A uvicorn server in a daemon thread, on a socket bound to a free local port (test helper)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


class ThreadedServer:
    """Serve `app` with uvicorn in a thread; `url` is known before `start()`.

    `uvicorn_options` go to `uvicorn.Config` (log level warning and a 5 s keep-alive unless
    given)."""

    def __init__(self, app: Any, name: str = "live-server", **uvicorn_options: Any) -> None:
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port: int = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        options: dict[str, Any] = {"log_level": "warning", "timeout_keep_alive": 5}
        options.update(uvicorn_options)
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name=name, daemon=True
        )

    def start(self, timeout: float = 20.0) -> ThreadedServer:
        """Start serving; returns once uvicorn has started, RuntimeError if it does not."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the test server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
