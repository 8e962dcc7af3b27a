"""What the HTTP router reads from and writes into request and response bodies: the request ids
(to abort a request where it runs), the bootstrap fields of prefill/decode disaggregation, and
an error inside a worker's answer.

The PD contract (SGLang's): the router sends one body to a prefill worker and a decode worker
at once, the same bytes to both, with `bootstrap_host` and `bootstrap_port` (where the prefill
worker listens for decode workers) and `bootstrap_room` (a random 63-bit id pairing the two
halves of the request) as top-level fields, and the same `rid`. A batch `/generate` body gets a
list of each, one entry per prompt.
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

from radixlm.router.workers import WorkerSpec

#: The bootstrap fields the router adds to a body in PD mode.
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def new_room() -> int:
    """A fresh bootstrap room: a random non-negative 63-bit integer."""
    return secrets.randbits(63)


def batch_size(route: str, body: dict[str, Any]) -> int | None:
    """The number of prompts of a batch `/generate` body; None for a single request (and for
    the OpenAI routes, whose bodies are one request each)."""
    if route != "/generate":
        return None
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def request_ids(body: Any) -> list[str]:
    """The `rid`s a body names (one, or one per prompt of a batch); none when it names none."""
    rid = body.get("rid") if isinstance(body, dict) else None
    if isinstance(rid, str):
        return [rid]
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str)]
    return []


def with_bootstrap(
    route: str, body: dict[str, Any], prefill: WorkerSpec, rooms: list[int] | None = None
) -> dict[str, Any]:
    """`body` with the bootstrap fields of `prefill` and a `rid` (the client's, else a fresh
    one), as both workers of a PD pair get it. `rooms` (default: fresh ones) must hold one
    room per prompt. The caller's dict is not changed."""
    if prefill.bootstrap_port is None:
        raise ValueError(f"{prefill.url} is not a prefill worker (it has no bootstrap port)")
    size = batch_size(route, body)
    rooms = rooms if rooms is not None else [new_room() for _ in range(size or 1)]
    if len(rooms) != (size or 1):
        raise ValueError(f"give one bootstrap room per prompt ({size or 1}); got {len(rooms)}")
    out = dict(body)
    if size is None:
        out.update(
            bootstrap_host=prefill.host,
            bootstrap_port=prefill.bootstrap_port,
            bootstrap_room=rooms[0],
        )
        if not isinstance(out.get("rid"), str):
            out["rid"] = uuid.uuid4().hex
    else:
        out.update(
            bootstrap_host=[prefill.host] * size,
            bootstrap_port=[prefill.bootstrap_port] * size,
            bootstrap_room=rooms,
        )
        rid = out.get("rid")
        if not (isinstance(rid, list) and len(rid) == size):
            out["rid"] = [uuid.uuid4().hex for _ in range(size)]
    return out


def answer_error(content: bytes) -> dict[str, Any] | None:
    """The error object (`{"message", "type", "code", ...}`) inside a worker's answer that
    came with status 200: an error event of a stream, or an `{"error": ...}` body; None when
    there is none."""
    text = content.decode("utf-8", errors="replace").strip()
    if text.startswith("{"):
        return _error_of(text)
    for line in text.splitlines():
        if line.startswith("data:"):
            found = _error_of(line[5:].strip())
            if found is not None:
                return found
    return None


def error_status(error: dict[str, Any], default: int = 500) -> int:
    """The HTTP status an error object carries in its `code` (radixlm's and SGLang's
    servers put it there), else `default`."""
    code = error.get("code")
    return code if isinstance(code, int) and 400 <= code < 600 else default


def _error_of(payload: str) -> dict[str, Any] | None:
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return error
    if isinstance(error, str):
        return {"message": error}
    return None
