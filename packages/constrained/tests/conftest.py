"""Fixtures: tiny tokenizers trained here on local text (nothing is downloaded), backends, and a
seeded random walk that decodes under a grammar."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DATA = Path(__file__).parent / "data"
BACKENDS = ["xgrammar", "llguidance", "outlines"]


def _training_text() -> list[str]:
    rng = random.Random(1234)
    lines = (DATA / "corpus.txt").read_text(encoding="utf-8").splitlines()
    names = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Zoë", "José"]
    for _ in range(400):
        record = {
            "name": rng.choice(names),
            "age": rng.randint(0, 99),
            "email": f"{rng.choice(names).lower()}@example.com",
            "tags": rng.sample(["red", "green", "blue", "done"], rng.randint(0, 3)),
            "active": rng.random() < 0.5,
            "price": round(rng.uniform(0, 100), 2),
        }
        lines.append(json.dumps(record))
        lines.append(json.dumps(record, separators=(",", ":")))
    return lines


def _byte_level_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )


def _sentencepiece_tokenizer() -> Any:
    """Llama-2 style: `▁` for spaces, `<0xNN>` byte fallback, a prefix space before the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Newlines stay out of the trained vocabulary, as in Llama-2: they go through <0x0A>.
    text = [line.replace("\n", " ") for line in _training_text()]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=[], show_progress=False)
    draft = Tokenizer(models.BPE())
    draft.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    draft.train_from_iterator(text, trainer)
    trained = json.loads(draft.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    """Byte-level BPE, 1000 tokens (2 special), trained on tests/data and generated JSON."""
    return _byte_level_tokenizer(1000)


@pytest.fixture(scope="session")
def sp_tokenizer() -> Any:
    return _sentencepiece_tokenizer()


@pytest.fixture(scope="session")
def info(hf_tokenizer: Any) -> Any:
    from radixlm.constrained import TokenizerInfo

    # A model vocabulary padded past the tokenizer's, as many checkpoints have.
    return TokenizerInfo.from_hf(hf_tokenizer, vocab_size=1024)


@pytest.fixture(scope="session")
def sp_info(sp_tokenizer: Any) -> Any:
    from radixlm.constrained import TokenizerInfo

    return TokenizerInfo.from_hf(sp_tokenizer)


@pytest.fixture(scope="session")
def backends(info: Any) -> dict[str, Any]:
    from radixlm.constrained import create_backend

    return {name: create_backend(name, info) for name in BACKENDS}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, backends: dict[str, Any]) -> Any:
    return backends[request.param]


@dataclass
class WalkResult:
    text: str
    token_ids: list[int]
    terminated: bool
    model_calls: int
    jumped_tokens: int


def random_walk(
    grammar: Any,
    info: Any,
    seed: int,
    *,
    max_steps: int = 400,
    jump_forward: bool = False,
    stop_bias: float = 0.0,
    close_bias: float = 0.0,
    logits: Callable[[list[int]], Any] | None = None,
) -> WalkResult:
    """Decode greedily from seeded random logits masked by the grammar (optionally applying
    jump-forward), until the grammar terminates or `max_steps` model calls were made.
    `stop_bias` favours stop tokens; `close_bias` favours, more and more as the walk goes on,
    tokens that close JSON strings, arrays and objects, so walks end in reasonable time."""
    import torch

    from radixlm.constrained import allocate_bitmask, apply_bitmask

    generator = torch.Generator().manual_seed(seed)
    closers = torch.tensor(
        [any(c in (b or b"") for c in b'"]}') for b in info.token_bytes], dtype=torch.float32
    )
    bitmask = allocate_bitmask(1, info.vocab_size)
    out: list[int] = []
    calls = jumped = 0
    while calls < max_steps and not grammar.is_terminated():
        if jump_forward:
            jump = grammar.jump_forward()
            if jump is not None:
                grammar.rollback(jump.rollback)
                del out[len(out) - jump.rollback :]
                for token in jump.token_ids:
                    assert grammar.accept_token(token)
                out.extend(jump.token_ids)
                jumped += len(jump.token_ids)
        row = (
            logits(out)
            if logits is not None
            else torch.randn(1, info.vocab_size, generator=generator)
        )
        if stop_bias:
            for stop in info.stop_token_ids:
                row[0, stop] += stop_bias
        if close_bias:
            row[0] += closers * close_bias * min(1.0, calls / 40)
        grammar.fill_bitmask(bitmask, 0)
        apply_bitmask(row, bitmask)
        calls += 1
        token = int(row.argmax())
        assert torch.isfinite(row[0, token]), "the grammar allowed no token"
        assert grammar.accept_token(token)
        if token not in info.stop_token_ids:
            out.append(token)
    text = info.decode_bytes(out).decode("utf-8", errors="replace")
    return WalkResult(text, out, grammar.is_terminated(), calls, jumped)


@pytest.fixture(scope="session")
def walk() -> Callable[..., WalkResult]:
    return random_walk


@pytest.fixture(scope="session")
def schema_corpus() -> list[dict[str, Any]]:
    return json.loads((DATA / "schemas.json").read_text(encoding="utf-8"))


def schema_validator(schema: Any) -> Any:
    """jsonschema's validator for the schema's draft, with format checks."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def validating_walk(
    grammar: Any, info: Any, seed: int, max_steps: int = 300
) -> tuple[str | None, int]:
    """Uniform random choice among allowed tokens (leaning to stop and closing tokens as the
    walk goes on), obeying violations: (the text, or None when unfinished or fatal; rollbacks).
    Checks that no rollback takes back what the grammar called committed."""
    from radixlm.constrained import allocate_bitmask, unpack_bitmask

    rng = random.Random(seed)
    mask = allocate_bitmask(1, info.vocab_size)
    stops = set(info.stop_token_ids)
    rollbacks = 0
    for step in range(max_steps):
        if grammar.is_terminated():
            break
        grammar.fill_bitmask(mask, 0)
        allowed = unpack_bitmask(mask, info.vocab_size)[0].nonzero().flatten().tolist()
        assert allowed, "the grammar allowed no token"
        ending = [t for t in allowed if t in stops]
        closing = [t for t in allowed if any(c in (info.token_bytes[t] or b"") for c in b'"]}')]
        if ending and rng.random() < 0.5:
            token = ending[0]
        elif closing and rng.random() < min(0.9, step / 60):
            token = rng.choice(closing)
        else:
            token = rng.choice(allowed)
        committed = getattr(grammar, "committed", len(grammar.history))
        assert grammar.accept_token(token)
        found = grammar.violation()
        if found is not None:
            if found.fatal:
                return None, rollbacks
            # Nothing the grammar called committed (what an engine has streamed) is taken back.
            assert len(grammar.history) - found.rollback >= committed
            grammar.rollback(found.rollback)
            rollbacks += 1
        if hasattr(grammar, "check_invariants"):  # the validating matcher's bookkeeping
            grammar.check_invariants()
    if not grammar.is_terminated():
        return None, rollbacks
    return info.decode_bytes(grammar.history).decode("utf-8"), rollbacks


@pytest.fixture(scope="session")
def vwalk() -> Callable[..., tuple[str | None, int]]:
    """`validating_walk`: uniform random choice among allowed tokens, violations obeyed."""
    return validating_walk


@pytest.fixture(scope="session")
def check_schema_of() -> Callable[[Any], Any]:
    """`schema_validator`: jsonschema's validator for a schema's draft, formats checked."""
    return schema_validator
