"""SGLang's routes of a rollout engine: `POST /update_weights_from_disk` (replace the model's
weights with a checkpoint directory's, without a restart), `POST /get_weights_by_name` (read
a weight back: a trainer checks what the engine holds), `POST /pause_generation` and `POST
/continue_generation`."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from radixlm.server.errors import APIError
from radixlm.server.openai_common import parse_body
from radixlm.server.state import ServerState


class UpdateWeightsFromDisk(BaseModel):
    """`POST /update_weights_from_disk`'s body (SGLang's `UpdateWeightFromDiskReqInput`)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    load_format: str | None = None  # SGLang's; safetensors is what is read
    flush_cache: bool = True
    weight_version: str | None = None


class GetWeightsByName(BaseModel):
    """`POST /get_weights_by_name`'s body (SGLang's `GetWeightsByNameReqInput`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    truncate_size: int = Field(default=100, ge=0)


class PauseGeneration(BaseModel):
    """`POST /pause_generation`'s body (SGLang's `PauseGenerationReqInput`)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "retract", "in_place"] = "abort"


def _engine_member(state: ServerState, name: str) -> Any:
    member = getattr(state.engine, name, None)
    if not callable(member):
        raise APIError(400, f"this engine cannot {name.replace('_', ' ')}", code="not_supported")
    return member


async def _resolved(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def weights_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["native"])

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(http: Request) -> dict[str, Any]:
        """Replace the weights with those of a checkpoint directory of the same model
        (SGLang's answer: success, message, weight_version); requests that arrive after it
        never reuse K/V computed before."""
        update = _engine_member(state, "update_weights_from_disk")
        body = await state.read_body(http, partial(parse_body, UpdateWeightsFromDisk))
        if body.load_format not in (None, "auto", "safetensors"):
            raise APIError(
                400, "load_format: only safetensors checkpoints are read; omit it",
                code="invalid_load_format",
            )  # fmt: skip
        result = await _resolved(update(body.model_path, body.flush_cache, body.weight_version))
        return dict(result)

    @router.post("/get_weights_by_name")
    async def get_weights_by_name(http: Request) -> list[Any]:
        """The first `truncate_size` rows of a weight by checkpoint name."""
        read = _engine_member(state, "get_weights_by_name")
        body = await state.read_body(http, partial(parse_body, GetWeightsByName))
        return list(await _resolved(read(body.name, body.truncate_size)))

    @router.post("/pause_generation")
    async def pause_generation(http: Request) -> dict[str, Any]:
        """Stop running steps: `abort` ends every open request, `retract` sends the running
        ones back to the queue, `in_place` keeps them; new requests queue meanwhile."""
        pause = _engine_member(state, "pause_generation")
        body = await state.read_body(http, partial(parse_body, PauseGeneration))
        await _resolved(pause(body.mode))
        return {"success": True}

    @router.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        """Run steps again after `/pause_generation`."""
        await _resolved(_engine_member(state, "continue_generation")())
        return {"success": True}

    return router
