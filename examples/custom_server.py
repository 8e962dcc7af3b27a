"""A custom server composed from parts: radixlm-server's routes on radixlm-runtime's engine, plus
a route of its own.

`create_app(engine, config)` mounts the OpenAI API (`/v1/...`) and the native API (`/generate`,
...) on any engine that satisfies `radixlm.server.EngineClient`; `radixlm.runtime.Engine` does.
The app is a FastAPI app, so more routes go beside radixlm's: here `GET /capital/{country}`
asks the same engine (the same radix cache, the same batches) for a country's capital.

    python examples/custom_server.py --port 8000            # the built-in demo model
    curl localhost:8000/capital/France                      # {"country": "France", "capital": "Paris", ...}
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "radixlm-demo", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import uvicorn
from fastapi import FastAPI

from radixlm.runtime import BUILTIN_MODEL_NAME, Engine, builtin_model_path
from radixlm.server import APIError, ServerConfig, create_app

COUNTRY = re.compile(r"[A-Za-z][A-Za-z .'-]{0,39}")


def build_app(engine: Engine, served_model_name: str) -> FastAPI:
    """radixlm's routes on `engine`, and `GET /capital/{country}` beside them."""
    app = create_app(engine, ServerConfig(served_model_name=served_model_name))

    @app.get("/capital/{country}")
    async def capital(country: str) -> dict[str, Any]:
        if not COUNTRY.fullmatch(country):
            # APIError answers an OpenAI-style error object, like radixlm's own routes.
            raise APIError(400, "country must be a name in letters", param="country")
        out = await engine.async_generate(
            f"The capital of {country} is",
            {"temperature": 0, "max_new_tokens": 8, "stop": ["."]},
        )
        return {
            "country": country,
            "capital": out["text"].strip(),
            "cached_tokens": out["meta_info"]["cached_tokens"],
        }

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a local HF model (default: the built-in one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    model_path = args.model_path or builtin_model_path()
    name = BUILTIN_MODEL_NAME if args.model_path is None else args.model_path
    with Engine(model_path, show_progress=False) as engine:
        app = build_app(engine, name)
        print(f"serving {name!r} at http://{args.host}:{args.port}", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
