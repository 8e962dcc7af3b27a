#!/usr/bin/env python3
"""Embeddings per second of radixlm's pooling models against sentence-transformers in the
same process, side by side: 512 short inputs (12-24 tokens) and 64 long ones (256-400
tokens), on a random-weight model of a real shape that both load from one directory.

Shapes: `minilm` (all-MiniLM-L6-v2: BERT 384/6 layers, mean pooling), `bge-base` (BERT-base
768/12 layers, CLS pooling), `qwen3-0.6b` (Qwen3-Embedding-0.6B as a `Qwen3Model`, last-token
pooling; a quarter of the inputs: it is slow on a CPU), each with L2 normalisation as the
models' sentence-transformers configs have it. The tokenizer is the fixtures' small
WordPiece (BERT) or byte-level BPE (Qwen3) one trained on built-in words; the texts are the
fixtures' sample sentences cut to the token lengths above.

radixlm: `Engine(path, dtype="float32", device="cpu", cpu_threads=T).encode(texts)`, all
texts submitted at once (`max_running_requests` as large as the workload, so the scheduler
may batch them all). sentence-transformers: `SentenceTransformer(path, device="cpu")
.encode(texts, batch_size=32)` (its default) under `torch.set_num_threads(T)`. Both are
warmed first, then run alternately (A, B, A, B, ...) `--repeats` times; the table shows the
median of each. The embeddings of the two are compared (max abs difference). With
`--cross-encoder`, a reranking workload too: 64 queries x 8 documents scored by a BERT
cross-encoder of the same shape (`BertForSequenceClassification`, one label) against
`CrossEncoder.predict` (radixlm's logits through the same sigmoid).

    .venv/bin/python tools/bench/embed_bench.py                       # minilm, a few minutes
    .venv/bin/python tools/bench/embed_bench.py --shape bge-base
    .venv/bin/python tools/bench/embed_bench.py --cross-encoder
    .venv/bin/python tools/bench/embed_bench.py --shape qwen3-0.6b    # slow: builds 2.4 GB
    .venv/bin/python tools/bench/embed_bench.py --quick               # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from quant_quality import cpu_flags

#: Each shape: its transformers config, the sentence-transformers pooling, and the share of
#: the workloads' inputs it runs (the 0.6B decoder is slow on a CPU).
SHAPES: dict[str, dict[str, Any]] = {
    "minilm": {
        "family": "bert",
        "config": {
            "vocab_size": 30522,
            "hidden_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 12,
            "intermediate_size": 1536,
            "max_position_embeddings": 512,
        },
        "pooling": "mean",
        "share": 1,
    },
    "bge-base": {
        "family": "bert",
        "config": {
            "vocab_size": 30522,
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "max_position_embeddings": 512,
        },
        "pooling": "cls",
        "share": 1,
    },
    "qwen3-0.6b": {
        "family": "qwen3",
        "config": {
            "vocab_size": 151669,
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 3072,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
        "pooling": "lasttoken",
        "share": 4,
    },
    # --quick: the test-sized BERT, with room for the long inputs.
    "tiny": {
        "family": "bert",
        "config": {
            "vocab_size": 512,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "max_position_embeddings": 512,
        },
        "pooling": "mean",
        "share": 1,
    },
}

#: Workloads: (inputs, fewest tokens, most tokens), special tokens included.
SHORT = (512, 12, 24)
LONG = (64, 256, 400)
#: Reranking: queries, documents per query, and each side's token range.
QUERIES, DOCUMENTS_PER_QUERY = 64, 8
QUERY_TOKENS, DOCUMENT_TOKENS = (8, 16), (64, 128)
MAX_SEQ_LENGTH = 512
ST_BATCH_SIZE = 32  # sentence-transformers' default


# Models --------------------------------------------------------------------------------


def _tokenizer(family: str, scratch: Path) -> Any:
    """The fixtures' tokenizer of a model family, good for inputs of MAX_SEQ_LENGTH."""
    from transformers import AutoTokenizer

    from radixlm.runtime.fixtures import build_tiny_tokenizer
    from radixlm.runtime.fixtures_pooling import build_tiny_bert

    if family == "bert":
        build_tiny_bert(scratch)  # (a tiny model beside it, unused)
    else:
        build_tiny_tokenizer(scratch)
    tokenizer = AutoTokenizer.from_pretrained(str(scratch))
    tokenizer.model_max_length = MAX_SEQ_LENGTH
    return tokenizer


def build_model(shape: str, path: Path, *, cross_encoder: bool = False) -> Path:
    """Write a random float32 model of `shape` (seed 0) and its tokenizer into `path`: with
    `cross_encoder` a one-label `BertForSequenceClassification`, else the bare model with
    the shape's sentence-transformers files. Returns `path`."""
    import torch
    import transformers

    from radixlm.runtime.fixtures_pooling import write_sentence_transformers_config

    spec = SHAPES[shape]
    family = spec["family"]
    if cross_encoder and family != "bert":
        raise ValueError(f"--cross-encoder needs a BERT shape; {shape!r} is not one")
    tokenizer = _tokenizer(family, path.with_name(path.name + "-tokenizer"))
    if cross_encoder:
        architecture = "BertForSequenceClassification"
        extra: dict[str, Any] = {"num_labels": 1}
    else:
        architecture = "BertModel" if family == "bert" else "Qwen3Model"
        extra = {}
    config_class = transformers.BertConfig if family == "bert" else transformers.Qwen3Config
    config = config_class(
        **spec["config"],
        **extra,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[architecture],
    )
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    del model
    tokenizer.save_pretrained(str(path))
    if not cross_encoder:
        write_sentence_transformers_config(
            path, pooling=spec["pooling"], normalize=True, max_seq_length=MAX_SEQ_LENGTH
        )
    return path


# Workloads ------------------------------------------------------------------------------


def texts_of(tokenizer: Any, count: int, low: int, high: int, seed: int) -> list[str]:
    """`count` texts of the fixtures' sample sentences, each cut at a word's end to about a
    length drawn from `low .. high` tokens (special tokens included)."""
    from radixlm.runtime.fixtures import sample_texts

    rng = random.Random(seed)
    specials = len(tokenizer("")["input_ids"])
    texts = []
    for i in range(count):
        target = rng.randint(low, high) - specials
        # At least one token a word: `target` words are always enough to cut from.
        text = sample_texts(1, seed=seed * 100_003 + i, words=2 * target)[0]
        encoded = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        ends = [end for _, end in encoded.offsets]
        cut = ends[min(target, len(ends)) - 1]
        space = text.find(" ", cut)
        texts.append(text if space < 0 else text[:space])
    return texts


def token_counts(tokenizer: Any, texts: list[str], pairs: list[str] | None = None) -> list[int]:
    """Each input's tokens, special tokens included (a pair's both sides)."""
    encoded = tokenizer(texts, pairs) if pairs is not None else tokenizer(texts)
    return [len(ids) for ids in encoded["input_ids"]]


# Systems --------------------------------------------------------------------------------


def radixlm_run(
    engine: Any, texts: list[str], pairs: list[str] | None
) -> tuple[list[list[float]], int]:
    """radixlm's vectors (a cross-encoder's scores through a sigmoid) of every input, all
    submitted at once, on a flushed cache, and the prompt tokens its prefix cache served.

    An encoder caches nothing; a decoder embedder (last-token pooling) may reuse a prefix
    that inputs of the same run share, as it would serving them, but nothing of an earlier
    run."""
    import torch

    engine.flush_cache()
    out = engine.encode(texts) if pairs is None else engine.encode(texts, text_pair=pairs)
    cached = sum(row["meta_info"]["cached_tokens"] for row in out)
    rows = [row["embedding"] for row in out]
    if pairs is not None:
        rows = [[torch.sigmoid(torch.tensor(row[0])).item()] for row in rows]
    return rows, cached


def st_run(model: Any, texts: list[str], pairs: list[str] | None) -> Any:
    """sentence-transformers' vectors (or CrossEncoder's scores) of every input, at its
    default batch size."""
    if pairs is None:
        return model.encode(texts, batch_size=ST_BATCH_SIZE)
    scores = model.predict(list(zip(texts, pairs, strict=True)), batch_size=ST_BATCH_SIZE)
    return scores.reshape(-1, 1)


def max_abs_diff(a: Any, b: Any) -> float:
    import numpy as np

    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def race(
    systems: dict[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """Each system's median seconds over `repeats` runs taken alternately, after one
    warm-up run each, and its last result."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    results: dict[str, Any] = {name: run() for name, run in systems.items()}  # warm-up
    for _ in range(repeats):
        for name, run in systems.items():
            start = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, results


# Main -----------------------------------------------------------------------------------


def measure(
    label: str,
    path: Path,
    texts: list[str],
    pairs: list[str] | None,
    tokens: list[int],
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """One workload on both systems: a result row, printed."""
    from radixlm.runtime import Engine

    if pairs is None:
        from sentence_transformers import SentenceTransformer

        st_model: Any = SentenceTransformer(str(path), device="cpu")
    else:
        from sentence_transformers import CrossEncoder

        st_model = CrossEncoder(str(path), device="cpu", max_length=MAX_SEQ_LENGTH)
    with Engine(str(path), **engine_kwargs) as engine:
        seconds, results = race(
            {
                "radixlm": lambda: radixlm_run(engine, texts, pairs),
                "sentence-transformers": lambda: st_run(st_model, texts, pairs),
            },
            args.repeats,
        )
    rate = {name: len(texts) / s for name, s in seconds.items()}
    vectors, cached = results["radixlm"]
    row = {
        "workload": label,
        "inputs": len(texts),
        "mean_tokens": statistics.mean(tokens),
        "radixlm_per_s": rate["radixlm"],
        "st_per_s": rate["sentence-transformers"],
        "ratio": rate["radixlm"] / rate["sentence-transformers"],
        "max_abs_diff": max_abs_diff(vectors, results["sentence-transformers"]),
        "radixlm_cached_tokens": cached,
    }
    print(f"{label:10} {row['inputs']:6d} {row['mean_tokens']:7.1f} {row['radixlm_per_s']:10.2f} "
          f"{row['st_per_s']:10.2f} {row['ratio']:6.2f}x {row['max_abs_diff']:9.1e} {cached:6d}", flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"], default="minilm")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both systems")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each system")
    parser.add_argument("--cross-encoder", action="store_true",
                        help="also the reranking workload (64 queries x 8 documents)")  # fmt: skip
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="radixlm's prefill tokens per step (the engine's default if unset)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="a tiny BERT, a few inputs, one repeat: seconds (a smoke run)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import sentence_transformers
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    shape = "tiny" if args.quick else args.shape
    share = 32 if args.quick else SHAPES[shape]["share"]
    if args.quick:
        args.repeats = 1
    workloads = [("short", SHORT), ("long", LONG)]
    scaled = [(name, (n // share, lo, hi)) for name, (n, lo, hi) in workloads]
    most = max(n for _, (n, _, _) in scaled)
    engine_kwargs: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "cpu_threads": args.threads,
        "show_progress": False,
        # Room for the whole workload at once: batching is the scheduler's to decide.
        "max_running_requests": max(most, QUERIES * DOCUMENTS_PER_QUERY // share),
    }
    if args.max_prefill_tokens is not None:
        engine_kwargs["max_prefill_tokens"] = args.max_prefill_tokens

    print(f"{shape}, random float32 weights, {args.threads} thread(s), {cpu_flags()}; "
          f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}; "
          f"median of {args.repeats} alternating run(s) each, after a warm-up")  # fmt: skip
    if share > 1:
        print(
            f"(1/{share} of the inputs: {', '.join(f'{n} {name}' for name, (n, _, _) in scaled)})"
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="radixlm-embed-") as workdir:
        start = time.perf_counter()
        path = build_model(shape, Path(workdir) / "model")
        print(f"built the model in {time.perf_counter() - start:.0f} s", flush=True)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        print(f"{'workload':10} {'inputs':>6} {'tokens':>7} {'radixlm/s':>10} {'ST/s':>10} "
              f"{'ratio':>7} {'max diff':>9} {'cached':>6}")  # fmt: skip
        for seed, (name, (count, low, high)) in enumerate(scaled, start=1):
            texts = texts_of(tokenizer, count, low, high, seed)
            tokens = token_counts(tokenizer, texts)
            rows.append(measure(name, path, texts, None, tokens, args, engine_kwargs))
        if args.cross_encoder:
            ce_path = build_model(shape, Path(workdir) / "cross-encoder", cross_encoder=True)
            queries = QUERIES // share
            asked = texts_of(tokenizer, queries, *QUERY_TOKENS, seed=3)
            documents = texts_of(tokenizer, queries * DOCUMENTS_PER_QUERY, *DOCUMENT_TOKENS, 4)
            texts = [q for q in asked for _ in range(DOCUMENTS_PER_QUERY)]
            tokens = token_counts(tokenizer, texts, documents)
            rows.append(measure("rerank", ce_path, texts, documents, tokens, args, engine_kwargs))
    print("tokens: mean tokens an input (special tokens included; a pair's both sides); "
          "ratio: radixlm / sentence-transformers embeddings (rerank: pairs) a second; "
          "max diff: the largest |radixlm - sentence-transformers| of any value; cached: prompt "
          "tokens radixlm's prefix cache served in the last run (inputs of one run sharing a "
          "prefix; flushed between runs)")  # fmt: skip
    result = {
        "shape": shape,
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu": cpu_flags(),
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "rows": rows,
    }
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
