"""The shapes that cross the package boundary: compiled grammars, matchers, jump-forward results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from radixlm.constrained.spec import GrammarSpec

if TYPE_CHECKING:
    from radixlm.constrained.tokenizer import TokenizerInfo


@dataclass(frozen=True, slots=True)
class JumpForward:
    """A continuation the grammar forces: append it without sampling.

    To apply it: `rollback(rollback)` the last generated tokens, then `accept_token` each of
    `token_ids` (a prefix of them is fine too), and feed those tokens to the model in one forward
    pass. Afterwards the output's bytes are the old output's bytes followed by `text`:
    `bytes(output[:-rollback]) + bytes(token_ids) == bytes(output) + text.encode()`.
    `rollback` is non-zero when the forced text merges with the end of what was generated into
    different tokens (the tokenizer's own tokenization of the output, see `Grammar.jump_forward`).
    """

    text: str
    token_ids: tuple[int, ...]
    rollback: int = 0


@dataclass(frozen=True, slots=True)
class Violation:
    """A completed JSON value broke a keyword the grammar could not enforce (found by
    validating the value with `jsonschema` as soon as it closed).

    The owner of the sequence rolls back `rollback` tokens (`Grammar.rollback` and its own
    output and KV cache) and decodes on: the grammar then masks the choice that led to the
    violation. `fatal` means the retries are used up: finish the request with an error made of
    `message` (which names `keyword` and `pointer`, a JSON pointer into the output)."""

    keyword: str
    pointer: str
    message: str
    rollback: int
    fatal: bool = False


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled for one backend and tokenizer; immutable and shareable between
    threads and requests. `handle` belongs to the backend that built it.

    `served_by` is the backend whose automaton runs (the chosen one under `auto`);
    `validated` lists the JSON Schema keywords enforced by validation and rollback rather than
    by the grammar; `annotations` the unknown `format` values treated as annotations."""

    spec: GrammarSpec
    backend: str
    handle: Any = field(repr=False)
    served_by: str = ""
    validated: tuple[str, ...] = ()
    annotations: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.served_by:
            object.__setattr__(self, "served_by", self.backend)


@runtime_checkable
class Grammar(Protocol):
    """The per-request state of a constraint (one sequence). Not thread-safe: one owner."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one generated token. Returns False, and changes nothing, when the grammar
        does not allow it. A stop token is accepted only where the output may end; it
        terminates the grammar."""
        ...

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        """Write the allowed next tokens into `bitmask[row]`: a CPU int32 tensor (or numpy
        array) with contiguous rows, packed: bit `i % 32` of word `i // 32` is token `i` (see
        `allocate_bitmask`; copy it to the device after filling). Reads the state, changes
        nothing. A terminated grammar allows nothing."""
        ...

    def is_terminated(self) -> bool:
        """True once a stop token was accepted."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a stop token counts as one)."""
        ...

    def jump_forward(self) -> JumpForward | None:
        """The continuation the grammar forces from here, tokenized the way the tokenizer would
        tokenize the whole output, or None. Changes nothing; see `JumpForward` to apply it."""
        ...

    def fork(self) -> Grammar:
        """An independent copy of this state over the same compiled grammar (for n > 1 and
        forks of a program)."""
        ...

    def violation(self) -> Violation | None:
        """After `accept_token`: the keyword a just-completed value broke, or None (always
        None for grammars that enforce everything themselves). Reading it changes nothing;
        `rollback` clears it."""
        ...


@runtime_checkable
class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer and makes matchers for them."""

    name: str
    tokenizer_info: TokenizerInfo
    supported_kinds: frozenset[str]

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec`, or raise `GrammarError` saying what to change. Thread-safe; may take
        long (use `GrammarCompiler` to keep it off the engine loop)."""
        ...

    def matcher(self, compiled: CompiledGrammar) -> Grammar:
        """A fresh matcher at the start of `compiled`."""
        ...
