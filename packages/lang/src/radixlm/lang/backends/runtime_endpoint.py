"""RuntimeEndpoint: a radixlm (or SGLang) server through its native HTTP API, with httpx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from radixlm.lang.backends.native import Body, NativeBackend
from radixlm.lang.chat_template import ChatTemplate, resolve_chat_template
from radixlm.lang.errors import BackendError, BackendUnavailable


def _error_message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)
    return json.dumps(data)[:500]


class _HttpTransport:
    """/generate, /get_model_info, /flush_cache, /get_server_info over one httpx.Client."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        verify: bool | str,
        timeout: float | None,
        connect_timeout: float,
    ) -> None:
        self.base_url = base_url
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=base_url,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    def _fail(self, path: str, error: httpx.HTTPError) -> BackendError:
        if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
            return BackendUnavailable(
                f"cannot reach the server at {self.base_url} ({error or type(error).__name__}); "
                "is it running? Start one with `radixlm serve --model-path ...` or fix base_url"
            )
        if isinstance(error, httpx.TimeoutException):
            return BackendError(
                f"{path} on {self.base_url} did not answer within {self.timeout} s; "
                "raise RuntimeEndpoint(timeout=...) for long generations"
            )
        return BackendError(f"{path} on {self.base_url} failed: {error or type(error).__name__}")

    def _check(self, path: str, response: httpx.Response) -> None:
        if response.status_code >= 400:
            response.read()
            raise BackendError(
                f"{path} answered {response.status_code}: {_error_message(response)}",
                status=response.status_code,
            )

    def call(self, method: str, path: str, body: Body | None = None) -> httpx.Response:
        try:
            response = self._client.request(method, path, json=body)
        except httpx.HTTPError as error:
            raise self._fail(path, error) from error
        self._check(path, response)
        return response

    def request(self, body: Body) -> Any:
        return self.call("POST", "/generate", body).json()

    def stream(self, body: Body) -> Iterator[dict[str, Any]]:
        try:
            with self._client.stream("POST", "/generate", json=body) as response:
                self._check("/generate", response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        error = chunk["error"]
                        message = error.get("message", error) if isinstance(error, dict) else error
                        raise BackendError(f"/generate stream failed: {message}")
                    yield chunk
        except httpx.HTTPError as error:
            raise self._fail("/generate", error) from error

    def model_info(self) -> dict[str, Any]:
        info = self.call("GET", "/get_model_info").json()
        return dict(info) if isinstance(info, dict) else {}

    def flush_cache(self) -> bool:
        try:
            self.call("POST", "/flush_cache")
        except BackendError as error:
            if error.status not in (404, 405):
                raise
            self.call("GET", "/flush_cache")
        return True

    def server_info(self) -> dict[str, Any]:
        info = self.call("GET", "/get_server_info").json()
        return dict(info) if isinstance(info, dict) else {"info": info}

    def close(self) -> None:
        self._client.close()


class RuntimeEndpoint(NativeBackend):
    """A radixlm server (`radixlm serve`) or any server with SGLang's native API.

    The constructor asks `/get_model_info` for the model, its chat template and its image and
    video placeholders (`image_token`, `video_token`: used where the template names none), so
    a server that cannot be reached fails here, with BackendUnavailable. `timeout` bounds each request (None:
    wait forever); `connect_timeout` bounds connecting. `chat_template_name` overrides the
    model's template (see `radixlm.lang.chat_template.TEMPLATES`).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: bool | str | None = None,
        chat_template_name: str | ChatTemplate | None = None,
        *,
        timeout: float | None = 600.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        transport = _HttpTransport(
            self.base_url, api_key, True if verify is None else verify, timeout, connect_timeout
        )
        try:
            self.model_info = transport.model_info()
        except BackendError:
            transport.close()
            raise
        template = resolve_chat_template(chat_template_name, self.model_info.get("chat_template"))
        super().__init__(transport, template.with_model_media_tokens(self.model_info))
        self._http = transport

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path", ""))

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def __enter__(self) -> RuntimeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"
