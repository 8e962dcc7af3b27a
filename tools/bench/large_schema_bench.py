#!/usr/bin/env python3
"""Compile time and worst mask time of JSON schemas of tens of thousands of subschemas on the
llguidance backend (the shapes of packages/constrained/tests/test_constrained_large_schemas.py,
at two sizes each), with the test suite's 1,024-token BPE vocabulary (trained here, nothing is
downloaded). The mask is timed at every byte of a valid document fed one byte per token.

    .venv/bin/python tools/bench/large_schema_bench.py      # about 40 s on 2 cores
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for part in ("constrained", "sampling"):
    sys.path.insert(0, str(ROOT / "packages" / part / "src"))  # runs from a checkout
sys.path.insert(0, str(ROOT / "packages" / "constrained" / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import conftest  # noqa: E402
from test_constrained_large_schemas import (  # noqa: E402
    big_any_of,
    definitions_library,
    many_properties,
    nested_arrays,
)

from radixlm.constrained import (  # noqa: E402
    GrammarError,
    GrammarSpec,
    TokenizerInfo,
    allocate_bitmask,
    create_backend,
)
from radixlm.constrained.backends._llguidance_schema import count_nodes  # noqa: E402


def required_members(count: int) -> dict[str, Any]:
    return {f"p{i}": [{"id": i}, ["red"], None][i % 3] for i in range(0, count, 500)}


CASES = [
    ("10,000 properties", many_properties(), required_members(10_000)),
    ("30,000 properties", many_properties(30_000), required_members(30_000)),
    ("3,200 definitions in cycles", definitions_library(), {"root": {"v": 1, "next": {"v": 2}}}),
    ("10,000 definitions", definitions_library(10_000), {"root": {"v": 1, "next": {"v": 2}}}),
    ("anyOf of 2,200 objects", big_any_of(), {"event": {"kind": "k7", "f7": True}}),
    ("anyOf of 7,000 objects", big_any_of(7_000), {"event": {"kind": "k7", "f7": True}}),
    ("arrays of 11 objects of 1,200 properties", nested_arrays(), [[{"c0_1": [1]}]]),
    ("arrays of 11 objects of 3,000 properties", nested_arrays(10, 3_000), [[{"c0_1": [1]}]]),
]


def main() -> None:
    info = TokenizerInfo.from_hf(conftest._byte_level_tokenizer(1000), vocab_size=1024)
    backend = create_backend("llguidance", info)
    byte_token = {data[0]: i for i, data in enumerate(info.token_bytes) if data and len(data) == 1}
    print("| Schema | Subschemas | Bytes | Compile | Worst mask |\n|---|---|---|---|---|")
    for name, schema, document in CASES:
        text = json.dumps(schema)
        started = time.perf_counter()
        try:
            compiled = backend.compile(GrammarSpec("json_schema", text))
        except GrammarError as error:
            took = time.perf_counter() - started
            print(
                f"| {name} | {count_nodes(schema)} | {len(text)} | refused in {took:.1f} s: "
                f"{error.message[:60]}... | |"
            )
            continue
        took = time.perf_counter() - started
        grammar = backend.matcher(compiled)
        bitmask = allocate_bitmask(1, info.vocab_size)
        worst = 0.0
        for byte in json.dumps(document, separators=(",", ":")).encode():
            begun = time.perf_counter()
            grammar.fill_bitmask(bitmask, 0)
            worst = max(worst, time.perf_counter() - begun)
            assert grammar.accept_token(byte_token[byte])
        assert grammar.accept_token(info.stop_token_ids[0])
        print(
            f"| {name} | {count_nodes(schema)} | {len(text)} | {took:.1f} s | "
            f"{worst * 1000:.1f} ms |"
        )


if __name__ == "__main__":
    main()
