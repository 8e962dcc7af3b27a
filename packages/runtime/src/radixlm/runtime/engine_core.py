"""EngineCore: the engine loop — commands in, schedule -> run -> update, output deltas out.

Runs on one thread: the engine's background thread, or the main thread of the engine process.
Front ends talk to it only through `post(command)` (the typed messages of
`radixlm.runtime.messages`); it answers only through `emit(outputs)`, called once per loop
iteration with what that iteration produced. It never waits on I/O or on grammar compilation:
a request whose grammar is compiling simply stays in the queue.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from radixlm import kernels
from radixlm.cache import RadixCache
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.detokenizer import load_tokenizer
from radixlm.runtime.disaggregation import (
    Disaggregation,
    KVArrived,
    KVDelivered,
    TransferEvent,
    TransferFailed,
    create_side,
)
from radixlm.runtime.distributed import SINGLE, RankFailure, TensorParallel
from radixlm.runtime.executor import EntryInputs, InputLogprobAsk, ModelExecutor, StepResult
from radixlm.runtime.grammar import GrammarService
from radixlm.runtime.hicache import HierarchicalCache
from radixlm.runtime.loader import safetensors_files
from radixlm.runtime.lora.adapter import LoraAdapterError
from radixlm.runtime.lora.registry import AdapterRegistry
from radixlm.runtime.memory_occupation import KV_CACHE, WEIGHTS, MemoryOccupation, memory_tags
from radixlm.runtime.messages import (
    Abort,
    Call,
    CheckInvariants,
    Command,
    CommandResult,
    ContinueGeneration,
    EngineDown,
    EngineInfo,
    EngineRequest,
    FlushCache,
    GetServerInfo,
    GetWeightsByName,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    LoadLoraAdapterFromTensors,
    Output,
    PauseGeneration,
    ReleaseMemoryOccupation,
    RequestClosed,
    RequestFailed,
    ResumeMemoryOccupation,
    Shutdown,
    Stats,
    StopSequence,
    UnloadLoraAdapter,
    UpdateWeights,
    UpdateWeightsFromDistributed,
)
from radixlm.runtime.model_files import ModelLoadError
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.pooling import finish_embedding
from radixlm.runtime.request_state import RequestHandle, SequenceState, open_request
from radixlm.runtime.routed_experts import RoutedExpertsStore
from radixlm.runtime.sampling_batch import SamplingRequest
from radixlm.runtime.scheduler import ReqStatus, ScheduledBatch, Scheduler
from radixlm.runtime.scheduler.adapters import AdapterSlots
from radixlm.runtime.speculative import NgramDrafter
from radixlm.runtime.speculative.costs import DraftCosts, StepCost, measure_step_cost
from radixlm.runtime.speculative.draft_model import DraftModel, DraftModelDrafter
from radixlm.runtime.speculative.eagle import EagleDrafter, load_eagle_head
from radixlm.runtime.tensor_bucket import FlattenedTensorBucket
from radixlm.runtime.tensor_parallel import StepSender, heartbeat_interval, rank_report
from radixlm.runtime.weight_sync import (
    Failed,
    JoinTrainerGroup,
    LeaveTrainerGroup,
    LoadFromDisk,
    LoadFromRank0,
    LoadFromTrainer,
    ReadWeight,
    WeightSync,
    assemble,
    dtype_name,
    dtype_named,
    first_failure,
)
from radixlm.sampling import EngineOverloaded, EngineUnavailable, InvalidRequest

logger = logging.getLogger("radixlm.runtime.engine")

#: Seconds between checks of compiling grammars while nothing else can run.
_GRAMMAR_POLL_S = 0.002
#: Seconds between the live statistics a busy core sends (process mode).
_STATS_S = 0.05

Emit = Callable[[list[Output]], None]


class EngineCore:
    """The loop's state and one step of it. Not thread-safe except `post`."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: ModelExecutor,
        grammar: GrammarService,
        eos_token_ids: tuple[int, ...],
        emit: Emit,
        jump_forward: bool = True,
        pool_size: int = 0,
        publish_stats: bool = False,
        adapters: AdapterRegistry | None = None,
        default_seed: int | None = None,
    ) -> None:
        self.scheduler = scheduler
        #: The seed of requests that give none (deterministic inference), or None.
        self.default_seed = default_seed
        #: The LoRA adapters by name (None: the engine serves none).
        self.adapters = adapters
        #: The adapter uid of each open request that has one.
        self._lora_of: dict[str, str] = {}
        self.executor = executor
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids
        self.emit = emit
        self.jump_forward = jump_forward
        self.pool_size = pool_size
        #: Send `Stats` with the outputs (at most every `_STATS_S`, and whenever it goes idle):
        #: a front end in another process reads them without asking.
        self.publish_stats = publish_stats
        self._stats_at = 0.0
        self.inbox: queue.SimpleQueue[Command | TransferEvent] = queue.SimpleQueue()
        self.handles: dict[str, RequestHandle] = {}
        #: The engine-side state of each running sequence, by its scheduler request's rid.
        self._seqs: dict[str, SequenceState] = {}
        self._compiling: list[SequenceState] = []
        #: (deadline, rid) of the requests that have a timeout, soonest first.
        self._deadlines: list[tuple[float, str]] = []
        self._out: list[Output] = []
        self._stopped = False
        #: The weights' version (SGLang's `weight_version`, in every response's meta_info)
        #: and how many updates there were (new requests' cache namespace).
        self.weight_version = "default"
        self._weights_epoch = 0
        #: `pause_generation`: no step runs until `continue_generation`.
        self._paused = False
        #: Weight updates on every tensor-parallel rank (rank 0's alone without them), and
        #: the trainers' groups joined for `update_weights_from_distributed`.
        self._weights = WeightSync(executor.runner, executor.sender)
        if adapters is not None and executor.sender is not None:
            adapters.peers = self._weights  # adapters given as tensors reach every rank
        #: `release_memory_occupation`: what is released (no step runs while it matters).
        self.memory = MemoryOccupation(executor.runner)
        #: Prefill/decode disaggregation: this engine's side (None: it prefills and decodes).
        #: Its transfer thread posts its events to the inbox.
        self.disagg: Disaggregation | None = None
        # Statistics.
        self.finished_requests = 0
        self.steps = 0

    # ---------------------------------------------------------------------------- commands

    def post(self, command: Command | TransferEvent) -> None:
        """Hand a command (or a transfer thread's event) to the loop (thread-safe)."""
        self.inbox.put(command)

    def serve(self) -> None:
        """Run until `Shutdown`; every request still open then ends with an error."""
        while not self._stopped:
            try:
                self._drain(block=not self._has_work())
                if not self._stopped and not self._holding():
                    self.step()
            except RankFailure as error:
                # The tensor-parallel group is broken: no step can run again. Every open
                # request ends with the error, then the engine process exits.
                logger.error("a tensor-parallel rank failed; the engine stops: %s", error)
                down = EngineUnavailable(f"the engine is down: {error}")
                self._out.insert(0, EngineDown(str(error)))  # unhealthy before the errors
                for handle in list(self.handles.values()):
                    self._close_with_error(handle, down)
                self._flush()
                raise
            except Exception as error:  # a bug must not leave clients hanging forever
                logger.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_running(error)
            self._flush()
        for handle in list(self.handles.values()):
            self._close_with_error(handle, EngineUnavailable("the engine was shut down"))
        self._flush()
        if self.scheduler.tiers is not None:
            self.scheduler.tiers.close()  # the storage read-ahead thread
        if self.disagg is not None:
            self.disagg.close()  # the K/V transfer thread

    def _flush(self) -> None:
        if self.publish_stats:
            # Every _STATS_S while busy, outputs or not (requests that do not stream send
            # none until they end), and with the last outputs before it goes idle.
            now = time.monotonic()
            if now - self._stats_at >= _STATS_S or (self._out and not self._has_work()):
                self._stats_at = now
                self._out.insert(0, Stats(self.live_stats()))
        if not self._out:
            return
        out, self._out = self._out, []
        self.emit(out)

    def _holding(self) -> bool:
        """No step runs: generation is paused, or the weights or the KV pool are released
        (or the weights were allocated again and updates have not written them all yet).
        Commands still run, and requests queue."""
        return self._paused or not self.memory.ready

    def _has_work(self) -> bool:
        if self._holding():
            return False  # (commands still come in: block on them)
        sched = self.scheduler
        return bool(sched.running) or any(not r.blocked() for r in sched.waiting)

    def _drain(self, block: bool) -> None:
        timeout = _GRAMMAR_POLL_S if self._compiling else None
        first = True
        while True:
            try:
                if first and block:
                    command = self.inbox.get(timeout=timeout)
                else:
                    command = self.inbox.get_nowait()
            except queue.Empty:
                return
            first = False
            self.handle(command)

    def handle(self, command: Command | TransferEvent) -> None:
        """Carry out one command (on the loop's thread)."""
        match command:
            case EngineRequest():
                self.add(command)
            case KVArrived() | KVDelivered() | TransferFailed():
                assert self.disagg is not None, "transfer events come from the transfer thread"
                self._settle_transfers(self.disagg.on_event(command))
            case Abort(rid):
                self.abort(rid)
            case StopSequence(rid, index):
                self.stop_sequence(rid, index)
            case FlushCache(reply):
                flushed = self.scheduler.flush_cache()
                if flushed:
                    self.executor.encoder_cache.clear()
                self._out.append(CommandResult(reply, flushed))
            case LoadLoraAdapter(name, path, reply):
                self._answer(reply, lambda: self._lora_registry().load(name, path))
            case LoadLoraAdapterFromTensors(name, adapter, config, reply):
                self._answer(
                    reply, lambda: self._lora_registry().load_tensors(name, dict(adapter), config)
                )
            case UnloadLoraAdapter(name, reply):
                self._answer(reply, lambda: self._lora_registry().unload(name))
            case UpdateWeights(source, tensors, flush, version, reply):
                result = self.update_weights(source, tensors, flush, version)
                self._out.append(CommandResult(reply, result))
            case InitWeightsUpdateGroup(address, port, offset, size, group, backend, reply):
                result = self.init_weights_update_group(address, port, offset, size, group, backend)
                self._out.append(CommandResult(reply, result))
            case UpdateWeightsFromDistributed(names, dtypes, shapes, group, flush, version, reply):
                result = self.update_weights_from_distributed(
                    names, dtypes, shapes, group, flush, version
                )
                self._out.append(CommandResult(reply, result))
            case PauseGeneration(mode, reply):
                self._answer(reply, lambda: self.pause(mode))
            case ContinueGeneration(reply):
                self._paused = False
                self._out.append(CommandResult(reply, True))
            case ReleaseMemoryOccupation(tags, reply):
                self._answer(reply, lambda: self.release_memory_occupation(tags))
            case ResumeMemoryOccupation(tags, reply):
                self._answer(reply, lambda: self.resume_memory_occupation(tags))
            case GetWeightsByName(name, truncate, reply):
                self._answer(reply, lambda: self.weights_by_name(name, truncate))
            case GetServerInfo(reply):
                self._out.append(CommandResult(reply, self.live_stats()))
            case CheckInvariants(reply):
                self._answer(reply, lambda: self.scheduler.check_memory(self.pool_size))
            case Call(function, reply):
                self._answer(reply, lambda: function(self))
            case Shutdown():
                self._stopped = True

    # ------------------------------------------------------------------------ weights

    def update_weights(
        self,
        path: str | None,
        tensors: Sequence[tuple[str, Any]] | FlattenedTensorBucket | None,
        flush: bool = True,
        version: str | None = None,
    ) -> dict[str, Any]:
        """Replace the model's weights (see `UpdateWeights`); SGLang's answer: success, a
        message, the weight version. Under tensor parallelism every rank loads its shard of
        each tensor (from the directory, or broadcast from here). Running requests go on with
        the new weights; requests that arrive after never reuse K/V computed before (they
        match in a namespace of their own), and the cache is flushed when nothing runs."""
        runner = self.executor.runner
        if isinstance(tensors, FlattenedTensorBucket):
            tensors = tensors.reconstruct_tensors()  # (views of its buffer)
        refusal = self.memory.update_refusal() or self._weights_refusal(runner)
        if refusal is None and path is not None:
            try:
                files = safetensors_files(Path(path))
            except (OSError, ValueError, ModelLoadError) as error:
                refusal = f"update_weights_from_disk: {error}"
            else:
                names = _safetensors_names(files)
                missing = sorted(runner.checkpoint_names() - names)
                if missing:
                    refusal = (
                        f"update_weights_from_disk: {path} lacks {len(missing)} tensor(s) the "
                        f"model needs (e.g. {', '.join(missing[:3])}); nothing was changed"
                    )
        elif refusal is None:
            odd = [(n, t) for n, t in tensors or () if not isinstance(t, torch.Tensor)]
            if odd:
                refusal = (
                    f"update_weights_from_tensor: {odd[0][0]} is a {type(odd[0][1]).__name__}, "
                    "not a torch tensor; nothing was changed"
                )
        if refusal is not None:
            return {"success": False, "message": refusal, "weight_version": self.weight_version}
        if path is not None:
            outcomes = self._weights.run(LoadFromDisk(path))
            written = runner.checkpoint_names()  # (the directory has every one: checked above)
        else:
            pairs = tuple(tensors or ())
            message = LoadFromRank0(
                tuple(name for name, _ in pairs),
                tuple(dtype_name(tensor.dtype) for _, tensor in pairs),
                tuple(tuple(tensor.shape) for _, tensor in pairs),
            )
            outcomes = self._weights.run(message, pairs)
            written = {name for name, _ in pairs}
        return self._updated(first_failure(outcomes), flush, version, written)

    def _updated(
        self, failure: str | None, flush: bool, version: str | None, written: set[str]
    ) -> dict[str, Any]:
        """The answer to an update that ran (`failure`: why it stopped on some rank), after
        moving the weight version and the cache namespace on (`written`: the checkpoint names
        it wrote, which resumed weights count)."""
        self._weights_epoch += 1
        if failure is not None:
            # Names and shapes are checked tensor by tensor as they are copied: the ones
            # before a bad one were replaced already.
            self.weight_version = f"{self.weight_version}+partial"
            return {
                "success": False,
                "message": f"the weights were only partly updated: {failure}",
                "weight_version": self.weight_version,
            }
        self.weight_version = version if version is not None else str(self._weights_epoch)
        self.memory.written(written)
        flushed = flush and self.scheduler.flush_cache()
        if flushed:
            self.executor.encoder_cache.clear()
        return {
            "success": True,
            "message": "the weights were updated"
            + ("" if flushed else "; the cache keeps older K/V that new requests do not reuse"),
            "weight_version": self.weight_version,
        }

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        """Join a trainer's process group (see `InitWeightsUpdateGroup`): every
        tensor-parallel rank joins, rank r as `rank_offset + r` (SGLang's layout); blocks
        until every rank of the group has joined or `GROUP_TIMEOUT` passes."""
        ranks = self.executor.runner.tp.size
        if group_name in self._weights.rank.groups:
            return {"success": False, "message": f"a group named {group_name!r} exists already"}
        if backend not in ("gloo", "nccl"):
            return {"success": False, "message": f"backend must be gloo or nccl; got {backend!r}"}
        if not 0 < rank_offset <= world_size - ranks:
            return {
                "success": False,
                "message": f"rank_offset must be in 1 .. world_size - {ranks} (the trainer is "
                f"rank 0; the engine's {ranks} tensor-parallel rank(s) take rank_offset on); "
                f"got {rank_offset} of {world_size}",
            }
        joined = self._weights.run(
            JoinTrainerGroup(
                master_address, master_port, rank_offset, world_size, group_name, backend
            )
        )
        failure = first_failure(joined)
        if failure is not None:
            self._weights.run(LeaveTrainerGroup(group_name))  # the ranks that did join
            return {"success": False, "message": failure}
        last = f"..{rank_offset + ranks - 1}" if ranks > 1 else ""
        return {"success": True, "message": f"joined {group_name!r} as rank {rank_offset}{last}"}

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        flush: bool = True,
        version: str | None = None,
    ) -> dict[str, Any]:
        """Receive the tensors the trainer (rank 0 of the group) broadcasts, in order, on
        every tensor-parallel rank, each loading its shard."""
        refused = {"success": False, "weight_version": self.weight_version}
        if group_name not in self._weights.rank.groups:
            return {
                **refused,
                "message": f"no group {group_name!r}: call init_weights_update_group first",
            }
        if not len(names) == len(dtypes) == len(shapes):
            return {**refused, "message": "names, dtypes and shapes must be as long as each other"}
        for name, dtype in zip(names, dtypes, strict=True):
            if dtype_named(dtype) is None:
                return {**refused, "message": f"{name}: unknown dtype {dtype!r}"}
        refusal = self.memory.update_refusal() or self._weights_refusal(self.executor.runner)
        message = LoadFromTrainer(
            tuple(names),
            tuple(str(dtype) for dtype in dtypes),
            tuple(tuple(int(n) for n in shape) for shape in shapes),
            group_name,
            load=refusal is None,  # (refused: received all the same, or the trainer waits)
        )
        outcomes = self._weights.run(message)
        if refusal is not None:
            return {**refused, "message": refusal}
        return self._updated(first_failure(outcomes), flush, version, set(names))

    def pause(self, mode: str = "abort") -> bool:
        """Stop running steps until `ContinueGeneration` (see `PauseGeneration`)."""
        if mode not in _PAUSE_MODES:
            raise InvalidRequest(
                "mode", f"mode must be one of {', '.join(_PAUSE_MODES)}; got {mode!r}"
            )
        if mode == "abort":
            for rid in list(self.handles):
                self.abort(rid)
        elif mode == "retract":
            self.scheduler.retract_all()
        self._paused = True
        return True

    def release_memory_occupation(self, tags: Sequence[str] | None) -> dict[str, Any]:
        """Give back the memory of `tags` (see `ReleaseMemoryOccupation`); SGLang's answer.
        Refused while a request runs (SGLang's rule: idle, or paused with its requests
        aborted or retracted); queued requests wait for the resume."""
        chosen = memory_tags(tags)
        running = len(self.scheduler.running)
        refusal = None
        if running:
            refusal = (
                f"{running} request(s) are running and hold KV cache: pause_generation('abort') "
                "or pause_generation('retract') first, or wait until they finish"
            )
        elif self.executor.draft is not None:
            refusal = "releasing memory beside a draft model or an EAGLE head is not available yet"
        refusal = refusal or self.memory.refusal(chosen)
        if refusal is not None:
            return {"success": False, "message": f"nothing was released: {refusal}"}
        if KV_CACHE in chosen and KV_CACHE not in self.memory.released:
            flushed = self.scheduler.flush_cache()  # the slots' contents go
            assert flushed, "the cache flush failed although no request runs"
        if KV_CACHE in chosen or WEIGHTS in chosen:
            self.executor.encoder_cache.clear()
        freed = self.memory.release(chosen)
        return {
            "success": True,
            "message": f"released {', '.join(chosen)} ({freed / 2**20:.1f} MiB); requests "
            "wait until resume_memory_occupation",
        }

    def resume_memory_occupation(self, tags: Sequence[str] | None) -> dict[str, Any]:
        """Allocate the memory of released `tags` again (see `ResumeMemoryOccupation`)."""
        chosen = memory_tags(tags)
        resumed = [tag for tag in chosen if tag in self.memory.released]
        allocated = self.memory.resume(resumed)
        parts = [f"resumed {', '.join(resumed) or 'nothing'} ({allocated / 2**20:.1f} MiB)"]
        if tags and len(resumed) < len(chosen):
            parts.append(f"not released: {', '.join(t for t in chosen if t not in resumed)}")
        if WEIGHTS in resumed:
            parts.append(
                "the weights hold zeros: requests wait until update_weights_* has written every one"
            )
        if self.memory.released:
            parts.append(f"still released: {', '.join(self.memory.released)}")
        return {"success": True, "message": "; ".join(parts)}

    def _weights_refusal(self, runner: ModelRunner) -> str | None:
        """Why this model's weights cannot be updated, or None. A model quantized at load
        time quantizes the new weights the same way; weights stored quantized cannot be."""
        quant = runner.info.quantization
        if quant is None:
            return None
        if quant.source == "gguf":
            return (
                "updating the weights of a GGUF file's model is not available: its weights are "
                "the file's quantized blocks, which radixlm does not make from full-precision "
                "tensors; serve a safetensors checkpoint (with quantization='int4' or 'int8' "
                "to keep it small), or the GGUF file with quantization='int4' or 'int8'"
            )
        if quant.source != "load_time":
            return (
                f"updating the weights of a {quant.method} checkpoint is not available: they "
                "were quantized by the checkpoint's own tool; serve the full-precision "
                "checkpoint with quantization='int4' or 'int8' (quantized at load time, and "
                "again at each update)"
            )
        if quant.format == "fp8" and runner.device.type != "cuda":
            return (
                "updating fp8 weights on the CPU is not available (they are kept dequantized "
                "there); serve the model with quantization='int8' or 'int4'"
            )
        return None

    def weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first `truncate_size` rows of a weight by checkpoint name, as lists: the whole
        tensor's, gathered from every tensor-parallel rank's shard."""
        if WEIGHTS in self.memory.released:
            raise InvalidRequest(
                "name",
                "the weights are released (release_memory_occupation): resume_memory_occupation"
                "(['weights']) and update them before reading one",
            )
        parts = self._weights.run(ReadWeight(name, max(0, truncate_size)))
        if isinstance(parts[0], Failed):
            raise InvalidRequest("name", parts[0].message)
        failure = first_failure(parts)
        if failure is not None:
            raise RuntimeError(f"get_weights_by_name: {failure}")
        values: list[Any] = assemble(parts).tolist()
        return values

    def _answer(self, reply: int, function: Callable[[], Any]) -> None:
        try:
            self._out.append(CommandResult(reply, function()))
        except LoraAdapterError as error:  # bad input: a 400 naming the field
            self._out.append(CommandResult(reply, None, InvalidRequest(error.field, str(error))))
        except Exception as error:  # the caller gets it
            self._out.append(CommandResult(reply, None, error))

    def _lora_registry(self) -> AdapterRegistry:
        if self.adapters is None:
            raise InvalidRequest(
                "lora_name",
                "this engine serves no LoRA adapters; start it with --enable-lora "
                "(or --lora-paths) to load them",
            )
        return self.adapters

    def add(self, request: EngineRequest) -> None:
        """Queue every sequence of a request, or fail it: a grammar that cannot be compiled,
        a full queue (the scheduler's `max_queued_requests`). Its rid is unique: the front end,
        which routes outputs by rid, refuses one already in use."""
        rid = request.rid
        lora: tuple[str, str] | None = None
        try:
            if request.lora_name is not None:
                # Checked again here: the adapter may have been unloaded since the front end
                # checked the name.
                lora = self._lora_registry().resolve(request.lora_name)
            if self.disagg is not None:
                self.disagg.check(request)
            future = self.grammar.submit(request.params)
        except InvalidRequest as error:
            self._out.append(RequestFailed(rid, error))
            return
        handle = open_request(
            request,
            self.eos_token_ids,
            future,
            prefix_sharing=self.scheduler.caching,
            lora=lora,
            default_seed=self.default_seed,
        )
        inputs = _entry_inputs(handle)  # fixed for the request's life
        for seq in handle.seqs:
            seq.inputs = inputs
        if self._weights_epoch:
            # K/V cached under earlier weights is never reused: a namespace per update.
            for seq in handle.seqs:
                seq.req.extra_key = (_WEIGHTS, self._weights_epoch, seq.req.extra_key)
        added = []
        bumped = []
        # A decode engine keeps a disaggregated request aside until its K/V comes.
        aside = (
            self.disagg is not None and request.bootstrap is not None and self.disagg.take(handle)
        )
        try:
            for seq in [] if aside else handle.seqs:
                other = self.scheduler.add(seq.req)
                added.append(seq)
                if other is not None:
                    bumped.append(self._seqs[other.rid].handle)
        except EngineOverloaded as error:
            for seq in added:
                self.scheduler.abort(seq.req)
            for seq in handle.seqs:
                seq.stops.abort(str(error))
            handle.closed = True
            self._out.append(RequestFailed(rid, error))
            self._forget(handle)  # (a prefill engine tells the decode engine)
            return
        for other_handle in bumped:  # priority scheduling gave their places to this one
            self._close_with_error(
                other_handle,
                EngineOverloaded(
                    "the engine's queue is full and a request of higher priority took this "
                    "one's place; retry later"
                ),
            )
        self.handles[rid] = handle
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, rid))
        if lora is not None and self.adapters is not None:
            self.adapters.open(lora[0])
            self._lora_of[rid] = lora[0]
        self._seqs.update((seq.req.rid, seq) for seq in handle.seqs)
        self._compiling.extend(s for s in handle.seqs if s.req.grammar_pending)
        if self.scheduler.drafter is not None:
            for seq in handle.seqs:
                seq.req.speculate = self._may_speculate(seq)

    def _may_speculate(self, seq: SequenceState) -> bool:
        """Whether a sequence's decodes may carry drafts: not when a step's rows would need
        what only a one-token step provides (a custom logit processor, a thinking budget's
        forced token, per-token hidden states, embeddings or media, routed experts)."""
        handle = seq.handle
        return (
            handle.custom_logit_processor is None
            and seq.thinking is None
            and seq.inputs is None
            and seq.routed is None
            and self.executor.routed_store is None
        )

    def abort(self, rid: str, message: str = "aborted by request") -> bool:
        """End a request: its sequences finish with `abort` (with `message`), all its memory
        is freed."""
        handle = self.handles.get(rid)
        if handle is None:
            return False
        for seq in handle.seqs:
            if seq.finish is None:
                self.scheduler.abort(seq.req)
                seq.stops.abort(message)
                seq.dirty = True
        if self.disagg is not None:
            self.disagg.abort(handle, message)
        self._emit(handle)
        return True

    def _expire(self) -> None:
        """End the requests whose timeout has passed (finish reason abort; what they
        generated is kept and their computed tokens are freed, not cached)."""
        now = time.monotonic()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _deadline, rid = heapq.heappop(deadlines)
            handle = self.handles.get(rid)
            if handle is not None:
                timeout = handle.request.deadline - handle.request.created  # type: ignore[operator]
                self.abort(rid, f"the request timed out after {timeout:.3g} s (its timeout)")

    def stop_sequence(self, rid: str, index: int) -> None:
        """The front end found a stop string: the sequence ends normally (its computed tokens
        are cached), without another delta (the front end sent its final chunk)."""
        handle = self.handles.get(rid)
        if handle is None or index >= len(handle.seqs):
            return
        seq = handle.seqs[index]
        seq.quiet = True
        if seq.finish is None:
            self.scheduler.finish(seq.req)
            seq.stops.stop(message="a stop string (found by the front end)")
        self._emit(handle)

    def live_stats(self) -> dict[str, Any]:
        """The loop's live statistics (a snapshot; counters are cumulative)."""
        sched = self.scheduler
        total = self.pool_size
        free = sched.pool.available + sched.evictable_tokens()
        stats = self.executor.runner.stats
        return {
            "num_running_reqs": len(sched.running),
            "num_queued_reqs": len(sched.waiting),
            "token_usage": (total - free) / total if total else 0.0,
            "cache_hit_rate": sched.cached_tokens / sched.prompt_tokens
            if sched.prompt_tokens
            else 0.0,
            "prompt_tokens": sched.prompt_tokens,
            "cached_tokens": sched.cached_tokens,
            "cache_size": sched.cache.total_size,
            # The hierarchical cache: prompt tokens brought back from host memory / storage.
            **(
                {
                    "host_cached_tokens": sched.host_cached_tokens,
                    "storage_cached_tokens": sched.storage_cached_tokens,
                    **sched.tiers.stats(),
                }
                if sched.tiers is not None
                else {}
            ),
            "generated_tokens": sched.generated_tokens,
            "jump_forward_tokens": sched.jump_forward_tokens,
            "grammar_rollbacks": sched.grammar_rollbacks,
            # Speculative decoding: drafts verified, accepted, and tokens per verify step
            # (SGLang's avg_spec_accept_length: the accepted drafts plus the token after them).
            "spec_verify_steps": sched.verify_steps,
            "spec_draft_tokens": sched.draft_tokens,
            "spec_accepted_tokens": sched.accepted_tokens,
            "avg_spec_accept_length": (sched.accepted_tokens + sched.verify_steps)
            / sched.verify_steps
            if sched.verify_steps
            else 0.0,
            "finished_requests": self.finished_requests,
            "num_retractions": sched.num_retractions,
            "forward_passes": stats.forward_calls,
            "tokens_forwarded": stats.tokens_forwarded,
            # Images and videos run through the vision encoder / found in its cache.
            "media_encoded": self.executor.encoder_cache.stats.encoded,
            "media_encoder_cache_hits": self.executor.encoder_cache.stats.hits,
            # Rank 0's time in the forward's collectives (0 without tensor parallelism).
            "tp_collective_seconds": self.executor.runner.tp.timing.seconds,
            # `release_memory_occupation`: the tags released, and the weights allocated again
            # that no update has written yet (no step runs while the weights or kv_cache
            # are released, or while weights_unwritten > 0).
            **self.memory.stats(),
            **(self.adapters.stats() if self.adapters is not None else {}),
            **(self.disagg.stats() if self.disagg is not None else {}),
        }

    # -------------------------------------------------------------------------------- step

    def step(self) -> None:
        """One scheduling step (does nothing when nothing can run)."""
        if self._deadlines:
            self._expire()
        self._poll_grammars()
        if self.disagg is not None:
            # Requests whose K/V came from their prefill engine join the running batch.
            self._settle_transfers(self.disagg.admit())
        batch = self.scheduler.schedule()
        touched: dict[str, RequestHandle] = {}
        for req in batch.dropped:
            seq = self._seqs[req.rid]
            seq.stops.abort("the request does not fit in the KV cache")
            seq.dirty = True
            touched[seq.handle.rid] = seq.handle
        if batch.entries:
            self.steps += 1
            self._run(batch, touched)
        for handle in touched.values():
            self._emit(handle)

    def _run(self, batch: ScheduledBatch, touched: dict[str, RequestHandle]) -> None:
        sampling: list[SamplingRequest | list[SamplingRequest] | None] = []
        asks: list[InputLogprobAsk | None] = []
        grammars: list[Any] = []
        drafts: list[Sequence[int]] = []
        inputs: list[EntryInputs | None] = []
        started = time.monotonic()
        seqs = self._seqs
        for entry in batch.entries:
            seq = seqs[entry.req.rid]
            if seq.scheduled_at is None:
                seq.scheduled_at = started
            inputs.append(seq.inputs)
            if entry.logprob_targets is None:
                asks.append(None)
            else:
                options = seq.handle.logprobs
                asks.append(InputLogprobAsk(options.top, options.token_ids))
            if entry.draft:
                sampling.append(self._verify_requests(seq, entry.draft))
                grammars.append(seq.grammar)
                drafts.append(entry.draft)
            elif entry.sample and seq.pooled is None:
                sampling.append(self._sampling_request(seq))
                grammars.append(seq.grammar)
                drafts.append(())
            else:  # a prefill chunk before the last, or a pooling request (nothing sampled)
                sampling.append(None)
        result = self.executor.run(
            batch,
            sampling,
            asks,
            self.grammar.bitmask(grammars, drafts),
            inputs if any(inputs) else None,
        )
        store = self.executor.routed_store
        if store is not None:
            # Read while the requests still hold their slots (the update may free them).
            for entry in batch.entries:
                tape = self._seqs[entry.req.rid].routed
                if tape is not None and entry.req.status is ReqStatus.RUNNING:
                    end = entry.prefix_len + len(entry.input_ids)
                    tape.extend(store, entry.req.kv_slots, entry.prefix_len, end)
        if (
            result.hidden_states is not None
            or any(a is not None for a in asks)
            or any(lp is not None for lp in result.logprobs)
        ):
            self._record(batch, result)
        if self.disagg is not None:
            # A prefill engine copies out the K/V of the prompts that just sampled their
            # first token, before the update phase ends their requests.
            self.disagg.capture(batch, result.tokens)
        # The one update phase: the scheduler appends, takes back, stops and ends requests.
        updated = self.scheduler.update(batch, result.tokens, result.accepted)
        if self.disagg is not None:
            self.disagg.after_update()
        done = time.monotonic()
        for update in updated:
            req = update.req
            seq = seqs[req.rid]
            if req.output_ids:
                if seq.first_token_at is None:
                    seq.first_token_at = done
                seq.last_token_at = done
            # Logprobs of tokens taken back (or of a token the grammar refused) go too.
            if len(seq.output_logprobs) > len(req.output_ids):
                seq.truncate_logprobs(len(req.output_ids))
            seq.dirty = True
            handle = seq.handle
            touched[handle.request.rid] = handle

    def _record(self, batch: ScheduledBatch, result: StepResult) -> None:
        """What the forward computed besides tokens (hidden states, logprobs), recorded while
        the rows line up with the batch."""
        hidden = result.hidden_states or [None] * len(batch.entries)
        drafted = result.draft_logprobs or [None] * len(batch.entries)
        pooled: list[SequenceState] = []
        for entry, token, logprob, scored, rows, before in zip(
            batch.entries,
            result.tokens,
            result.logprobs,
            result.input_logprobs,
            hidden,
            drafted,
            strict=True,
        ):
            if entry.req.status is not ReqStatus.RUNNING:
                continue
            seq = self._seqs[entry.req.rid]
            if rows is not None and seq.hidden_states is not None:
                seq.hidden_states.record(entry.prefix_len, rows)
            if rows is not None and seq.pooled is not None:
                seq.pooled.record(entry.prefix_len, rows)
                if seq.pooled.done and seq.embedding is None:
                    pooled.append(seq)
            if entry.logprob_targets is not None:
                seq.record_input_logprobs(scored or [])
            if logprob is not None and entry.sample and token is not None:
                for accepted in before or ():  # the accepted drafts come first
                    seq.record_output_logprob(accepted)
                seq.record_output_logprob(logprob)
        if pooled:
            self._finish_pooling(pooled)

    def _finish_pooling(self, seqs: list[SequenceState]) -> None:
        """The results of the pooling requests whose prompt is computed: the head over their
        pooled rows (one call), then each embedding as its request asked (Matryoshka
        dimensions, normalisation)."""
        vectors = [seq.pooled.vector for seq in seqs if seq.pooled is not None]
        outputs = self.executor.runner.pool_head(torch.stack(vectors))  # type: ignore[arg-type]
        for seq, row in zip(seqs, outputs.cpu(), strict=True):
            ask = seq.handle.request.pooling
            assert ask is not None, "a pooled sequence has its pooling ask"
            seq.embedding = tuple(finish_embedding(row, ask.normalize, ask.dimensions))

    def _sampling_request(self, seq: SequenceState) -> SamplingRequest:
        """The sequence's sampling inputs: the same object every step (which lets the
        executor reuse the last step's sampling tensors) unless the thinking budget forces a
        token."""
        cached = seq.sampling
        if (
            cached is not None
            and seq.thinking is None
            and cached.output_ids is seq.req.output_ids
            and cached.prompt_ids is seq.req.prompt_ids
        ):
            return cached
        handle = seq.handle
        seq.sampling = SamplingRequest(
            params=handle.params,
            prompt_ids=seq.req.prompt_ids,
            output_ids=seq.req.output_ids,
            eos_token_ids=self.eos_token_ids,
            bad_words_ids=seq.bad_words_ids,
            return_logprob=handle.logprobs.enabled,
            top_logprobs_num=handle.logprobs.top,
            token_ids_logprob=handle.logprobs.token_ids,
            custom_logit_processor=handle.custom_logit_processor,
            seed=seq.seed,
            forced_token_id=(
                None if seq.thinking is None else seq.thinking.forced_token(seq.req.output_ids)
            ),
        )
        return seq.sampling

    def _verify_requests(self, seq: SequenceState, draft: Sequence[int]) -> list[SamplingRequest]:
        """The sampling inputs of each verify row of a step with drafts: row i sees the first
        i drafts as output (penalties, bans, seeds and `min_new_tokens` count them)."""
        base = self._sampling_request(seq)
        rows = [base]
        output = list(seq.req.output_ids)
        for token in draft:
            output.append(token)
            rows.append(dataclasses.replace(base, output_ids=list(output)))
        return rows

    # ------------------------------------------------------------------------------ grammar

    def _poll_grammars(self) -> None:
        if not self._compiling:
            return
        still: list[SequenceState] = []
        for seq in self._compiling:
            future = seq.grammar_future
            if seq.finish is not None:
                continue
            if not future.done():
                still.append(seq)
                continue
            try:
                compiled = future.result()
            except Exception as error:  # a GrammarError (InvalidRequest) for this request only
                self._close_with_error(seq.handle, self.grammar.explain(error))
                continue
            req = seq.req
            # With `grammar_after` (the end of the thinking) it constrains from the token after.
            req.grammar = self.grammar.gate(
                self.grammar.matcher(compiled), seq.handle.request.grammar_after
            )
            # Forced tokens are appended unless the request wants logprobs of each one.
            req.jump_forward = self.jump_forward and not seq.handle.logprobs.enabled
            seq.grammar_info = self.grammar.describe(compiled)
            req.grammar_pending = False
        self._compiling = still

    # ------------------------------------------------------------------------------ output

    def _emit(self, handle: RequestHandle) -> None:
        """Queue the deltas of the request's sequences that changed (every step while it
        streams or the front end watches its text, else once it ends); close it once every
        sequence finished."""
        if handle.closed or (self.disagg is not None and self.disagg.holds(handle)):
            return  # (a prefill engine's request ends once the decode engine has its K/V)
        stream = handle.request.stream
        finished = True
        for seq in handle.seqs:
            ended = seq.stops.finish is not None
            finished = finished and ended
            if seq.dirty and not seq.quiet and (stream or seq.watch_text or ended):
                self._out.append(seq.delta(self.weight_version))
        if finished:
            handle.closed = True
            self._out.append(RequestClosed(handle.rid))
            self.finished_requests += 1
            self._forget(handle)

    def _close_with_error(self, handle: RequestHandle, error: BaseException) -> None:
        for seq in handle.seqs:
            if seq.finish is None:
                self.scheduler.abort(seq.req)
                seq.stops.abort(str(error))
        if not handle.closed:
            handle.closed = True
            self._out.append(RequestFailed(handle.rid, error))
        self._forget(handle)

    def _settle_transfers(self, outcomes: list[tuple[RequestHandle, str | None]]) -> None:
        """Emit the requests a transfer moved on; abort those it failed, with its message."""
        for handle, message in outcomes:
            if message is None:
                self._emit(handle)
            else:
                self.abort(handle.rid, message)

    def _forget(self, handle: RequestHandle) -> None:
        if self.disagg is not None and handle.request.bootstrap is not None:
            self.disagg.forget(handle)
        self.handles.pop(handle.rid, None)
        uid = self._lora_of.pop(handle.rid, None)
        if uid is not None and self.adapters is not None:
            self.adapters.close(uid)
        for seq in handle.seqs:
            self._seqs.pop(seq.req.rid, None)

    def _fail_running(self, error: BaseException) -> None:
        """After a failed step: end every running request with the error, free their memory."""
        running = [self._seqs[req.rid].handle for req in self.scheduler.running]
        failed = {handle.rid: handle for handle in running}
        for handle in failed.values():
            self._close_with_error(handle, RuntimeError(f"the engine step failed: {error}"))


def _entry_inputs(handle: RequestHandle) -> EntryInputs | None:
    """What the executor needs besides ids (None for a plain token request: no cost)."""
    request = handle.request
    multimodal = request.multimodal
    pooling = request.pooling
    if pooling is not None:  # every pooling step returns its rows
        return EntryInputs(handle.input_embeds, True, multimodal, pooling.token_type_ids)
    if handle.input_embeds is None and not handle.return_hidden_states and multimodal is None:
        return None
    return EntryInputs(handle.input_embeds, handle.return_hidden_states, multimodal)


def _hierarchical_cache(config: EngineConfig, runner: ModelRunner) -> HierarchicalCache | None:
    """The host pool and storage under the KV pool (`enable_hierarchical_cache`), or None."""
    if not config.cache.hierarchical:
        return None
    if runner.tp.enabled:
        raise ValueError(
            "enable_hierarchical_cache is not available under tensor parallelism yet "
            "(each rank's K/V shard would need its own tiers): drop it or tp_size"
        )
    # The model and every setting that changes its K/V name the pages: a storage shared by
    # replicas of another model, dtype or quantization never serves them.
    fingerprint = repr((config.runner.model, runner.kv_pool.dtype, runner.info.arch))
    return HierarchicalCache(config.cache, runner.kv_pool, fingerprint)


def _eagle_drafter(
    config: EngineConfig, runner: ModelRunner, step_tokens: int | None, cost: StepCost
) -> EagleDrafter:
    """An EAGLE / EAGLE-3 head over `runner`, which from now on keeps its features."""
    spec = config.speculative
    assert spec.draft_model_path is not None and spec.algorithm is not None
    if runner.tp.enabled:
        raise ValueError(
            f"speculative_algorithm {spec.algorithm} is not available under tensor "
            "parallelism yet (the head reads the target's sharded embedding); use NGRAM or "
            "STANDALONE"
        )
    head, layers = load_eagle_head(spec.draft_model_path, spec.algorithm, runner)
    runner.capture_features("final" if spec.algorithm == "EAGLE" else "aux", layers)
    # A head step costs about its weights' share of the target's.
    share = sum(p.numel() * p.element_size() for p in head.parameters())
    head_cost = cost.scaled(share / max(runner.weight_bytes, 1))
    return EagleDrafter(
        head,
        runner,
        spec.max_draft,
        spec.disable_by_batch_size,
        step_tokens,
        DraftCosts(cost, head_cost, step_tokens),
    )


def create_core(
    config: EngineConfig,
    emit: Emit,
    runner: ModelRunner | None = None,
    tokenizer: Any = None,
    publish_stats: bool = False,
    tp: TensorParallel | None = None,
) -> tuple[EngineCore, EngineInfo]:
    """Build the model runner (unless given), the cache, the scheduler and the grammar
    service, and the core over them; with what the front end needs to know of them.
    Under tensor parallelism (`tp`, rank 0 of a group whose other ranks are starting) the
    runner holds rank 0's shard."""
    spec = config.speculative
    # A draft model loads first: the target's KV budget leaves room for its K/V.
    draft = DraftModel(config) if spec.algorithm == "STANDALONE" else None
    if runner is None:
        runner = ModelRunner(
            config.runner,
            tp=tp or SINGLE,
            extra_kv_bytes_per_token=draft.kv_bytes_per_token() if draft else 0,
        )
    ranks = rank_report(runner)
    sender = None
    if runner.tp.enabled:
        sender = StepSender(runner.tp, heartbeat_interval(config.runner.parallel.timeout))
    tokenizer = tokenizer or load_tokenizer(config.tokenizer_path or config.model_path)
    info = runner.info
    eos = set(info.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    eos_token_ids = tuple(sorted(eos))
    pool = runner.kv_pool
    scheduler_config = config.scheduler
    if info.pooling is not None and spec.enabled:
        raise ValueError(
            "speculative decoding does not apply to a pooling model (it decodes nothing): "
            "drop speculative_algorithm"
        )
    if info.encoder:
        # Bidirectional: a prompt is computed whole, in one step, and never cached.
        scheduler_config = dataclasses.replace(scheduler_config, chunked_prefill_size=None)
    cache = RadixCache(
        page_size=pool.page_size,
        eviction_policy=config.cache.eviction_policy,
        disable=config.cache.disable_radix_cache or info.encoder,
    )
    rows = runner.req_to_token_pool
    slots = registry = None
    if runner.lora is not None:
        slots = AdapterSlots(runner.lora.shape.slots)
        registry = AdapterRegistry(runner.lora, slots)
        for adapter in runner.initial_adapters:
            registry.add(adapter)
    drafter: NgramDrafter | DraftModelDrafter | EagleDrafter | None = None
    # On the CPU decode path a step of up to MAX_ROWS tokens is one C call that reads the
    # weights once; past it a second call reads them again: drafts stop there.
    step_tokens = kernels.cpu.MAX_ROWS if runner.cpu_decode is not None else None
    # A CPU step's cost is measured: the C kernels' int4 rows cost nearly a step each, float32
    # ones next to nothing (see `speculative.costs`).
    cost = None
    if spec.enabled and runner.device.type == "cpu" and not runner.tp.enabled:
        # Up to the rows a step with drafts may take: a row costs more past a few.
        cost = measure_step_cost(runner, step_tokens or 8)
    if draft is not None:
        drafter = draft.drafter(
            runner, spec.max_draft, spec.disable_by_batch_size, step_tokens, cost
        )
    elif spec.algorithm in ("EAGLE", "EAGLE3"):
        drafter = _eagle_drafter(config, runner, step_tokens, cost or StepCost.assumed())
    elif spec.enabled:
        drafter = NgramDrafter(
            cache,
            spec.max_draft,
            spec.ngram_min_match_window_size,
            spec.ngram_max_match_window_size,
            spec.disable_by_batch_size,
            step_tokens,
            cost,
        )
    scheduler = Scheduler(
        scheduler_config,
        pool,
        rows,
        cache,
        rows.max_requests,
        runner.context_length,
        slots,
        drafter,
        _hierarchical_cache(config, runner),
    )
    grammar = GrammarService(config.grammar, tokenizer, runner.vocab_size, eos_token_ids)
    moe = info.arch.moe
    routed_store = None
    if config.enable_return_routed_experts and moe is not None:
        routed_store = RoutedExpertsStore(
            pool.num_slots, info.arch.num_layers, moe.top_k, sorted(moe.sparse_layers)
        )
        runner.model.model.routed.enabled = True
        # A replayed CUDA graph would not run the code that records the routing.
        runner.graph_runner = None
    core = EngineCore(
        scheduler,
        ModelExecutor(
            runner,
            seed=config.scheduler.random_seed,
            sender=sender,
            encoder_cache_size=config.media.encoder_cache_size,
            routed_store=routed_store,
            draft=drafter if isinstance(drafter, DraftModelDrafter | EagleDrafter) else None,
        ),
        grammar,
        eos_token_ids,
        emit,
        jump_forward=config.grammar.jump_forward,
        pool_size=pool.num_slots,
        publish_stats=publish_stats,
        adapters=registry,
        default_seed=config.scheduler.random_seed if config.runner.deterministic else None,
    )
    quant = info.quantization
    static = {
        **grammar.settings(),
        # The compute dtype `dtype: auto` chose on this device, and why.
        "dtype": str(runner.dtype).removeprefix("torch."),
        "dtype_reason": info.dtype_reason,
        "device": str(runner.device),
        # The linear layers' quantized format (None: full precision), and the KV pool's dtype.
        "quantization": quant.describe() if quant else None,
        "kv_cache_dtype": str(pool.dtype).removeprefix("torch."),
        "tp_size": runner.tp.size,
        # Batch-invariant inference (`enable_deterministic_inference`).
        "deterministic_inference": config.runner.deterministic,
        # Speculative decoding: the algorithm and drafts per step (None: off).
        "speculative_algorithm": spec.algorithm,
        "speculative_num_draft_tokens": spec.max_draft + 1 if spec.enabled else None,
        # A mixture-of-experts model's experts (None: a dense model), and whether the routing
        # is kept for `return_routed_experts`.
        "moe": None
        if moe is None
        else {
            "num_experts": moe.num_experts,
            "top_k": moe.top_k,
            "num_layers": info.arch.num_layers,
            "sparse_layers": sorted(moe.sparse_layers),
            "ep_size": moe.ep_size,
        },
        "routed_experts": routed_store is not None,
        # A pooling model's task, pooling and labels (None: a generative model).
        "pooling": None if info.pooling is None else info.pooling.as_dict(info.arch.hidden_size),
        # The adapter pool: None without LoRA, else its slots, largest rank and projections.
        "lora": None
        if runner.lora is None
        else {
            "max_loras_per_batch": runner.lora.shape.slots,
            "max_lora_rank": runner.lora.shape.max_rank,
            "lora_target_modules": sorted(runner.lora.shape.targets),
            "initial_adapters": registry.listing() if registry is not None else {},
        },
    }
    # Each rank's memory after loading: its weights, its KV pool, its resident size.
    static["tp_ranks"] = ranks
    if config.disaggregation.enabled:
        if info.pooling is not None:
            raise ValueError(
                f"disaggregation_mode {config.disaggregation.mode} is for generation; a "
                "pooling model computes its prompts only: drop the disaggregation mode"
            )
        architectures = getattr(info.hf_config, "architectures", None) or ["unknown"]
        core.disagg = create_side(
            config.disaggregation, scheduler, pool, str(architectures[0]), core.post
        )
    # Prefill/decode disaggregation: the mode, backend and (prefill) bootstrap port.
    static["disaggregation"] = core.disagg.describe() if core.disagg is not None else None
    engine_info = EngineInfo(
        context_length=runner.context_length,
        vocab_size=runner.vocab_size,
        hidden_size=info.arch.hidden_size,
        eos_token_ids=eos_token_ids,
        generation_config=dict(info.generation_config),
        architectures=tuple(getattr(info.hf_config, "architectures", None) or ()),
        max_total_num_tokens=pool.num_slots,
        static_info=static,
    )
    return core, engine_info


#: Marks the cache namespace of requests that arrived after a weight update.
_WEIGHTS = "weights"
#: `pause_generation`'s modes.
_PAUSE_MODES = ("abort", "retract", "in_place")


def _safetensors_names(files: Sequence[Path]) -> set[str]:
    """The tensor names of safetensors files (from their headers: nothing else is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names
