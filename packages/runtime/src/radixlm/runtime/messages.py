"""The messages between the engine's front end and its core: plain, frozen, picklable data.

Front -> core: an `EngineRequest` (one prepared single request) or a command dataclass,
handled by `EngineCore.handle` with `match`. Core -> front: `SeqDelta`s (token ids, logprobs,
the core's finish; the front end turns them into `radixlm.sampling.GenerateChunk`s) and the
events below, batched per loop iteration. The same messages cross a thread (the
engine's thread mode) or a ZeroMQ socket (the engine process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from radixlm.sampling import FinishReason, LogprobEntry, SamplingParams

if TYPE_CHECKING:
    from radixlm.runtime.tensor_bucket import FlattenedTensorBucket


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """What a request asked for: output logprobs with `top` alternatives and `token_ids`;
    prompt logprobs from `input_start` (None: none); token texts in the entries."""

    enabled: bool = False
    top: int = 0
    token_ids: tuple[int, ...] | None = None
    input_start: int | None = None
    with_text: bool = False


@dataclass(frozen=True, slots=True)
class PoolingAsk:
    """An encode request's options: the rows pooled (`method`), the embedding's first
    `dimensions` values, L2-normalised or not (embedders; a head's outputs are raw), and an
    encoder's token types (a text pair's second segment is 1)."""

    method: str
    normalize: bool = False
    dimensions: int | None = None
    token_type_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """A disaggregated request's pairing (SGLang's bootstrap fields): `room` pairs its prefill
    half with its decode half; `host:port` is the prefill engine's bootstrap endpoint (what
    a decode engine registers the room at; a prefill engine needs only the room)."""

    room: int
    host: str | None = None
    port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One validated, tokenized single request (made by `RequestPreparer.prepare`): all the
    engine core needs to run its `params.n` sequences."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_new_tokens: int
    stream: bool = False
    incremental: bool = False
    stream_interval: int = 1  # output tokens per streamed chunk after the first
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    custom_logit_processor: str | None = None
    #: The prompt as embeddings (a float32 CPU tensor [prompt_len, hidden]) when it was given
    #: as `input_embeds`; `prompt_ids` then hold its cache-key pseudo ids.
    input_embeds: Any = None
    #: The prompt's images and videos (`multimodal.inputs.MultimodalInputs`); `prompt_ids`
    #: then hold each item's cache-key pseudo ids at its positions.
    multimodal: Any = None
    return_hidden_states: bool = False
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    #: The token that ends the thinking, when `params.thinking_token_budget` is set.
    thinking_end: int | None = None
    #: The token ids after which the request's constraint applies (those of `</think>` when
    #: the request has `require_reasoning`): the output is free until they are generated, and
    #: the grammar starts fresh at the next token. Empty: it applies from the first token.
    grammar_after: tuple[int, ...] = ()
    #: The LoRA adapter's name (None: the base model); the core resolves it to its uid.
    lora_name: str | None = None
    #: `return_routed_experts`: the first prompt position whose experts are returned.
    routed_experts_start: int | None = None
    #: A pooling model's request (`Engine.encode`): what to return instead of tokens.
    pooling: PoolingAsk | None = None
    #: Its scheduling priority (the scheduler's `enable_priority_scheduling`).
    priority: int = 0
    #: time.monotonic() past which it ends with finish reason abort (None: no limit).
    deadline: float | None = None
    #: Prefill/decode disaggregation: the request's pairing (None on a colocated engine).
    bootstrap: Bootstrap | None = None
    created: float = 0.0  # time.monotonic() when it arrived (system-wide on Linux)


# ------------------------------------------------------------------------ commands (in)


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request: its unfinished sequences finish with `abort`, its memory is freed."""

    rid: str


@dataclass(frozen=True, slots=True)
class StopSequence:
    """The front end found a stop string in sequence `index` of the request: it ends as if
    it had stopped in the core (its computed tokens go to the cache), quietly (the front end
    already sent its final chunk)."""

    rid: str
    index: int


@dataclass(frozen=True, slots=True)
class FlushCache:
    """Drop the radix cache (answered False while requests run)."""

    reply: int


@dataclass(frozen=True, slots=True)
class LoadLoraAdapter:
    """Read, check and register a LoRA adapter (answered with the loaded adapters, name ->
    directory, or an InvalidRequest naming `lora_name` / `lora_path`)."""

    name: str
    path: str
    reply: int


@dataclass(frozen=True, slots=True)
class LoadLoraAdapterFromTensors:
    """Check and register a LoRA adapter given as PEFT-named tensors and its PEFT config (a
    trainer's push, SGLang's `load_lora_adapter_from_tensors`); one already loaded under the
    name is replaced for new requests. Answered like `LoadLoraAdapter` (an InvalidRequest
    names `tensors` or `config_dict`)."""

    name: str
    tensors: tuple[tuple[str, Any], ...]
    config: dict[str, Any]
    reply: int


@dataclass(frozen=True, slots=True)
class UnloadLoraAdapter:
    """Remove an adapter's name; requests already using it finish (answered like
    `LoadLoraAdapter`)."""

    name: str
    reply: int


@dataclass(frozen=True, slots=True)
class UpdateWeights:
    """Replace the model's weights between steps (reinforcement learning's rollout engine):
    from a checkpoint directory (`path`: every tensor the model needs) or from `tensors`
    ((checkpoint name, tensor) pairs, or a `tensor_bucket.FlattenedTensorBucket` holding
    them: any subset). The radix cache is flushed when nothing runs (`flush_cache`), and new
    requests never reuse K/V computed before the update either way. Answered with SGLang's
    `{"success", "message", "weight_version"}`."""

    path: str | None
    tensors: tuple[tuple[str, Any], ...] | FlattenedTensorBucket | None
    flush_cache: bool
    weight_version: str | None
    reply: int


@dataclass(frozen=True, slots=True)
class InitWeightsUpdateGroup:
    """Join a trainer's torch.distributed group as rank `rank_offset` of `world_size` (each
    tensor-parallel rank r as `rank_offset + r`; a TCP store at `master_address:master_port`,
    its own process group: not the tensor-parallel one), for `UpdateWeightsFromDistributed`
    (answered `{"success", "message"}`)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    reply: int


@dataclass(frozen=True, slots=True)
class UpdateWeightsFromDistributed:
    """Receive tensors (`names`, `dtypes`, `shapes`, in that order) broadcast by rank 0 of
    group `group_name`, then update the weights with them as `UpdateWeights` does."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    flush_cache: bool
    weight_version: str | None
    reply: int


@dataclass(frozen=True, slots=True)
class PauseGeneration:
    """Stop running steps (requests keep arriving and wait): `abort` ends every open request,
    `retract` sends the running ones back to the queue (their computed tokens to the cache),
    `in_place` keeps them as they are (answered True)."""

    mode: str
    reply: int


@dataclass(frozen=True, slots=True)
class ContinueGeneration:
    """Run steps again after `PauseGeneration` (answered True)."""

    reply: int


@dataclass(frozen=True, slots=True)
class ReleaseMemoryOccupation:
    """Give back the memory of `tags` (`weights`, `kv_cache`, `cuda_graph`; None: all) until
    `ResumeMemoryOccupation`: the radix cache is flushed with the KV pool; no step runs while
    the weights or the KV pool are released (requests queue). Refused while a request runs.
    Answered `{"success", "message"}`."""

    tags: tuple[str, ...] | None
    reply: int


@dataclass(frozen=True, slots=True)
class ResumeMemoryOccupation:
    """Allocate the memory of released `tags` again (None: all): the KV pool empty, the
    weights zeros that hold steps back until updates have written every one (answered
    `{"success", "message"}`)."""

    tags: tuple[str, ...] | None
    reply: int


@dataclass(frozen=True, slots=True)
class GetWeightsByName:
    """The first `truncate_size` rows of a weight, by checkpoint name (answered with nested
    lists of floats)."""

    name: str
    truncate_size: int
    reply: int


@dataclass(frozen=True, slots=True)
class GetServerInfo:
    """Live statistics (answered with a dict)."""

    reply: int


@dataclass(frozen=True, slots=True)
class CheckInvariants:
    """Check the cache and that no KV slot is lost (answered None, or the AssertionError)."""

    reply: int


@dataclass(frozen=True, slots=True)
class Call:
    """Run `function(core)` between steps (thread mode only: tests and inspection)."""

    function: Callable[[Any], Any]
    reply: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop; every open request ends with an error."""


Command = (
    EngineRequest
    | Abort
    | StopSequence
    | FlushCache
    | LoadLoraAdapter
    | LoadLoraAdapterFromTensors
    | UnloadLoraAdapter
    | UpdateWeights
    | InitWeightsUpdateGroup
    | UpdateWeightsFromDistributed
    | PauseGeneration
    | ContinueGeneration
    | ReleaseMemoryOccupation
    | ResumeMemoryOccupation
    | GetWeightsByName
    | GetServerInfo
    | CheckInvariants
    | Call
    | Shutdown
)


# -------------------------------------------------------------------------- events (out)

Entries = tuple[LogprobEntry, ...]


class SeqDelta(NamedTuple):
    """What changed in one sequence since the core's last delta for it: `rollback` output
    tokens taken back, then `new_ids` appended; the core's `finish` (token stops, length,
    grammar, abort; None: it goes on). The front end detokenizes, checks the text stops and
    builds the `GenerateChunk`s (`radixlm.runtime.output_processor`).

    Logprob lists hold the entries of the output positions from `len(ids) - len(new_ids)`
    on, token texts left out (the front end writes them); input logprobs and hidden states
    only the entries not sent before. `committed`: output tokens the grammar can no longer
    take back (None: all of them). A NamedTuple: one is sent per sequence and step, and
    tuples pickle several times faster than dataclasses."""

    rid: str
    index: int  # type: ignore[assignment]  # SGLang's name; shadows tuple.index
    new_ids: tuple[int, ...]
    rollback: int = 0
    finish: FinishReason | None = None
    cached_tokens: int = 0
    #: Of `cached_tokens`, those brought back from host memory and from storage (the
    #: hierarchical cache).
    cached_tiers: tuple[int, int] = (0, 0)
    #: The engine's weight version when this was sent (`update_weights_*`).
    weight_version: str = "default"
    committed: int | None = None
    output_logprobs: Entries = ()
    output_top: tuple[Entries, ...] = ()
    output_ids_logprobs: tuple[Entries, ...] = ()
    input_logprobs: Entries = ()
    input_top: tuple[Entries | None, ...] = ()
    input_ids_logprobs: tuple[Entries | None, ...] = ()
    hidden_states: tuple[Any, ...] = ()
    grammar: dict[str, Any] | None = None
    #: Routed experts not sent yet: (first position, [positions, layers, top_k] int32).
    routed_experts: tuple[int, Any] | None = None
    #: A pooling request's result (its embedding, or its head's outputs), with its finish.
    embedding: tuple[float, ...] | None = None
    #: The core's `time.monotonic()` when the sequence was first scheduled, produced its
    #: first output token and its last one so far (None: not yet); sent on the final delta
    #: and on every delta the front end may end the sequence at (it watches stop strings).
    times: tuple[float | None, float | None, float | None] | None = None


@dataclass(frozen=True, slots=True)
class RequestClosed:
    """Every sequence of the request has sent its final chunk."""

    rid: str


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The request ended with an error instead of (the rest of) its output: InvalidRequest
    (its grammar, its rid), EngineOverloaded (the queue is full), or an engine failure."""

    rid: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The answer to a command that carried a `reply` id."""

    reply: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Stats:
    """The core's live statistics after an iteration (the engine process sends them with its
    outputs, ahead of them, so a reader woken by its request's end sees them updated)."""

    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class EngineDown:
    """The core cannot run another step (a tensor-parallel rank failed) and exits after these
    outputs: the connection reports it unhealthy from now on (it never reaches the front)."""

    reason: str


Output = SeqDelta | RequestClosed | RequestFailed | CommandResult | Stats | EngineDown


# -------------------------------------------------------------------------- startup (out)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the front end needs to know of a started core: the model's limits and the
    static part of the server info (the live part comes with `GetServerInfo`)."""

    context_length: int
    vocab_size: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    generation_config: dict[str, Any]
    architectures: tuple[str, ...]
    max_total_num_tokens: int
    static_info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine process has loaded the model and serves (with its first statistics)."""

    info: EngineInfo
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StartupFailed:
    """The engine process could not start (the message says why); it exits."""

    kind: str  # the exception's type name: TypeError, ValueError, OSError, ...
    message: str
