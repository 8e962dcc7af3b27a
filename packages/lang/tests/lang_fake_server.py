"""A fake radixlm server in a thread: the native API (/generate, /get_model_info, /flush_cache,
/get_server_info) and an OpenAI-compatible /v1 (chat and completions), over a ToyCore."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lang_toy_model import ToyCore, tokenize

from radixlm.sampling import InvalidRequest, SamplingParams


def render_chat(messages: list[dict[str, Any]]) -> str:
    """How the fake /v1 turns chat messages into a prompt for the toy model."""
    parts = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        parts.append(f"<|{m['role']}|>{content}\n")
    return "".join(parts) + "<|assistant|>"


_OPENAI_FIELDS = {
    "max_tokens",
    "stop",
    "temperature",
    "top_p",
    "n",
    "seed",
    "regex",
    "top_k",
    "min_p",
}


def _params(body: dict[str, Any]) -> SamplingParams:
    values = {k: v for k, v in body.items() if k in _OPENAI_FIELDS and v is not None}
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        values["json_schema"] = json.dumps(fmt["json_schema"]["schema"])
    return SamplingParams.parse(values)


class FakeServer:
    def __init__(self, core: ToyCore) -> None:
        self.core = core
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, data: Any) -> None:
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _sse(self, events: Iterator[Any]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in events:
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            def do_GET(self) -> None:
                if self.path == "/get_model_info":
                    self._json(200, server.core.model_info())
                elif self.path == "/get_server_info":
                    self._json(200, {"max_in_flight": server.core.max_in_flight})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                body = self._body()
                try:
                    if self.path == "/generate":
                        if body.get("stream"):
                            self._sse(server.core.stream(body))
                        else:
                            self._json(200, server.core.generate(body))
                    elif self.path == "/flush_cache":
                        server.core.flush()
                        self._json(200, {"ok": True})
                    elif self.path == "/v1/chat/completions":
                        server._chat(self, body)
                    elif self.path == "/v1/completions":
                        server._completions(self, body)
                    else:
                        self._json(404, {"error": {"message": f"no route {self.path}"}})
                except (InvalidRequest, ValueError) as error:
                    self._json(400, {"error": {"message": str(error), "code": 400}})

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._http.block_on_close = False
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )

    def start(self) -> FakeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    # ----- /v1 -----

    def _chat(self, handler: Any, body: dict[str, Any]) -> None:
        self.core.openai_requests.append(body)
        prompt = render_chat(body["messages"])
        params = _params(body)
        outs = [self.core.model.complete(prompt, params) for _ in range(params.n)]
        if body.get("stream"):
            text = outs[0][0]

            def events() -> Iterator[dict[str, Any]]:
                for piece in tokenize(text):
                    yield {
                        "id": "c1",
                        "object": "chat.completion.chunk",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                        ],
                    }
                yield {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                }

            handler._sse(events())
            return
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length" if finish["type"] == "length" else "stop",
            }
            for i, (text, finish) in enumerate(outs)
        ]
        usage = {
            "prompt_tokens": len(tokenize(prompt)),
            "completion_tokens": len(tokenize(outs[0][0])),
            "total_tokens": 0,
        }
        handler._json(
            200,
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": choices,
                "usage": usage,
            },
        )

    def _completions(self, handler: Any, body: dict[str, Any]) -> None:
        self.core.openai_requests.append(body)
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        params = _params(body)
        if body.get("stream"):
            text, _ = self.core.model.complete(prompts[0], params)

            def events() -> Iterator[dict[str, Any]]:
                for piece in tokenize(text):
                    yield {
                        "id": "c2",
                        "object": "text_completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "text": piece, "finish_reason": None, "logprobs": None}
                        ],
                    }
                yield {
                    "id": "c2",
                    "object": "text_completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}
                    ],
                }

            handler._sse(events())
            return
        choices = []
        for i, prompt in enumerate(prompts):
            text, finish = (
                ("", {"type": "length"})
                if body.get("max_tokens") == 0
                else self.core.model.complete(prompt, params)
            )
            logprobs = None
            if body.get("logprobs") is not None:
                tokens = (tokenize(prompt) if body.get("echo") else []) + tokenize(text)
                offsets, at = [], 0
                for token in tokens:
                    offsets.append(at)
                    at += len(token)
                values = [
                    None if j == 0 else self.core.model.logprob("".join(tokens[:j]), tokens[j])
                    for j in range(len(tokens))
                ]
                logprobs = {
                    "tokens": tokens,
                    "token_logprobs": values,
                    "text_offset": offsets,
                    "top_logprobs": None,
                }
            choices.append(
                {
                    "index": i,
                    "text": (prompt if body.get("echo") else "") + text,
                    "logprobs": logprobs,
                    "finish_reason": "length" if finish["type"] == "length" else "stop",
                }
            )
        handler._json(
            200,
            {
                "id": "c2",
                "object": "text_completion",
                "created": 0,
                "model": body["model"],
                "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )
