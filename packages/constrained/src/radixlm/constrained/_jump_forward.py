"""Jump-forward planning shared by the backends: forced bytes -> tokens, right at the boundary.

The retokenization rule. Let the output so far be tokens t_1..t_n and let the grammar force the
bytes F next. The tokenizer would not necessarily write t_1..t_n followed by a tokenization of F
alone: F can merge with the end of the output (`{` then forced `"name"` is `{"` + `name` + `"`
for many BPE vocabularies). So:

1. Take the last `window` tokens (`GrammarOptions.jump_forward_window`, default 4), moved back
   until they start on a UTF-8 character boundary, and the forced text F cut to whole
   characters: S = bytes(t_{n-w+1}..t_n) + F.
2. Tokenize S with the tokenizer as running text (no special tokens, no prefix space) and check
   that the tokens spell S exactly; otherwise there is no jump (decoding goes on normally).
3. Tokens the new tokenization shares at its start with t_{n-w+1}..t_n stay; the others are
   rolled back (`JumpForward.rollback`) and replaced by the new tokens.
4. Trailing new tokens are left out while, where the token would go, the grammar allows a
   longer vocabulary token that starts with it and reaches past the end of the forced text:
   the tokenizer could merge that token with what the model writes next, so the model chooses
   (`"tags":[` ends in `[`, but `["` may follow). Tokens are also left out so that the jump
   ends on a whole character and adds at least one byte.
5. The plan is replayed on the matcher (rollback, accept) and undone; any refusal means no jump.
"""

from __future__ import annotations

from typing import Protocol

from radixlm.constrained.interfaces import JumpForward
from radixlm.constrained.tokenizer import TokenizerInfo


class JumpHost(Protocol):
    """What the planner needs from a matcher."""

    @property
    def history(self) -> list[int]: ...

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def allows_any(self, token_ids: list[int]) -> bool: ...


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80


def _whole_characters(data: bytes) -> bytes:
    """The longest prefix of `data` that is valid UTF-8 (data starts on a boundary)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return data[:cut]
    # Invalid earlier than the last character: keep what decodes.
    return data[:0]


def plan_jump_forward(
    host: JumpHost, info: TokenizerInfo, forced: bytes, window: int
) -> JumpForward | None:
    """The jump for `forced` bytes from the host's current state, or None (see module doc)."""
    if not forced or not info.can_encode:
        return None
    history = host.history
    start = max(0, len(history) - window)
    while start > 0:
        head = info.token_bytes[history[start]] or b""
        if head and not _is_continuation(head[0]):
            break
        start -= 1
    old = history[start:]
    old_bytes = info.decode_bytes(old)
    if old_bytes and _is_continuation(old_bytes[0]):
        return None
    total = _whole_characters(old_bytes + forced)
    if len(total) <= len(old_bytes):
        return None
    new = info.encode_exact(total.decode("utf-8"))
    if new is None:
        return None
    common = 0
    while common < min(len(old), len(new)) and old[common] == new[common]:
        common += 1
    rollback = len(old) - common
    tokens = new[common:]
    kept = _replay(host, old[common:], tokens, info)
    # End on a whole character, beyond what was rolled back.
    base = info.decode_bytes(old[:common])
    while kept:
        reach = base + info.decode_bytes(kept)
        if len(reach) > len(old_bytes) and _whole_characters(reach) == reach:
            text = reach[len(old_bytes) :].decode("utf-8")
            return JumpForward(text=text, token_ids=tuple(kept), rollback=rollback)
        kept.pop()
    return None


def _replay(
    host: JumpHost, removed: list[int], tokens: list[int], info: TokenizerInfo
) -> list[int]:
    """Apply the plan on the host to check it, then restore the host; the tokens that hold.

    Trailing tokens are left out while the grammar, where such a token would go, allows a
    longer vocabulary token that starts with it and reaches past the forced text: the
    tokenizer could merge them with what the model writes next."""
    host.rollback(len(removed))
    accepted = 0
    try:
        for token in tokens:
            if not host.accept_token(token):
                break
            accepted += 1
        tail = 0  # bytes from the token looked at to the end of the forced text
        while accepted:
            token = tokens[accepted - 1]
            tail += len(info.token_bytes[token] or b"")
            host.rollback(1)
            accepted -= 1
            longer = info.extensions(token, longer_than=tail)
            if not (longer and host.allows_any(longer)):
                host.accept_token(token)
                accepted += 1
                break
        return list(tokens[:accepted])
    finally:
        host.rollback(accepted)
        for token in removed:
            if not host.accept_token(token):  # pragma: no cover - rollback is exact
                raise RuntimeError("grammar state could not be restored after a jump-forward check")
