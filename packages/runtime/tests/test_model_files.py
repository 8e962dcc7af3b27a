"""Hub ids resolve to local model directories: downloaded from a hub (a local fake here), at a
revision, into `download_dir`, or taken from the cache when HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import huggingface_hub.constants
import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_gguf, build_tiny_model
from radixlm.runtime.model_files import ModelNotFoundError, resolve_model_path

REPO = "tiny-org/tiny-llama"
COMMITS = {"main": "1" * 40, "v2": "2" * 40}  # branch -> commit
V2_CONTEXT = 2048  # v2's config.json differs from main's (4096) in max_position_embeddings


@dataclass
class FakeHub:
    """A Hugging Face hub on 127.0.0.1: the endpoints `snapshot_download` calls, for one repo
    (`REPO`) at the commits of `COMMITS`. `requests` records each request as 'METHOD path'."""

    url: str
    files: dict[str, dict[str, bytes]]  # commit -> repo file -> content
    requests: list[str] = field(default_factory=list)


class _HubHandler(BaseHTTPRequestHandler):
    hub: FakeHub  # set on the subclass the fixture builds

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def _answer(self, send_body: bool) -> None:
        self.hub.requests.append(f"{self.command} {self.path}")
        parts = [unquote(part) for part in urlsplit(self.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            # /api/models/{repo}/revision/{rev} (repo_info), /api/models/{repo}/tree/{rev}
            repo, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
            commit = self._commit(repo, revision)
            if commit is None:
                return
            files = self.hub.files[commit]
            if kind == "revision":
                info = {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
                self._send(200, json.dumps(info).encode(), send_body, {})
            elif kind == "tree":
                tree = [
                    {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                    for name, data in files.items()
                ]
                self._send(200, json.dumps(tree).encode(), send_body, {})
            else:
                self._send(404, b"", send_body, {})
        elif len(parts) >= 5 and parts[2] == "resolve":
            # /{repo}/resolve/{rev}/{file}: HEAD for the metadata, GET for the content
            repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            commit = self._commit(repo, revision)
            if commit is None:
                return
            headers = {"X-Repo-Commit": commit}
            data = self.hub.files[commit].get(name)
            if data is None:
                self._send(404, b"", send_body, {**headers, "X-Error-Code": "EntryNotFound"})
                return
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            self._send(200, data, send_body, {**headers, "ETag": etag})
        else:
            self._send(404, b"", send_body, {})

    def _commit(self, repo: str, revision: str) -> str | None:
        """The commit `revision` names in `repo`; None after answering 404 as the hub does."""
        if repo != REPO:
            self._send(404, b"", False, {"X-Error-Code": "RepoNotFound"})
            return None
        commit = COMMITS.get(revision, revision)
        if commit not in self.hub.files:
            self._send(404, b"", False, {"X-Error-Code": "RevisionNotFound"})
            return None
        return commit

    def _send(self, status: int, body: bytes, send_body: bool, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """commit -> files: a tiny llama (config, safetensors, tokenizer) and a pytorch_model.bin
    radixlm must not download; v2's config.json has another max_position_embeddings."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    main = {path.name: path.read_bytes() for path in sorted(model_dir.iterdir())}
    main["pytorch_model.bin"] = b"weights radixlm does not read"
    for kind in ("Q4_0", "Q8_0"):
        gguf_file = build_tiny_gguf(model_dir, model_dir.parent / f"tiny-{kind}.gguf", kind)
        main[f"gguf/tiny-{kind}.gguf"] = gguf_file.read_bytes()
    config = json.loads(main["config.json"])
    v2_config = {**config, "max_position_embeddings": V2_CONTEXT}
    v2 = {**main, "config.json": json.dumps(v2_config).encode()}
    return {COMMITS["main"]: main, COMMITS["v2"]: v2}


@pytest.fixture
def hub(
    repo_files: dict[str, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeHub]:
    """The fake hub, online: HF_HUB_OFFLINE off (in the environment and in huggingface_hub's
    copy of it) and every hub URL pointed at it, so nothing reaches the network."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler)
    fake = FakeHub(f"http://127.0.0.1:{server.server_address[1]}", repo_files)
    server.RequestHandlerClass = type("Handler", (_HubHandler,), {"hub": fake})
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    # huggingface_hub reads HF_ENDPOINT once, at import, for requests of its own (the
    # agent-harness registry) and for calls without `endpoint`.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", fake.url)
    monkeypatch.setattr(
        huggingface_hub.constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        fake.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    go_offline(monkeypatch, False)
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def go_offline(monkeypatch: pytest.MonkeyPatch, offline: bool = True) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)


def test_hub_id_downloads_into_download_dir(hub: FakeHub, tmp_path: Path) -> None:
    path = resolve_model_path(REPO, download_dir=str(tmp_path))
    assert path.is_relative_to(tmp_path.resolve())
    assert path.name == COMMITS["main"]
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file()


def test_weight_formats_radixlm_does_not_read_are_not_downloaded(
    hub: FakeHub, tmp_path: Path
) -> None:
    path = resolve_model_path(REPO, download_dir=str(tmp_path))
    assert not (path / "pytorch_model.bin").exists()
    assert not any("pytorch_model.bin" in request for request in hub.requests)


def test_revision_picks_that_revisions_files(hub: FakeHub, tmp_path: Path) -> None:
    path = resolve_model_path(REPO, revision="v2", download_dir=str(tmp_path))
    assert path.name == COMMITS["v2"]
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == V2_CONTEXT


def test_offline_with_an_empty_cache_says_how_to_get_the_model(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    go_offline(monkeypatch)
    command = f"`hf download {REPO} --revision v2 --cache-dir {tmp_path}`"
    with pytest.raises(ModelNotFoundError, match=rf"HF_HUB_OFFLINE=1.*{re.escape(command)}"):
        resolve_model_path(REPO, revision="v2", download_dir=str(tmp_path))
    assert hub.requests == []


def test_offline_after_a_download_resolves_the_cached_copy_without_requests(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloaded = resolve_model_path(REPO, revision="v2", download_dir=str(tmp_path))
    hub.requests.clear()
    go_offline(monkeypatch)
    assert resolve_model_path(REPO, revision="v2", download_dir=str(tmp_path)) == downloaded
    assert hub.requests == []


def test_unknown_hub_repo_says_it_cannot_be_downloaded(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"cannot download 'tiny-org/missing'"):
        resolve_model_path("tiny-org/missing", download_dir=str(tmp_path))
    assert any(request.startswith("GET /api/models/tiny-org/missing/") for request in hub.requests)


def test_one_gguf_file_of_a_repo_is_named_by_its_quantization_type(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "radixlm"))
    path = resolve_model_path(f"{REPO}:q4_0", download_dir=str(tmp_path))
    assert (path / "config.json").is_file()  # the GGUF file's sidecar
    fetched = [r for r in hub.requests if r.startswith("GET") and "/resolve/" in r]
    assert fetched and all(r.endswith("/gguf/tiny-Q4_0.gguf") for r in fetched)
    by_name = resolve_model_path(f"{REPO}:gguf/tiny-Q4_0.gguf", download_dir=str(tmp_path))
    assert by_name == path


def test_a_gguf_type_no_file_of_the_repo_has_is_reported(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file matching 'Q6_K'"):
        resolve_model_path(f"{REPO}:Q6_K", download_dir=str(tmp_path))


def test_missing_path_that_is_no_hub_id_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"does not exist.*nor is it a hub id"):
        resolve_model_path(tmp_path / "no" / "such" / "model")


def test_engine_generates_from_a_downloaded_hub_model(hub: FakeHub, tmp_path: Path) -> None:
    engine = Engine(REPO, download_dir=str(tmp_path), show_progress=False, max_total_tokens=256)
    try:
        out = engine.generate("hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    finally:
        engine.shutdown()
    assert len(out["output_ids"]) == 4
    assert any(request.endswith("/model.safetensors") for request in hub.requests)
