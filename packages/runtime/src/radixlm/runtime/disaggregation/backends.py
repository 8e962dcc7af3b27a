"""Transfer backends: how a prompt's K/V bytes go from a prefill engine to a decode engine.

The bootstrap messages always cross ZeroMQ (`protocol`); a backend decides where the bytes
are. The prefill side `stage`s a host buffer on its step thread (the K/V is gathered into it
there, one copy out of the pool), its transfer thread takes the backend's `frames` for the
`KVSent` message, and `discard`s the buffer once the decode side has it (or gave up). The
decode side's transfer thread `open`s what arrived as a tensor of the bytes, which its step
thread writes into its pool.

- `tcp`: the bytes are the frame after `KVSent` (one message per request, any two machines).
- `shm`: the bytes are in a file under /dev/shm that the decode side maps (one host; only
  metadata crosses ZeroMQ). The decode side removes the file once it has mapped it, the
  prefill side when it gives the room up. Each file is named for the process that wrote it
  (`radixlm-kv-<pid>-<room>-<n>`): a shm backend starting up removes the files of processes
  that are gone (a prefill engine killed mid-transfer leaves its files behind).
- `nixl`, `mooncake`: SGLang's RDMA transports between GPUs. Named so that SGLang command
  lines parse; refused at startup (not installed, or not driven by this version).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

logger = logging.getLogger("radixlm.runtime.disaggregation")


@dataclass
class StagedKV:
    """A prompt's K/V bytes on the host, waiting to be sent: `data` (uint8, `nbytes` long)
    and where the decode side finds them when they do not travel in the message (shm)."""

    data: torch.Tensor
    location: str | None = None


class TransferBackend(Protocol):
    """One way of moving K/V bytes (see the module)."""

    @property
    def name(self) -> str: ...

    def stage(self, room: int, nbytes: int) -> StagedKV:
        """A host buffer of `nbytes` for `room`'s K/V (prefill, step thread). The caller fills
        `data`; the buffer is the caller's until it is sent."""
        ...

    def frames(self, staged: StagedKV) -> list[Any]:
        """The frames that follow the `KVSent` header (prefill, transfer thread): the bytes
        themselves, or none when they are at `staged.location`."""
        ...

    def discard(self, staged: StagedKV) -> None:
        """The buffer is no longer needed: the decode side has the bytes or gave up (prefill,
        transfer thread). Idempotent."""
        ...

    def open(self, location: str | None, frames: list[Any], nbytes: int) -> torch.Tensor:
        """The bytes a `KVSent` brought (decode, transfer thread), as a uint8 tensor of
        `nbytes`; raises OSError or ValueError (with what to check) when they are not there
        or have another size. The tensor stays valid after the sender discards its buffer."""
        ...


class TcpBackend:
    """The K/V bytes travel in the ZeroMQ message itself (TCP between machines)."""

    name = "tcp"

    def stage(self, room: int, nbytes: int) -> StagedKV:
        return StagedKV(torch.empty(nbytes, dtype=torch.uint8))

    def frames(self, staged: StagedKV) -> list[Any]:
        return [staged.data.numpy()]  # (sent from its buffer, not copied)

    def discard(self, staged: StagedKV) -> None:
        return None  # the message frame holds the tensor until it is sent

    def open(self, location: str | None, frames: list[Any], nbytes: int) -> torch.Tensor:
        if len(frames) != 1:
            raise ValueError(f"the K/V message has {len(frames)} data frames, not 1")
        buffer = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
        if len(buffer) != nbytes:
            raise ValueError(f"the K/V message holds {len(buffer)} bytes, not {nbytes}")
        # torch.frombuffer keeps the frame's buffer alive as long as the tensor.
        return torch.frombuffer(buffer, dtype=torch.uint8)


def _shm_directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


#: A staged K/V file's name: the pid of the process that wrote it, the room, a counter.
_SHM_NAME = re.compile(r"radixlm-kv-(\d+)-\d+-\d+")


def _process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not waited for, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    except OverflowError:
        return False
    try:  # Linux: the state letter follows the command name in parentheses
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep_orphans(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the K/V files in `directory` whose writing process is gone; the files removed.
    (Processes in another pid namespace that share the directory look gone: give each
    container its own /dev/shm, as Docker does.)"""
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _SHM_NAME.fullmatch(path.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        try:
            path.unlink()
        except OSError:
            continue  # another engine swept it first, or it is not ours to remove
        removed.append(path)
    return removed


class ShmBackend:
    """The K/V bytes are in a file of shared memory (/dev/shm) that the decode side maps: one
    copy into it on the prefill side, one out of it on the decode side, nothing through a
    socket. Both engines must run on the same host."""

    name = "shm"
    _counter = itertools.count()

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        """Removes the files that processes gone left in `directory` (default /dev/shm)."""
        self.directory = Path(directory) if directory is not None else _shm_directory()
        removed = sweep_orphans(self.directory)
        if removed:
            logger.warning(
                "removed %d shared-memory K/V files of stopped prefill engines from %s",
                len(removed),
                self.directory,
            )

    def stage(self, room: int, nbytes: int) -> StagedKV:
        path = self.directory / f"radixlm-kv-{os.getpid()}-{room}-{next(self._counter)}"
        with open(path, "wb") as out:
            out.truncate(nbytes)
        data = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return StagedKV(data, str(path))

    def frames(self, staged: StagedKV) -> list[Any]:
        return []

    def discard(self, staged: StagedKV) -> None:
        if staged.location is not None:
            Path(staged.location).unlink(missing_ok=True)

    def open(self, location: str | None, frames: list[Any], nbytes: int) -> torch.Tensor:
        if location is None or frames:
            raise ValueError("the K/V message is not a shm transfer (the prefill server uses tcp?)")
        path = Path(location)
        # Only a K/V file in the shared-memory directory: this side removes what it opens.
        if path.parent != self.directory or _SHM_NAME.fullmatch(path.name) is None:
            raise ValueError(
                f"{location} is not a K/V file of {self.directory}: both servers must run on "
                "one host with the shm transfer backend"
            )
        try:
            size = os.stat(location).st_size
        except OSError as error:
            raise OSError(
                f"cannot open the shared-memory K/V file {location} ({error.strerror}): the shm "
                "transfer backend needs the prefill and decode servers on one host (use tcp "
                "between machines)"
            ) from None
        if size != nbytes:
            raise ValueError(f"the shared-memory K/V file holds {size} bytes, not {nbytes}")
        # Mapped, not read: the mapping stays valid once the file is removed, as it is now
        # (should the prefill process die before the decode side's receipt, nothing is left).
        data = torch.from_file(location, shared=True, size=nbytes, dtype=torch.uint8)
        path.unlink(missing_ok=True)
        return data


#: SGLang's RDMA transports: the module each needs.
_RDMA_BACKENDS = {"nixl": "nixl", "mooncake": "mooncake.engine"}


def create_backend(name: str) -> TransferBackend:
    """The backend called `name`; ValueError (saying what to use) for one this engine cannot
    run."""
    if name == "tcp":
        return TcpBackend()
    if name == "shm":
        return ShmBackend()
    module = _RDMA_BACKENDS.get(name)
    if module is None:
        raise ValueError(f"unknown disaggregation transfer backend {name!r}; use tcp or shm")
    try:
        importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"the {name} disaggregation transfer backend needs the {module.split('.')[0]} "
            "package (RDMA between GPUs), which is not installed; use "
            "--disaggregation-transfer-backend tcp (any two machines) or shm (one host)"
        ) from None
    raise ValueError(
        f"the {name} disaggregation transfer backend (RDMA between GPUs) is not driven by this "
        "version of radixlm; use --disaggregation-transfer-backend tcp (any two machines) or "
        "shm (one host)"
    )
