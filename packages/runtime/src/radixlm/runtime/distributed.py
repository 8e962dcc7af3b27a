"""A rank's view of its tensor-parallel group, on torch.distributed.

`TensorParallel` is what the model and the runner see: this rank, the group's size, and the
few collectives tensor parallelism needs — an all-reduce after each row-parallel layer, an
all-gather of the vocabulary-parallel logits, a minimum over ranks (the KV pool's size), the
broadcast of each step from rank 0 and of the tensors of a weight update. With `size == 1`
(the default, `SINGLE`) every collective is the identity and torch.distributed is never
touched.

Two process groups, both with the collective timeout: `group` carries the tensors of the
forward (nccl on CUDA, gloo on CPU), `control` the pickled step messages (always gloo, on the
CPU). While the engine is idle rank 0 sends heartbeats on `control`, so a worker's wait there
ends in an error only when rank 0 is gone or stuck.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.runtime.config import ParallelConfig


class RankFailure(RuntimeError):
    """A collective failed or timed out: a rank died or hangs, so the group is unusable."""

    @classmethod
    def of(cls, what: str, error: BaseException) -> RankFailure:
        detail = str(error).split(". This is typically")[0].strip()
        if len(detail) > 240:
            detail = detail[:240] + "..."
        return cls(
            f"a tensor-parallel rank died or stopped answering: the {what} failed ({detail})"
        )


@dataclass
class CollectiveTime:
    """Wall time this rank spent in the forward's collectives (all-reduce, all-gather), and
    how many it ran. On CUDA the time is only the launches' unless `synchronize` is set, which
    waits for the device around each collective (slower; for profiling eager steps)."""

    seconds: float = 0.0
    calls: int = 0
    synchronize: bool = False


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1: no group at all)."""

    rank: int = 0
    size: int = 1
    #: The process group of the forward's collectives (None when size is 1).
    group: Any = None
    #: A gloo group for the step messages rank 0 broadcasts (None when size is 1).
    control: Any = None
    #: The rank's index on its own machine (its GPU on CUDA).
    local_rank: int = 0
    #: The torch.distributed backend of `group` ("gloo", "nccl"; "" when size is 1).
    backend: str = ""
    timing: CollectiveTime = field(default_factory=CollectiveTime)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that schedules and samples."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks, in place."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        start = self._clock(tensor)
        try:
            dist.all_reduce(tensor, group=self.group)
        except RuntimeError as error:
            raise RankFailure.of("all-reduce", error) from error
        self._count(tensor, start)
        return tensor

    def _clock(self, tensor: torch.Tensor) -> float:
        if self.timing.synchronize and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        return time.perf_counter()

    def _count(self, tensor: torch.Tensor, start: float) -> None:
        if self.timing.synchronize and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        self.timing.seconds += time.perf_counter() - start
        self.timing.calls += 1

    def all_to_all(
        self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        """Rows exchanged between ranks: this rank sends `input_splits[j]` consecutive rows of
        `tensor` to rank j and receives `output_splits[j]` rows from it, in rank order."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        start = self._clock(tensor)
        try:
            dist.all_to_all_single(out, tensor, output_splits, input_splits, group=self.group)
        except RuntimeError as error:
            raise RankFailure.of("all-to-all", error) from error
        self._count(tensor, start)
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim` (the last by default), in rank
        order."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        start = self._clock(tensor)
        try:
            dist.all_gather(parts, tensor, group=self.group)
        except RuntimeError as error:
            raise RankFailure.of("all-gather", error) from error
        self._count(tensor, start)
        return torch.cat(parts, dim=dim)

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's `tensor` (same shape, dtype and device: the
        forward group's, CUDA under nccl), in place."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        try:
            dist.broadcast(tensor, src=0, group=self.group)
        except RuntimeError as error:
            raise RankFailure.of("tensor broadcast", error) from error
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (on the control group)."""
        if self.size == 1:
            return value
        return int(min(self.gather_objects(value)))

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank (a startup-time exchange)."""
        if self.size == 1:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(values, value, group=self.control)
        except RuntimeError as error:
            raise RankFailure.of("exchange", error) from error
        return values

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0 sends `message` to every rank; every rank returns it."""
        if self.size == 1:
            return message
        import torch.distributed as dist

        # One pickle, as a length then a byte tensor (broadcast_object_list pickles twice).
        try:
            if self.rank == 0:
                data = pickle.dumps(message, protocol=5)
                length = torch.tensor([len(data)], dtype=torch.int64)
                dist.broadcast(length, src=0, group=self.control)
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                dist.broadcast(payload, src=0, group=self.control)
                return message
            length = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(length, src=0, group=self.control)
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.control)
        except RuntimeError as error:
            raise RankFailure.of("step broadcast", error) from error
        return pickle.loads(payload.numpy().tobytes())


SINGLE = TensorParallel()


def resolve_backend(config: ParallelConfig, device: torch.device) -> str:
    """The torch.distributed backend: nccl on CUDA, gloo on CPU, unless the config names one."""
    if config.backend != "auto":
        if config.backend == "nccl" and device.type != "cuda":
            raise ValueError("dist_backend nccl needs CUDA devices; use gloo (or auto) on CPU")
        return config.backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(
    config: ParallelConfig, rank: int, init_method: str, device: torch.device
) -> TensorParallel:
    """Join the group as `rank` (blocks until every rank has joined, up to the timeout)."""
    import torch.distributed as dist

    backend = resolve_backend(config, device)
    local_rank = rank - config.node_ranks.start if rank in config.node_ranks else rank
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=config.timeout)
    # gloo binds to the interface of the host name; on one machine loopback always works.
    if config.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        world_size=config.tp_size,
        rank=rank,
        timeout=timeout,
    )
    control = dist.new_group(backend="gloo", timeout=timeout)
    group = dist.group.WORLD
    # RADIXLM_TP_SYNC_TIMING=1: time collectives on the device too (profiling eager steps).
    timing = CollectiveTime(synchronize=os.environ.get("RADIXLM_TP_SYNC_TIMING") == "1")
    return TensorParallel(rank, config.tp_size, group, control, local_rank, backend, timing)


def _loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = os.listdir("/sys/class/net")
    except OSError:
        return "lo0"
    return "lo" if "lo" in names else "lo0"


def destroy_tensor_parallel() -> None:
    """Leave the group (a no-op when none was joined)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
