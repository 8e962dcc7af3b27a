"""SGLang's routes of a rollout engine: `POST /update_weights_from_disk` (replace the model's
weights with a checkpoint directory's, without a restart), `/update_weights_from_tensor`
(tensors in the body, in forms that are safe to read: `radixlm.server.tensor_payload`),
`/init_weights_update_group` and `/update_weights_from_distributed` (a trainer's own
torch.distributed group), `POST /get_weights_by_name` (read a weight back: a trainer checks
what the engine holds), `POST /pause_generation` and `/continue_generation`, `POST
/release_memory_occupation` and `/resume_memory_occupation` (the engine gives the device's
memory to the trainer meanwhile)."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from radixlm.sampling import InvalidRequest
from radixlm.server.errors import APIError
from radixlm.server.openai_common import parse_body
from radixlm.server.state import ServerState
from radixlm.server.tensor_payload import (
    FlattenedBucketData,
    NamedTensorData,
    bucket_from_flattened,
    bucket_from_named_tensors,
    bucket_from_safetensors,
)


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


class MemoryOccupation(BaseModel):
    """`POST /release_memory_occupation`'s and `/resume_memory_occupation`'s body (SGLang's
    `ReleaseMemoryOccupationReqInput`); no tags, or no body: all of them."""

    model_config = ConfigDict(extra="forbid")

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = Field(
        default=None, description="none: all three"
    )


class UpdateWeightsFromTensor(BaseModel):
    """`POST /update_weights_from_tensor`'s body: SGLang's fields, with the tensors in exactly
    one of three forms that are safe to read instead of its pickles (`named_tensors`,
    `flattened_bucket`, `safetensors`)."""

    model_config = ConfigDict(extra="forbid")

    named_tensors: list[NamedTensorData] | None = Field(
        default=None, min_length=1, description="the tensors one by one"
    )
    flattened_bucket: FlattenedBucketData | None = Field(
        default=None, description="the tensors in one buffer (SGLang's layout)"
    )
    safetensors: str | None = Field(default=None, description="base64 of a safetensors file")
    serialized_named_tensors: Any = Field(
        default=None, description="SGLang's pickled tensors: a 400 naming the forms above"
    )
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    weight_version: str | None = None


class InitWeightsUpdateGroup(BaseModel):
    """`POST /init_weights_update_group`'s body (SGLang's `InitWeightsUpdateGroupReqInput`;
    its backend defaults to nccl, radixlm's to gloo)."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(default="weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateWeightsFromDistributed(BaseModel):
    """`POST /update_weights_from_distributed`'s body (SGLang's
    `UpdateWeightsFromDistributedReqInput`): the tensors rank 0 broadcasts, in order."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(description="torch's names: bfloat16, float32, ...")
    shapes: list[list[int]]
    group_name: str = Field(default="weight_update_group", min_length=1)
    flush_cache: bool = True
    weight_version: str | None = None


_PICKLES = (
    "serialized_named_tensors holds pickles (SGLang's MultiprocessingSerializer): reading one "
    "runs code of the sender's choosing, so this server refuses them. Send the tensors as "
    "named_tensors ([{name, dtype, shape, data: base64 of the raw little-endian bytes}]), "
    "flattened_bucket ({data: base64, metadata: [{name, shape, dtype, start_idx, end_idx}]}) "
    "or safetensors (base64 of a safetensors file)"
)


def _tensor_bucket(body: UpdateWeightsFromTensor) -> dict[str, Any]:
    """The body's tensors as SGLang's flattened-bucket dict; InvalidRequest naming the field
    when none or several forms are given."""
    if body.serialized_named_tensors is not None:
        raise InvalidRequest("serialized_named_tensors", _PICKLES)
    forms = [
        name
        for name in ("named_tensors", "flattened_bucket", "safetensors")
        if getattr(body, name) is not None
    ]
    if len(forms) != 1:
        raise InvalidRequest(
            forms[1] if forms else "named_tensors",
            "give the tensors in exactly one of named_tensors, flattened_bucket, safetensors",
        )
    if body.load_format == "flattened_bucket" and body.flattened_bucket is None:
        raise InvalidRequest(
            "load_format", "load_format flattened_bucket: send the bucket as flattened_bucket"
        )
    if body.named_tensors is not None:
        return bucket_from_named_tensors(body.named_tensors)
    if body.flattened_bucket is not None:
        return bucket_from_flattened(body.flattened_bucket)
    assert body.safetensors is not None
    return bucket_from_safetensors(body.safetensors)


async def _optional_body(state: ServerState, http: Request) -> MemoryOccupation:
    """The tags of a release or resume: an empty body (SGLang's clients send none) is all."""
    if not (await http.body()).strip():
        return MemoryOccupation()
    return await state.read_body(http, partial(parse_body, MemoryOccupation))


def _engine_member(state: ServerState, name: str) -> Any:
    member = getattr(state.engine, name, None)
    if not callable(member):
        raise APIError(400, f"this engine cannot {name.replace('_', ' ')}", code="not_supported")
    return member


def _documented(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body itself (for /docs and
    docs/http-api.md)."""
    content = {"application/json": {"schema": model.model_json_schema()}}
    return {"requestBody": {"required": required, "content": content}}


async def _resolved(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def weights_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["native"])

    @router.post("/update_weights_from_disk", openapi_extra=_documented(UpdateWeightsFromDisk))
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

    @router.post("/update_weights_from_tensor", openapi_extra=_documented(UpdateWeightsFromTensor))
    async def update_weights_from_tensor(http: Request) -> dict[str, Any]:
        """Replace some or all weights with tensors sent in the body (named_tensors,
        flattened_bucket or a safetensors file, base64; SGLang's pickled
        serialized_named_tensors are refused); answered as /update_weights_from_disk."""
        update = _engine_member(state, "update_weights_from_tensor")

        def parse(raw: dict[str, Any]) -> tuple[UpdateWeightsFromTensor, dict[str, Any]]:
            body = parse_body(UpdateWeightsFromTensor, raw)
            return body, _tensor_bucket(body)

        body, bucket = await state.read_body(http, parse)
        result = update(
            bucket,
            load_format="flattened_bucket",
            flush_cache=body.flush_cache,
            weight_version=body.weight_version,
        )
        return dict(await _resolved(result))

    @router.post("/init_weights_update_group", openapi_extra=_documented(InitWeightsUpdateGroup))
    async def init_weights_update_group(http: Request) -> dict[str, Any]:
        """Join a trainer's torch.distributed group as rank rank_offset (the trainer is rank
        0) for /update_weights_from_distributed; answers once every rank has joined."""
        join = _engine_member(state, "init_weights_update_group")
        body = await state.read_body(http, partial(parse_body, InitWeightsUpdateGroup))
        result = join(
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            group_name=body.group_name,
            backend=body.backend,
        )
        return dict(await _resolved(result))

    @router.post(
        "/update_weights_from_distributed", openapi_extra=_documented(UpdateWeightsFromDistributed)
    )
    async def update_weights_from_distributed(http: Request) -> dict[str, Any]:
        """Receive the tensors the trainer broadcasts (names, dtypes, shapes, in order) over
        the group joined with /init_weights_update_group, then update the weights with them."""
        update = _engine_member(state, "update_weights_from_distributed")
        body = await state.read_body(http, partial(parse_body, UpdateWeightsFromDistributed))
        for field in ("dtypes", "shapes"):
            if len(getattr(body, field)) != len(body.names):
                raise InvalidRequest(field, f"needs one entry per name ({len(body.names)})")
        result = update(
            body.names,
            body.dtypes,
            body.shapes,
            group_name=body.group_name,
            flush_cache=body.flush_cache,
            weight_version=body.weight_version,
        )
        return dict(await _resolved(result))

    @router.post("/get_weights_by_name", openapi_extra=_documented(GetWeightsByName))
    async def get_weights_by_name(http: Request) -> list[Any]:
        """The first `truncate_size` rows of a weight by checkpoint name."""
        read = _engine_member(state, "get_weights_by_name")
        body = await state.read_body(http, partial(parse_body, GetWeightsByName))
        return list(await _resolved(read(body.name, body.truncate_size)))

    @router.post("/pause_generation", openapi_extra=_documented(PauseGeneration))
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

    @router.post("/release_memory_occupation", openapi_extra=_documented(MemoryOccupation, False))
    async def release_memory_occupation(http: Request) -> dict[str, Any]:
        """Give the memory of `tags` (weights, kv_cache, cuda_graph; none: all) back while a
        trainer uses the device; refused while requests run (pause them first). Requests
        wait until /resume_memory_occupation."""
        release = _engine_member(state, "release_memory_occupation")
        body = await _optional_body(state, http)
        return dict(await _resolved(release(body.tags)))

    @router.post("/resume_memory_occupation", openapi_extra=_documented(MemoryOccupation, False))
    async def resume_memory_occupation(http: Request) -> dict[str, Any]:
        """Allocate the memory of released `tags` again (none: all): the KV cache empty, the
        weights as zeros that an update must fill before requests run again."""
        resume = _engine_member(state, "resume_memory_occupation")
        body = await _optional_body(state, http)
        return dict(await _resolved(resume(body.tags)))

    return router
