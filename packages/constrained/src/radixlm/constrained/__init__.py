"""radixlm.constrained: structured output (JSON Schema, regex, EBNF, structural tags, choices) on
xgrammar, llguidance and outlines-core (or `auto`, choosing per constraint), with jump-forward
decoding. Backends are optional extras, imported only when created: `available_backends()` says
which are installed."""

from radixlm.constrained._schema_documents import load_schema_documents, schema_registry
from radixlm.constrained._version import __version__
from radixlm.constrained.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    bitmask_width,
    reset_bitmask,
    unpack_bitmask,
)
from radixlm.constrained.compiler import CacheInfo, GrammarCompiler
from radixlm.constrained.errors import BackendUnavailable, GrammarError
from radixlm.constrained.interfaces import (
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    JumpForward,
    Violation,
)
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.registry import (
    DEFAULT_BACKEND,
    available_backends,
    create_backend,
    register_backend,
    registered_backends,
)
from radixlm.constrained.spec import GRAMMAR_KINDS, GrammarKind, GrammarSpec
from radixlm.constrained.tokenizer import TokenizerInfo

__all__ = [
    "DEFAULT_BACKEND",
    "GRAMMAR_KINDS",
    "BackendUnavailable",
    "CacheInfo",
    "CompiledGrammar",
    "Grammar",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "GrammarKind",
    "GrammarOptions",
    "GrammarSpec",
    "JumpForward",
    "TokenizerInfo",
    "Violation",
    "__version__",
    "allocate_bitmask",
    "apply_bitmask",
    "available_backends",
    "bitmask_width",
    "create_backend",
    "load_schema_documents",
    "register_backend",
    "registered_backends",
    "reset_bitmask",
    "schema_registry",
    "unpack_bitmask",
]
