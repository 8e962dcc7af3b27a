"""Weight updates on every tensor-parallel rank, each rank loading its own shard.

The engine core (rank 0) turns an update into one of the messages below and hands it to
`WeightSync.run`, which sends it to the other ranks on the channel the steps use, carries it
out on rank 0 too, and returns every rank's outcome. Each rank (`RankWeights`) feeds the full
tensors through its model's loader, whose layers keep this rank's slice, exactly as at start:

- from disk: every rank reads the checkpoint directory itself, slice by slice;
- from tensors: rank 0 holds them whole and broadcasts them over the tensor-parallel group,
  one after another;
- from a trainer: every rank joined the trainer's group (as rank `rank_offset + tp_rank`, as
  SGLang's ranks do) and receives each tensor the trainer broadcasts.

Every rank takes part in every broadcast of an update even when a tensor fails to load on it
(the rest are received and dropped), so the group never waits on a rank that gave up.
Without tensor parallelism the same code runs on rank 0 alone.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from radixlm.runtime.distributed import RankFailure
from radixlm.runtime.loader import iter_safetensors, iter_safetensors_slices, safetensors_files
from radixlm.runtime.lora.adapter import LoraAdapter
from radixlm.runtime.model_runner import ModelRunner, WeightPart

if TYPE_CHECKING:
    from radixlm.runtime.tensor_parallel import StepSender

logger = logging.getLogger("radixlm.runtime.weights")

#: Seconds a trainer's group waits for its ranks (joining, and each broadcast).
GROUP_TIMEOUT = 300.0


@dataclass(frozen=True)
class LoadFromDisk:
    """Every rank loads its shard of each tensor of a safetensors checkpoint directory."""

    path: str


@dataclass(frozen=True)
class LoadFromRank0:
    """Rank 0 broadcasts these tensors (its own, whole) over the tensor-parallel group, in
    order; every rank loads its shard of each."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class JoinTrainerGroup:
    """Every rank joins a trainer's process group as rank `rank_offset + tp_rank`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True)
class LeaveTrainerGroup:
    """Every rank forgets a trainer's group (one that not every rank could join)."""

    group_name: str


@dataclass(frozen=True)
class LoadFromTrainer:
    """Every rank receives the tensors the trainer (rank 0 of the group) broadcasts, in order,
    and loads its shard of each (drops them, when the update is refused: the trainer still
    sends them)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    load: bool = True


@dataclass(frozen=True)
class ReadWeight:
    """Every rank reports its part of a weight, cut to the whole tensor's first `rows` rows."""

    name: str
    rows: int


@dataclass(frozen=True)
class AddAdapter:
    """The other ranks register a LoRA adapter given as tensors (rank 0's registry keeps its
    own)."""

    uid: str
    adapter: LoraAdapter


@dataclass(frozen=True)
class RemoveAdapter:
    """The other ranks forget a LoRA adapter given as tensors."""

    uid: str


#: The messages `RankWeights.carry_out` takes (the workers' step loop routes them there).
WEIGHT_MESSAGES = (
    LoadFromDisk,
    LoadFromRank0,
    JoinTrainerGroup,
    LeaveTrainerGroup,
    LoadFromTrainer,
    ReadWeight,
    AddAdapter,
    RemoveAdapter,
)
WeightMessage = (
    LoadFromDisk
    | LoadFromRank0
    | JoinTrainerGroup
    | LeaveTrainerGroup
    | LoadFromTrainer
    | ReadWeight
    | AddAdapter
    | RemoveAdapter
)


@dataclass(frozen=True)
class Failed:
    """A rank's outcome when the message failed there: why."""

    message: str


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype of a name (`bfloat16`, `torch.bfloat16`), or None."""
    kind = getattr(torch, str(name).removeprefix("torch."), None)
    return kind if isinstance(kind, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def first_failure(outcomes: Sequence[Any]) -> str | None:
    """The first rank's reason among the outcomes that failed, naming the rank under tensor
    parallelism; None when none did."""
    for rank, outcome in enumerate(outcomes):
        if isinstance(outcome, Failed):
            return outcome.message if len(outcomes) == 1 else f"rank {rank}: {outcome.message}"
    return None


def assemble(parts: Sequence[WeightPart]) -> torch.Tensor:
    """The whole of a weight (its first rows, as `ReadWeight` cut them) from every rank's
    part: rows of a column-parallel projection or of the vocabulary, input columns of a
    row-parallel one, or the tensor itself (replicated on every rank)."""
    first = parts[0]
    if all(p.start == 0 and p.values.shape[p.dim] == p.size for p in parts if p.values.dim()):
        return first.values
    shape = list(first.values.shape)
    ends = [p.start + p.values.shape[p.dim] for p in parts if p.values.shape[p.dim]]
    shape[first.dim] = max(ends, default=0)  # (rows past the cut are in no part)
    whole = first.values.new_empty(shape)
    for part in parts:
        count = part.values.shape[part.dim]
        if count:
            whole.narrow(part.dim, part.start, count).copy_(part.values)
    return whole


class RankWeights:
    """One rank's side of weight updates: its runner and the trainers' groups it joined."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        #: Trainers' process groups this rank joined, by name: (group, backend).
        self.groups: dict[str, tuple[Any, str]] = {}

    def carry_out(
        self, message: WeightMessage, tensors: Sequence[tuple[str, Any]] | None = None
    ) -> Any:
        """Do what `message` asks on this rank (`tensors`: rank 0's, for `LoadFromRank0`);
        returns this rank's outcome (a `Failed` when it failed here, never an exception but
        a broken group's `RankFailure`)."""
        try:
            match message:
                case LoadFromDisk(path):
                    return self._load(self._disk(path))
                case LoadFromRank0():
                    return self._load(self._from_rank0(message, tensors or ()))
                case LoadFromTrainer(load=True):
                    return self._load(self._from_trainer(message))
                case LoadFromTrainer(load=False):
                    for _ in self._from_trainer(message):
                        pass
                case JoinTrainerGroup():
                    return self._join(message)
                case LeaveTrainerGroup(name):
                    self.groups.pop(name, None)
                case ReadWeight(name, rows):
                    return self._read(name, rows)
                case AddAdapter(uid, adapter) if not self.runner.tp.is_driver:
                    assert self.runner.lora is not None
                    self.runner.lora.add(uid, adapter)
                case RemoveAdapter(uid) if not self.runner.tp.is_driver:
                    assert self.runner.lora is not None
                    self.runner.lora.remove(uid)
        except RankFailure:
            raise
        except Exception as error:  # the caller answers with it; the group goes on
            return Failed(str(error) or type(error).__name__)
        return None

    def _load(self, weights: Iterator[tuple[str, Any]]) -> Failed | None:
        """Load `weights` into the runner (each layer keeps this rank's slice)."""
        try:
            self.runner.load_weights(weights)
        except RankFailure:
            raise
        except (ValueError, RuntimeError, OSError) as error:
            return Failed(str(error))
        finally:
            for _ in weights:  # take part in the broadcasts still to come
                pass
        return None

    def _disk(self, path: str) -> Iterator[tuple[str, Any]]:
        runner = self.runner
        files = safetensors_files(Path(path))
        if runner.tp.enabled:  # each layer reads only its slice
            yield from iter_safetensors_slices(files, runner.device, runner.dtype, False)
        else:
            yield from iter_safetensors(files, runner.device, runner.dtype, False)

    def _from_rank0(
        self, message: LoadFromRank0, tensors: Sequence[tuple[str, Any]]
    ) -> Iterator[tuple[str, Any]]:
        tp = self.runner.tp
        if not tp.enabled:
            yield from tensors
            return
        device = self.runner.device if tp.backend == "nccl" else torch.device("cpu")
        for index, (name, dtype, shape) in enumerate(
            zip(message.names, message.dtypes, message.shapes, strict=True)
        ):
            if tp.is_driver:
                tensor = tensors[index][1].detach().to(device).contiguous()
            else:
                kind = dtype_named(dtype)
                assert kind is not None  # (rank 0 checked the dtypes)
                tensor = torch.empty(shape, dtype=kind, device=device)
            yield name, tp.broadcast_tensor(tensor)

    def _from_trainer(self, message: LoadFromTrainer) -> Iterator[tuple[str, Any]]:
        import torch.distributed as dist

        group, backend = self.groups[message.group_name]
        device = self.runner.device if backend == "nccl" else torch.device("cpu")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for name, dtype, shape in zip(message.names, message.dtypes, message.shapes, strict=True):
            kind = dtype_named(dtype)
            assert kind is not None  # (rank 0 checked the dtypes)
            tensor = torch.empty(shape, dtype=kind, device=device)
            group.broadcast([tensor], options).wait()
            yield name, tensor

    def _join(self, message: JoinTrainerGroup) -> Failed | None:
        import torch.distributed as dist

        name = message.group_name
        if name in self.groups:
            return Failed(f"a group named {name!r} exists already")
        rank = message.rank_offset + self.runner.tp.rank
        size = message.world_size
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                message.master_address, message.master_port, size, is_master=False,
                timeout=timeout,
            )  # fmt: skip
            if message.backend == "gloo":
                group: Any = dist.ProcessGroupGloo(store, rank, size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group = dist.ProcessGroupNCCL(store, rank, size, options)
        except (RuntimeError, ValueError, AttributeError) as error:  # (no NCCL in this torch)
            return Failed(f"could not join {name!r}: {error}")
        self.groups[name] = (group, message.backend)
        return None

    def _read(self, name: str, rows: int) -> WeightPart | Failed:
        try:
            part = self.runner.weight_part(name)
        except KeyError:
            return Failed(f"the model has no weight named {name!r}")
        values = part.values
        if values.dim():
            limit = max(0, rows - part.start) if part.dim == 0 else max(0, rows)
            values = values[:limit]
        return WeightPart(values.to("cpu", torch.float32).clone(), part.dim, part.start, part.size)


class WeightSync:
    """Rank 0's side: runs a weight message on every rank and collects their outcomes; the
    other ranks' adapter pools for adapters given as tensors (`AdapterPeers`)."""

    def __init__(self, runner: ModelRunner, sender: StepSender | None) -> None:
        self.rank = RankWeights(runner)
        self.sender = sender

    def run(
        self, message: WeightMessage, tensors: Sequence[tuple[str, Any]] | None = None
    ) -> list[Any]:
        """Every rank's outcome of `message`, in rank order (rank 0's alone without tensor
        parallelism). No step runs meanwhile."""
        if self.sender is None:
            return [self.rank.carry_out(message, tensors)]
        with self.sender.lock:  # no heartbeat between the message and its collectives
            self.sender.send(message)
            mine = self.rank.carry_out(message, tensors)
            outcomes: list[Any] = self.rank.runner.tp.gather_objects(mine)
        return outcomes

    def add(self, uid: str, adapter: LoraAdapter) -> None:
        failure = first_failure(self.run(AddAdapter(uid, adapter)))
        if failure is not None:
            raise RuntimeError(f"the other ranks could not take adapter {uid}: {failure}")

    def remove(self, uid: str) -> None:
        try:
            self.run(RemoveAdapter(uid))
        except RankFailure as error:  # (a group going down: the engine is ending requests)
            logger.warning("could not tell the other ranks to drop adapter %s: %s", uid, error)
