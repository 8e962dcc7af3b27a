"""docs/http-api.md is what tools/docs/gen_http_api.py makes of the server's OpenAPI schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "tools" / "docs" / "gen_http_api.py"
COMMITTED = ROOT / "docs" / "http-api.md"


def test_committed_http_api_page_matches_the_server_schema(tmp_path: Path) -> None:
    fresh = tmp_path / "http-api.md"
    subprocess.run(
        [sys.executable, str(GENERATOR), "-o", str(fresh)], check=True, capture_output=True
    )
    assert COMMITTED.read_text(encoding="utf-8") == fresh.read_text(encoding="utf-8"), (
        "docs/http-api.md is out of date with the server's routes; regenerate it with "
        "`.venv/bin/python tools/docs/gen_http_api.py` and commit the result"
    )


def test_http_api_page_lists_every_route_of_the_server() -> None:
    text = COMMITTED.read_text(encoding="utf-8")
    for route in ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/models"):
        assert f"`{route}`" in text
