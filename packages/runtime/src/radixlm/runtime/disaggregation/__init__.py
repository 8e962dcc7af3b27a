"""Prefill/decode disaggregation (SGLang's `--disaggregation-mode prefill|decode`).

A prefill engine computes each request's prompt and first token and sends the prompt's K/V to
the decode engine that registered the request's `bootstrap_room`; the decode engine writes it
into its own KV pool and decodes the rest, so long prompts never stall the decode batch.

- `protocol`: the bootstrap messages (JSON frames over ZeroMQ) and the K/V layout check.
- `backends`: where the K/V bytes travel (`tcp`, `shm`; `nixl` / `mooncake` are refused).
- `kv`: copies between a KV pool and the flat bytes sent.
- `transfer`: the thread on each side that does all the network I/O.
- `sides`: the engine core's hooks (what waits for what, on the step thread).
"""

from radixlm.runtime.disaggregation.backends import (
    ShmBackend,
    StagedKV,
    TcpBackend,
    TransferBackend,
    create_backend,
)
from radixlm.runtime.disaggregation.protocol import KVLayout
from radixlm.runtime.disaggregation.sides import (
    DecodeSide,
    Disaggregation,
    PrefillSide,
    create_side,
)
from radixlm.runtime.disaggregation.transfer import (
    KVArrived,
    KVDelivered,
    TransferEvent,
    TransferFailed,
)

__all__ = [
    "DecodeSide",
    "Disaggregation",
    "KVArrived",
    "KVDelivered",
    "KVLayout",
    "PrefillSide",
    "ShmBackend",
    "StagedKV",
    "TcpBackend",
    "TransferBackend",
    "TransferEvent",
    "TransferFailed",
    "create_backend",
    "create_side",
]
