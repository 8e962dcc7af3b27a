"""What the benchmark peers' launchers share: waiting for a started server to be ready."""

from __future__ import annotations

import subprocess
import time


def wait_ready(
    process: subprocess.Popen[bytes], url: str, timeout: float, interval: float = 0.5
) -> bool:
    """Whether GET `url` answered 200 before `timeout` seconds passed or `process` exited."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return False
