#!/usr/bin/env python3
"""Benchmark radixlm-constrained beside calling xgrammar / llguidance / outlines-core directly.

Five parts, each printed as tables:

1. compile: time to compile JSON schemas, per backend — the backend called directly (its own
   cache off), ours cold (`backend.compile`: schema normalization, then the same backend
   call) and ours cached (`GrammarCompiler` hit).
2. mask: time per output token to fill the token bitmask and accept the token, ours beside the
   backend's own matcher on the same compiled grammar, at vocabularies of 32k and 152k tokens
   (synthetic byte-level vocabularies built here: every byte plus random English/JSON-like
   pieces; nothing is downloaded).
3. jump-forward: schema-constrained generation with a deterministic stand-in model that writes
   a fixed target document (a BPE tokenizer trained here on generated JSON): output tokens
   placed by jump-forward, model calls without and with it, and the time `jump_forward()`
   takes when it finds a jump (retokenization and replay included) and when it finds none.
4. overhead: ours over direct, the goal being <= 10%.
   validation: per output token, `auto`'s matcher for schemas it validates (keywords no
   grammar enforces: uniqueItems, two patterns, if/then) beside the matcher of the backend it
   chose, on the same compiled grammar and tokens; the goal being <= 15%. The two run in
   turn (`--validation-pairs` times each), timed by wall and by process CPU time (less
   sensitive to other processes on the machine); the overhead is the median of the per-pair
   ratios, printed with its 10th-90th percentile spread and beside the ratio of the minimums.
   `--parts validation` alone takes about 50 s.
5. corpus (grammar_corpus_bench.py): raw xgrammar, llguidance and outlines-core beside our
   `auto` backend over corpora of real-world and generated JSON schemas — schemas compiled,
   random walks valid, compile and per-token times, auto's choices and goals.

A backend of ours that cannot be built here (not installed) is skipped with a note.

    .venv/bin/python tools/bench/grammar_bench.py              # about 15 min on 2 cores
    .venv/bin/python tools/bench/grammar_bench.py --quick      # smaller, for a smoke run
    .venv/bin/python tools/bench/grammar_bench.py --parts corpus --corpus real --walks 2
    .venv/bin/python tools/bench/grammar_bench.py --json out.json
    .venv/bin/python tools/bench/grammar_bench.py --parts validation
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packages" / "constrained" / "src"))  # runs from a checkout
sys.path.insert(0, str(ROOT / "packages" / "sampling" / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import outlines_core  # noqa: E402
import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402

from radixlm.constrained import (  # noqa: E402
    GrammarCompiler,
    GrammarSpec,
    TokenizerInfo,
    allocate_bitmask,
    apply_bitmask,
    create_backend,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
            "required": ["name", "city"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"}},
                "required": ["sku", "quantity"],
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
    },
    "required": ["id", "customer", "items", "status"],
}
ENUMS = {
    "type": "object",
    "properties": {f"field_{i}": {"enum": [f"value_{i}_{j}" for j in range(8)]} for i in range(12)},
    "required": [f"field_{i}" for i in range(12)],
}
UNION = {
    "type": "object",
    "properties": {
        "pet": {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                    "required": ["kind", "lives"],
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                    "required": ["kind", "good"],
                },
            ]
        }
    },
    "required": ["pet"],
}
BACKENDS = ("xgrammar", "llguidance", "outlines")
LLGUIDANCE_COMPACT: Any = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}
# A schema `auto` validates: an order whose tags are unique, whose SKUs meet two patterns
# (allOf) and whose express orders need a note (if/then); all else is in the grammar.
VALIDATED = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "customer": ORDER["properties"]["customer"],
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"allOf": [{"type": "string", "pattern": "^[A-Z][0-9A-Z-]*$"},
                                      {"pattern": "^.{2,12}$"}]},
                    "quantity": {"type": "integer", "minimum": 1},
                },
                "required": ["sku", "quantity"],
            },
        },
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "express": {"type": "boolean"},
        "note": {"type": "string"},
    },
    "required": ["id", "customer", "items", "tags", "express"],
    "if": {"properties": {"express": {"const": True}}},
    "then": {"required": ["note"]},
}  # fmt: skip
VALIDATED_TARGET = {
    "id": "A-1042", "customer": {"name": "Bob Smith", "city": "Lyon"},
    "items": [{"sku": "X1-RED", "quantity": 2}, {"sku": "Y7", "quantity": 1},
              {"sku": "Z9-BLUE-L", "quantity": 3}],
    "tags": ["gift", "fragile", "priority"], "express": True,
    "note": "leave it with the neighbour at number 12",
}  # fmt: skip
# A catalog `auto` validates: products unique as wholes, each with unique tags and a SKU under
# two patterns, and a description (long strings); served by a grammar for the rest.
CATALOG = {
    "type": "object",
    "properties": {
        "store": {"type": "string"},
        "products": {
            "type": "array",
            "uniqueItems": True,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"allOf": [{"type": "string", "pattern": "^[A-Z][0-9A-Z-]*$"},
                                      {"pattern": "^.{2,12}$"}]},
                    "name": {"type": "string"},
                    "price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                    "description": {"type": "string"},
                },
                "required": ["sku", "name", "price", "tags", "description"],
            },
        },
    },
    "required": ["store", "products"],
}  # fmt: skip
CATALOG_TARGET = {
    "store": "Corner Shop",
    "products": [
        {"sku": f"P{i}-{'ABCDEFGH'[i]}X", "name": f"Product number {i}", "price": 3.5 * i + 1,
         "tags": ["new", f"shelf {i}", "sale"][: 1 + i % 3],
         "description": "A sturdy thing that does what it says, made to last, shipped in a "
                        f"recycled box; size {i} of eight, colour as shown."}
        for i in range(8)
    ],
}  # fmt: skip
VALIDATION_CASES = {"order": (VALIDATED, VALIDATED_TARGET), "catalog": (CATALOG, CATALOG_TARGET)}
SCHEMAS = {"person": PERSON, "order": ORDER, "12 enums": ENUMS, "oneOf union": UNION}
TARGETS = {
    "person": {"name": "Carol Jones", "age": 41, "email": "carol@example.com",
               "tags": ["green", "blue"], "active": True},
    "order": {"id": "A-1042", "customer": {"name": "Bob", "city": "Lyon"},
              "items": [{"sku": "X1", "quantity": 2}, {"sku": "Y7", "quantity": 1}],
              "status": "shipped"},
    "12 enums": {f"field_{i}": f"value_{i}_{(i * 5) % 8}" for i in range(12)},
    "oneOf union": {"pet": {"kind": "dog", "good": True}},
}  # fmt: skip


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def median_time(run: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_medians(runs: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Median times of several runs measured in turn (a, b, a, b, ...), so that load on a
    shared machine lands on all of them alike."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


# ------------------------------------------------------------------------------ vocabularies


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes | None]:
    """Id 0 is the stop token; then every byte; then random English/JSON-like pieces."""
    rng = random.Random(seed)
    alphabet = "etaoinshrdlucmfwypvbgkjqxz" * 3 + "ETAOINSHRD" + "0123456789" + ' ,.:;"{}[]-_  '
    tokens: list[bytes | None] = [None] + [bytes([b]) for b in range(256)]
    seen = set(tokens)
    while len(tokens) < size:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.choice([2, 3, 3, 4, 5, 6, 8])))
        data = piece.encode()
        if data not in seen:
            seen.add(data)
            tokens.append(data)
    return tokens


def greedy_encoder(tokens: list[bytes | None]) -> Callable[[str], list[int]]:
    """Longest match first: a tokenizer for the synthetic vocabularies."""
    table = {t: i for i, t in enumerate(tokens) if t}
    longest = max(len(t) for t in table)

    def encode(text: str) -> list[int]:
        data, out, at = text.encode(), [], 0
        while at < len(data):
            for size in range(min(longest, len(data) - at), 0, -1):
                token = table.get(data[at : at + size])
                if token is not None:
                    out.append(token)
                    at += size
                    break
        return out

    return encode


def trained_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained here on generated JSON documents and a little prose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = "alice bob carol dave lyon paris tokyo red green blue order item pending shipped"
    lines = []
    for _ in range(3000):
        doc = {
            "name": " ".join(rng.sample(words.split(), 2)).title(),
            "age": rng.randint(0, 99),
            "email": f"{rng.choice(words.split())}@example.com",
            "tags": rng.sample(["red", "green", "blue"], rng.randint(0, 3)),
            "active": rng.random() < 0.5,
            "status": rng.choice(["pending", "shipped", "delivered"]),
            "quantity": rng.randint(1, 9),
        }
        lines += [json.dumps(doc), compact(doc)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


# ------------------------------------------------------------------------------------ direct


def direct_xgrammar(info: TokenizerInfo) -> Any:
    vocab = [b if b is not None else b"" for b in info.token_bytes]
    xinfo = xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=info.vocab_size,
        stop_token_ids=list(info.stop_token_ids),
    )
    return xgr.GrammarCompiler(xinfo, max_threads=1, cache_enabled=False)


def direct_outlines(info: TokenizerInfo) -> Any:
    table: dict[bytes, list[int]] = {}
    for i, data in enumerate(info.token_bytes):
        if data is not None and i not in info.stop_token_ids:
            table.setdefault(data, []).append(i)
    return outlines_core.Vocabulary(info.stop_token_ids[0], table)


class _ByteTokenizer:
    """What llguidance's TokenizerWrapper reads: tokens as bytes (special ones named after a
    0xFF byte, as llguidance marks them), the stop token and an encoder."""

    def __init__(self, info: TokenizerInfo) -> None:
        self.tokens = [b if b is not None else b"\xff<special_%d>" % i
                       for i, b in enumerate(info.token_bytes)]  # fmt: skip
        self.special_token_ids = [i for i, b in enumerate(info.token_bytes) if b is None]
        self.eos_token_id = info.stop_token_ids[0]
        self.bos_token_id = None
        self._encode = greedy_encoder(list(info.token_bytes))

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def direct_llguidance(info: TokenizerInfo) -> Any:
    import llguidance

    wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(info))
    return llguidance.LLTokenizer(
        wrapper, n_vocab=info.vocab_size, eos_token=list(info.stop_token_ids)
    )


def ours(info: TokenizerInfo) -> dict[str, Any]:
    """radixlm's named backends that can be built here (llguidance may not exist yet)."""
    found = {}
    for name in BACKENDS:
        try:
            found[name] = create_backend(name, info)
        except ImportError as error:
            print(f"  (skipping radixlm's {name} backend: {error})")
    return found


# ------------------------------------------------------------------------------------ parts


def direct_compile(name: str, direct: Any, text: str) -> Callable[[], Any]:
    """Compile `text` with the backend itself, the way it would be called without us
    (`direct`: its compiler, tokenizer or vocabulary, see `direct_of`)."""
    if name == "xgrammar":
        return lambda: direct.compile_json_schema(
            text, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )
    if name == "llguidance":
        from llguidance import LLMatcher

        return lambda: LLMatcher(
            direct, LLMatcher.grammar_from_json_schema(text, defaults=LLGUIDANCE_COMPACT)
        )
    return lambda: outlines_core.Index(
        outlines_core.json_schema.build_regex_from_schema(text, ""), direct
    )


def direct_of(name: str, info: TokenizerInfo) -> Any:
    return {"xgrammar": direct_xgrammar, "llguidance": direct_llguidance}.get(
        name, direct_outlines
    )(info)


def bench_compile(info: TokenizerInfo, repeat: int) -> list[dict[str, Any]]:
    rows = []
    for name, backend in ours(info).items():
        direct = direct_of(name, info)
        with GrammarCompiler(backend) as compiler:
            for label, schema in SCHEMAS.items():
                text = json.dumps(schema)
                spec = GrammarSpec("json_schema", text)
                compiler.compile(spec)
                direct_s, ours_s = paired_medians(
                    [direct_compile(name, direct, text), partial(backend.compile, spec)],
                    repeat,
                )
                cached_s = median_time(partial(compiler.compile, spec), 200)
                rows.append(
                    {
                        "backend": name,
                        "schema": label,
                        "direct_ms": 1e3 * direct_s,
                        "ours_cold_ms": 1e3 * ours_s,
                        "ours_cached_us": 1e6 * cached_s,
                    }
                )
    return rows


def time_ours(grammar: Any, tokens: list[int], bitmask: Any) -> tuple[float, float]:
    """Seconds spent filling the bitmask and accepting, summed over `tokens`."""
    fill = accept = 0.0
    for token in tokens:
        start = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        middle = time.perf_counter()
        assert grammar.accept_token(token)
        accept += time.perf_counter() - middle
        fill += middle - start
    return fill, accept


def time_direct(name: str, handle: Any, tokens: list[int], bitmask: Any) -> tuple[float, float]:
    """The same with the backend's own matcher on the same compiled grammar."""
    fill = accept = 0.0
    if name == "xgrammar":
        matcher = xgr.GrammarMatcher(handle)
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            middle = time.perf_counter()
            assert matcher.accept_token(token)
            accept += time.perf_counter() - middle
            fill += middle - start
        return fill, accept
    if name == "llguidance":
        matcher = handle.deep_copy()
        row = (bitmask[0].data_ptr(), bitmask[0].numel() * 4)
        for token in tokens:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(*row)
            middle = time.perf_counter()
            assert matcher.consume_token(token), matcher.get_error()
            accept += time.perf_counter() - middle
            fill += middle - start
        return fill, accept
    guide = outlines_core.Guide(handle.index, max_rollback=1 << 30)
    width = bitmask.shape[1]
    for token in tokens[:-1]:  # outlines-core has no transition for the stop token
        start = time.perf_counter()
        guide.write_mask_into(bitmask[0].data_ptr(), width, 4)
        middle = time.perf_counter()
        guide.advance(token, return_tokens=False)
        accept += time.perf_counter() - middle
        fill += middle - start
    return fill, accept


def bench_mask(info: TokenizerInfo, repeat: int) -> list[dict[str, Any]]:
    encode = greedy_encoder(list(info.token_bytes))
    tokens = [*encode(compact(TARGETS["person"])), info.stop_token_ids[0]]
    bitmask = allocate_bitmask(1, info.vocab_size)
    rows = []
    for name, backend in ours(info).items():
        compiled = backend.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
        # The backend's own matcher over the same compiled grammar; llguidance's is built from
        # the schema (its handle is the backend's business).
        handle = compiled.handle
        if name == "llguidance":
            handle = direct_compile(name, direct_llguidance(info), json.dumps(PERSON))()
        samples: dict[str, list[tuple[float, float]]] = {"direct": [], "ours": []}
        for _ in range(repeat):  # in turn, so that load lands on both alike
            samples["direct"].append(time_direct(name, handle, tokens, bitmask))
            samples["ours"].append(time_ours(backend.matcher(compiled), tokens, bitmask))
        results = {}
        for label, pairs in samples.items():
            steps = len(tokens) if label == "ours" or name == "xgrammar" else len(tokens) - 1
            results[label] = (
                1e6 * statistics.median(p[0] for p in pairs) / steps,
                1e6 * statistics.median(p[1] for p in pairs) / steps,
            )
        rows.append(
            {
                "backend": name,
                "vocab": info.vocab_size,
                "direct_fill_us": results["direct"][0],
                "ours_fill_us": results["ours"][0],
                "direct_accept_us": results["direct"][1],
                "ours_accept_us": results["ours"][1],
            }
        )
    logits = torch.randn(1, info.vocab_size)
    rows.append(
        {
            "backend": "apply_bitmask (torch reference)",
            "vocab": info.vocab_size,
            "ours_fill_us": 1e6 * median_time(lambda: apply_bitmask(logits, bitmask), repeat * 20),
        }
    )
    return rows


def run_tokens(grammar: Any, tokens: list[int], bitmask: Any) -> None:
    """Fill the bitmask and accept each token, untimed per call (no timer in the loop)."""
    for token in tokens:
        grammar.fill_bitmask(bitmask, 0)
        if not grammar.accept_token(token):
            raise AssertionError(f"token {token} refused")


def timed_run(make: Callable[[], Any], tokens: list[int], bitmask: Any) -> tuple[int, int]:
    """(wall ns, process CPU ns) of one `run_tokens` over a fresh matcher from `make`."""
    grammar = make()
    wall, cpu = time.perf_counter_ns(), time.process_time_ns()
    run_tokens(grammar, tokens, bitmask)
    return time.perf_counter_ns() - wall, time.process_time_ns() - cpu


def bench_validation(
    info: TokenizerInfo, label: str, schema: Any, target: Any, pairs: int
) -> dict[str, Any]:
    """Per output token, fill + accept: `auto`'s validating matcher beside the matcher of the
    backend it chose (no validation), over the same compiled grammar and tokens.

    The two run in turn, `pairs` times (which goes first alternates), so load on this shared
    machine lands on both alike; each run's wall and process CPU time are kept. Reported: the
    median and the minimum per token of each, and the overhead as the median of the per-pair
    ratios with its spread (the 10th to 90th percentile of those ratios)."""
    encode = greedy_encoder(list(info.token_bytes))
    tokens = [*encode(compact(target)), info.stop_token_ids[0]]
    auto = create_backend("auto", info)
    compiled = auto.compile(GrammarSpec("json_schema", json.dumps(schema)))
    choice = compiled.handle
    inner = auto.backend(choice.backend)
    bitmask = allocate_bitmask(1, info.vocab_size)
    systems = {
        "plain": partial(inner.matcher, choice.compiled),
        "validating": partial(auto.matcher, compiled),
    }
    check = auto.matcher(compiled)  # also fills the checks' caches, as for any later request
    run_tokens(check, tokens, bitmask)
    assert check.violation() is None and check.is_terminated(), check.violation()
    for make in systems.values():  # warm-up
        for _ in range(5):
            timed_run(make, tokens, bitmask)
    gc.collect()
    samples: dict[str, list[tuple[int, int]]] = {name: [] for name in systems}
    for round_ in range(pairs):
        order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
        for name in order:
            samples[name].append(timed_run(systems[name], tokens, bitmask))
    from radixlm.constrained._validation import compiled_validator_available

    row: dict[str, Any] = {
        "schema": label,
        "served_by": compiled.served_by,
        "validated": ", ".join(compiled.validated),
        "validator": "jsonschema-rs" if compiled_validator_available() else "jsonschema",
        "vocab": info.vocab_size,
        "tokens": len(tokens),
        "pairs": pairs,
    }
    for clock, index in (("wall", 0), ("cpu", 1)):
        plain = [s[index] for s in samples["plain"]]
        validating = [s[index] for s in samples["validating"]]
        ratios = sorted(v / p - 1 for p, v in zip(plain, validating, strict=True) if p)
        deciles = statistics.quantiles(ratios, n=10)
        row |= {
            f"{clock}_plain_us": statistics.median(plain) / 1e3 / len(tokens),
            f"{clock}_validating_us": statistics.median(validating) / 1e3 / len(tokens),
            f"{clock}_plain_min_us": min(plain) / 1e3 / len(tokens),
            f"{clock}_validating_min_us": min(validating) / 1e3 / len(tokens),
            f"{clock}_overhead": statistics.median(ratios),
            f"{clock}_overhead_p10": deciles[0],
            f"{clock}_overhead_p90": deciles[-1],
            f"{clock}_overhead_of_mins": min(validating) / min(plain) - 1,
        }
    return row


def stand_in_model(info: TokenizerInfo, target: str) -> Callable[[list[int]], Any]:
    """Seeded noise from the text so far plus a strong push towards `target` (see the tests)."""
    goal = target.encode()
    boundary: dict[int, int] = {}
    position = 0
    for token in info.encode_exact(target) or []:
        boundary[position] = token
        position += len(info.token_bytes[token] or b"")

    def longest_fit(rest: bytes) -> int:
        fits = [i for i, b in enumerate(info.token_bytes) if b and rest.startswith(b)]
        return max(fits, key=lambda i: len(info.token_bytes[i] or b""))

    def logits(output: list[int]) -> Any:
        text = info.decode_bytes(output)
        seed = int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
        row = torch.randn(1, info.vocab_size, generator=torch.Generator().manual_seed(seed))
        if goal.startswith(text):
            rest = goal[len(text) :]
            choice = boundary.get(len(text)) if rest else info.stop_token_ids[0]
            row[0, choice if choice is not None else longest_fit(rest)] += 100.0
        return row

    return logits


def decode(grammar: Any, info: TokenizerInfo, model: Any, jump: bool) -> dict[str, Any]:
    bitmask = allocate_bitmask(1, info.vocab_size)
    output: list[int] = []
    calls = jumped = 0
    spent = {True: 0.0, False: 0.0}  # seconds in jump_forward(), by whether it jumped
    counts = {True: 0, False: 0}
    while not grammar.is_terminated() and calls < 1000:
        if jump:
            start = time.perf_counter()
            step = grammar.jump_forward()
            spent[step is not None] += time.perf_counter() - start
            counts[step is not None] += 1
            if step is not None:
                grammar.rollback(step.rollback)
                del output[len(output) - step.rollback :]
                for token in step.token_ids:
                    grammar.accept_token(token)
                output += step.token_ids
                jumped += len(step.token_ids) - step.rollback
        row = model(output)
        grammar.fill_bitmask(bitmask, 0)
        apply_bitmask(row, bitmask)
        token = int(row.argmax())
        grammar.accept_token(token)
        calls += 1
        if token not in info.stop_token_ids:
            output.append(token)
    return {
        "tokens": len(output),
        "calls": calls,
        "jumped": jumped,
        "jump_us": 1e6 * spent[True] / max(counts[True], 1),
        "no_jump_us": 1e6 * spent[False] / max(counts[False], 1),
        "text": info.decode_bytes(output).decode(),
    }


def bench_jump_forward(vocab_size: int) -> list[dict[str, Any]]:
    tokenizer = trained_tokenizer(vocab_size)
    info = TokenizerInfo.from_hf(tokenizer)
    rows = []
    for name, backend in ours(info).items():
        for label, schema in SCHEMAS.items():
            compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
            target = compact(TARGETS[label])
            model = stand_in_model(info, target)
            plain = decode(backend.matcher(compiled), info, model, jump=False)
            jumping = decode(backend.matcher(compiled), info, model, jump=True)
            # Again: the tokenizer's answers for this schema's forced text are remembered now,
            # as they are on a server that sees the same schema again.
            again = decode(backend.matcher(compiled), info, model, jump=True)
            assert plain["text"] == jumping["text"] == target, (plain["text"], jumping["text"])
            rows.append(
                {
                    "backend": name,
                    "schema": label,
                    "tokens": jumping["tokens"],
                    "jumped_fraction": jumping["jumped"] / jumping["tokens"],
                    "calls_plain": plain["calls"],
                    "calls_jump": jumping["calls"],
                    "calls_saved": 1 - jumping["calls"] / plain["calls"],
                    "jump_us": jumping["jump_us"],
                    "jump_again_us": again["jump_us"],
                    "no_jump_us": jumping["no_jump_us"],
                }
            )
    return rows


# ------------------------------------------------------------------------------------ output


def table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n## {title}\n")
    print("| " + " | ".join(header for header, _, _ in columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("" if value is None else format(value, fmt))
        print("| " + " | ".join(cells) + " |")


def existing_parts(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    """Parts 1-4 (see the module doc)."""
    first = TokenizerInfo.from_vocab(synthetic_vocab(args.vocab[0]), stop_token_ids=[0])
    figures["compile"] = bench_compile(first, args.repeat)
    table(
        f"compile a JSON schema (vocab {args.vocab[0]}, median of {args.repeat})",
        figures["compile"],
        [("backend", "backend", "s"), ("schema", "schema", "s"), ("direct ms", "direct_ms", ".2f"),
         ("ours cold ms", "ours_cold_ms", ".2f"), ("ours cached µs", "ours_cached_us", ".1f")],
    )  # fmt: skip
    figures["mask"] = []
    for size in args.vocab:
        info = TokenizerInfo.from_vocab(synthetic_vocab(size), stop_token_ids=[0], encode=None)
        figures["mask"] += bench_mask(info, args.repeat)
    table(
        "per output token: fill the bitmask, accept the token (µs, person schema)",
        figures["mask"],
        [("backend", "backend", "s"), ("vocab", "vocab", "d"),
         ("direct fill", "direct_fill_us", ".1f"), ("ours fill", "ours_fill_us", ".1f"),
         ("direct accept", "direct_accept_us", ".1f"), ("ours accept", "ours_accept_us", ".1f")],
    )  # fmt: skip
    figures["jump_forward"] = bench_jump_forward(args.jf_vocab)
    table(
        f"jump-forward on schema-constrained generation (trained BPE, vocab {args.jf_vocab})",
        figures["jump_forward"],
        [("backend", "backend", "s"), ("schema", "schema", "s"), ("output tokens", "tokens", "d"),
         ("placed by jump-forward", "jumped_fraction", ".0%"),
         ("model calls without", "calls_plain", "d"), ("with", "calls_jump", "d"),
         ("calls saved", "calls_saved", ".0%"), ("µs per jump", "jump_us", ".0f"),
         ("same schema again", "jump_again_us", ".0f"),
         ("µs per check without one", "no_jump_us", ".0f")],
    )  # fmt: skip
    overhead = []
    for name in dict.fromkeys(r["backend"] for r in figures["compile"]):
        rows = [r for r in figures["compile"] if r["backend"] == name]
        compile_ratio = statistics.median(r["ours_cold_ms"] / r["direct_ms"] - 1 for r in rows)
        per_token = statistics.median(
            (r["ours_fill_us"] + r["ours_accept_us"])
            / (r["direct_fill_us"] + r["direct_accept_us"])
            - 1
            for r in figures["mask"]
            if r["backend"] == name
        )
        overhead.append({"backend": name, "compile": compile_ratio, "per_token": per_token})
    figures["overhead"] = overhead
    table(
        "overhead of ours over calling the backend directly (goal <= 10%)",
        overhead,
        [("backend", "backend", "s"), ("compile (median over schemas)", "compile", "+.1%"),
         ("per token, fill + accept (median over vocabs)", "per_token", "+.1%")],
    )  # fmt: skip


def validation_part(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    figures["validation"] = []
    for size in args.vocab:
        info = TokenizerInfo.from_vocab(synthetic_vocab(size), stop_token_ids=[0], encode=None)
        for label, (schema, target) in VALIDATION_CASES.items():
            figures["validation"].append(
                bench_validation(info, label, schema, target, args.validation_pairs)
            )
    rows = figures["validation"]
    pairs = args.validation_pairs
    common = [("schema", "schema", "s"), ("served by", "served_by", "s"),
              ("validated", "validated", "s"), ("validator", "validator", "s"),
              ("vocab", "vocab", "d"), ("tokens", "tokens", "d")]  # fmt: skip
    for clock, what in (("cpu", "process CPU time"), ("wall", "wall time")):
        table(
            f"per output token with validation, {what}: auto's matcher beside the chosen "
            f"backend's (µs, fill + accept, {pairs} interleaved pairs; goal <= 15%)",
            rows,
            [*common,
             ("backend alone, median", f"{clock}_plain_us", ".2f"),
             ("with validation, median", f"{clock}_validating_us", ".2f"),
             ("alone, min", f"{clock}_plain_min_us", ".2f"),
             ("with, min", f"{clock}_validating_min_us", ".2f"),
             ("overhead (median of pairs)", f"{clock}_overhead", "+.1%"),
             ("p10", f"{clock}_overhead_p10", "+.1%"), ("p90", f"{clock}_overhead_p90", "+.1%"),
             ("overhead of mins", f"{clock}_overhead_of_mins", "+.1%")],
        )  # fmt: skip


def main() -> int:
    from grammar_corpus_bench import add_arguments, corpus_part_from_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 152000])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--validation-pairs", type=int, default=300,
                        help="validation part: interleaved runs of each system")  # fmt: skip
    parser.add_argument("--jf-vocab", type=int, default=4000, help="trained BPE vocabulary size")
    parser.add_argument("--quick", action="store_true", help="vocab 32k only, fewer repeats")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--parts", nargs="+", choices=["backends", "validation", "corpus"],
                        default=["backends", "validation", "corpus"],
                        help="backends: parts 1-4")  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.repeat, args.validation_pairs = [32000], 3, 40
    torch.set_num_threads(1)
    from importlib.metadata import version

    print(
        f"radixlm-constrained grammar benchmark: xgrammar {version('xgrammar')}, "
        f"llguidance {version('llguidance')}, outlines-core {version('outlines-core')}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 torch thread"
    )
    figures: dict[str, Any] = {}
    if "backends" in args.parts:
        existing_parts(args, figures)
    if "validation" in args.parts:
        validation_part(args, figures)
    if "corpus" in args.parts:
        figures["corpus"] = corpus_part_from_args(args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
