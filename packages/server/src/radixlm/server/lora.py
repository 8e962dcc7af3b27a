"""LoRA adapters: the `--lora-paths` and `--lora-target-modules` flags, SGLang's
`/load_lora_adapter` and `/unload_lora_adapter` routes, and the adapters' `/v1/models` cards."""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Sequence
from functools import partial
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from radixlm.sampling import InvalidRequest
from radixlm.server.errors import APIError
from radixlm.server.openai_common import parse_body
from radixlm.server.state import ServerState

NOT_SUPPORTED = "this engine does not support LoRA adapters"

# Command line.


def lora_path_item(text: str) -> tuple[str, str]:
    """One `--lora-paths` item as (name, path), in the forms SGLang accepts: `name=path`, a
    bare `path` (named by itself), or a JSON object `{"lora_name": ..., "lora_path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object: {error}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
        unknown = sorted(set(value) - {"lora_name", "lora_path", "pinned"})
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown keys {unknown}; give lora_name and lora_path"
            )
        if value.get("pinned"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: pinned adapters are not supported; remove pinned"
            )
        name, path = value.get("lora_name"), value.get("lora_path")
    elif "=" in text:
        name, _, path = text.partition("=")
    else:
        name = path = text
    for key, part in (("lora_name", name), ("lora_path", path)):
        if not isinstance(part, str) or not part.strip():
            raise argparse.ArgumentTypeError(
                f"{text!r} has no {key}; give name=path, a path, or "
                '{"lora_name": ..., "lora_path": ...}'
            )
    return str(name), str(path)


class LoraPathsAction(argparse.Action):
    """`--lora-paths ITEM [ITEM ...]` (repeatable) into one dict, adapter name -> path; an
    error when two items name the same adapter."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        adapters: dict[str, str] = dict(getattr(namespace, self.dest, None) or {})
        pairs: list[tuple[str, str]] = list(values or ()) if isinstance(values, list) else []
        for name, path in pairs:
            if name in adapters:
                parser.error(
                    f"{option_string}: the adapter name {name!r} is given twice ({adapters[name]!r} "
                    f"and {path!r}); name them apart with name=path"
                )
            adapters[name] = path
        setattr(namespace, self.dest, adapters)


class TargetModulesAction(argparse.Action):
    """`--lora-target-modules NAME [NAME ...]`, or `all` alone (every module the engine
    supports, SGLang's spelling, passed on as `["all"]`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        modules = list(values or ())
        if "all" in modules and len(modules) > 1:
            parser.error(f"{option_string}: give all alone, or the module names without it")
        setattr(namespace, self.dest, modules)


# HTTP routes.


class LoadLoraAdapter(BaseModel):
    """`POST /load_lora_adapter`'s body (SGLang's `LoadLoRAAdapterReqInput`)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # SGLang's; only false is accepted


class UnloadLoraAdapter(BaseModel):
    """`POST /unload_lora_adapter`'s body (SGLang's `UnloadLoRAAdapterReqInput`)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


def _engine_member(state: ServerState, name: str) -> Any:
    member = getattr(state.engine, name, None)
    if not callable(member):
        raise APIError(400, NOT_SUPPORTED, code="lora_not_supported")
    return member


async def _loaded_after(state: ServerState, result: Any) -> dict[str, str]:
    """The adapters loaded once the engine's answer is in: `result` is an awaitable
    (radixlm's `Reply`, a coroutine), or nothing when the engine did its work at once; what
    it resolves to when that is the adapters (name -> path, as radixlm's engine answers), else
    the engine's `lora_adapters()` read then."""
    if inspect.isawaitable(result):
        result = await result
    if isinstance(result, dict):
        return {str(name): str(path) for name, path in result.items()}
    return state.lora_adapters()


def lora_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["native"])

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(http: Request) -> dict[str, Any]:
        """Load a LoRA adapter (a local PEFT directory) under a name, for requests to name
        (`model` on the OpenAI routes, `lora_path` on `/generate`); the adapters loaded."""
        load = _engine_member(state, "load_lora_adapter")
        body = await state.read_body(http, partial(parse_body, LoadLoraAdapter))
        if body.pinned:
            raise InvalidRequest("pinned", "pinned adapters are not supported; omit pinned")
        if body.lora_name in ("default", state.served_model_name):
            raise InvalidRequest(
                "lora_name", f"{body.lora_name!r} names the base model; choose another name"
            )
        loaded = await _loaded_after(state, load(body.lora_name, body.lora_path))
        return {"success": True, "loaded_adapters": loaded}

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(http: Request) -> dict[str, Any]:
        """Unload a LoRA adapter: requests already running on it finish, new ones naming it are
        refused; the adapters still loaded."""
        unload = _engine_member(state, "unload_lora_adapter")
        body = await state.read_body(http, partial(parse_body, UnloadLoraAdapter))
        loaded = await _loaded_after(state, unload(body.lora_name))
        return {"success": True, "loaded_adapters": loaded}

    return router


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """`/v1/models` entries of the loaded adapters, in the engine's order (vLLM's layout:
    `root` is the adapter's path, `parent` the served model)."""
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "radixlm",
            "root": path,
            "parent": state.served_model_name,
        }
        for name, path in state.lora_adapters().items()
    ]
