#!/usr/bin/env python3
"""Benchmark radixlm-kernels: each Triton kernel against its torch reference (and torch SDPA for
attention, F.linear with a dequantized weight for the quantized linears) at serving shapes,
printing time, achieved memory bandwidth and its fraction of the device's peak (and TFLOP/s for
attention and the linears).

    python tools/bench/kernels_bench.py                 # GPU: serving shapes (a few minutes)
    python tools/bench/kernels_bench.py --tiny          # tiny shapes; the default without CUDA
    python tools/bench/kernels_bench.py --ops decode extend --json out.json
    python tools/bench/kernels_bench.py --ops quant     # int8 / int4 / fp8 weight-only linears

Without CUDA the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is set
here before they are defined): the figures then only prove that every path runs end to end.
Head configurations: Llama-3-8B (32 query heads, 8 KV heads, head_dim 128) and Qwen2.5-7B
(28 / 4 / 128); the quantized linears run Llama-3.1-8B's projections (qkv, o, gate_up, down) at
M = 1, 16, 256. Bytes are the minimum an ideal kernel moves (each operand read or written once),
so "GB/s" is an effective bandwidth and "%peak" its share of the device's HBM peak.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels" / "src"))  # runs from a checkout without installing

import radixlm.kernels as rk  # noqa: E402

MODELS = {
    "llama3-8b": (32, 8, 128, 4096, 14336, 128256),
    "qwen2.5-7b": (28, 4, 128, 3584, 18944, 152064),
}
# name -> (HBM GB/s, dense bf16 TFLOP/s); matched as a substring of the CUDA device name.
PEAKS = {
    "H200": (4800.0, 989.0),
    "H100 NVL": (3900.0, 835.0),
    "H100 PCIe": (2000.0, 756.0),
    "H100": (3350.0, 989.0),
    "H800": (3350.0, 989.0),
    "A100-SXM4-80GB": (2039.0, 312.0),
    "A100 80GB PCIe": (1935.0, 312.0),
    "A100": (1555.0, 312.0),
    "L40S": (864.0, 362.0),
    "L4": (300.0, 121.0),
    "A10G": (600.0, 70.0),
    "RTX 4090": (1008.0, 165.0),
}
# Llama-3.1-8B's projections: name -> (K, N).
LLAMA_PROJECTIONS = {
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
INT4_GROUP = 128
# Reference / SDPA peers materialise gathered K/V (and scores for extend): skip them past this.
PEER_BYTES_LIMIT = 24 * 2**30


@dataclass
class Row:
    op: str
    shape: str
    impl: str
    time_us: float | None
    gbytes: float
    tflops: float
    note: str = ""


@dataclass
class Bench:
    device: torch.device
    dtype: torch.dtype
    iters: int
    warmup: int
    peak_gbps: float | None
    peak_tflops: float | None
    rows: list[Row]

    def time_us(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            times = []
            for _ in range(self.iters):
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(float(start.elapsed_time(end)) * 1e3)
            return statistics.median(times)
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def run(
        self,
        op: str,
        shape: str,
        impls: dict[str, Callable[[], object] | str],
        nbytes: float,
        flops: float = 0.0,
    ) -> None:
        """Time each implementation; a string instead of a callable is why it was skipped."""
        for impl, fn in impls.items():
            if isinstance(fn, str):
                self.rows.append(Row(op, shape, impl, None, nbytes / 1e9, flops / 1e12, fn))
                continue
            if impl == "triton":
                with rk.use_backend("triton"):
                    us = self.time_us(fn)
            elif impl == "reference":
                with rk.use_backend("reference"):
                    us = self.time_us(fn)
            else:
                us = self.time_us(fn)
            self.rows.append(Row(op, shape, impl, us, nbytes / 1e9, flops / 1e12))
        self.print_rows(op, shape)

    def print_rows(self, op: str, shape: str) -> None:
        rows = [r for r in self.rows if r.op == op and r.shape == shape]
        base = next((r.time_us for r in rows if r.impl == "reference"), None)
        for r in rows:
            if r.time_us is None:
                print(f"{op:10s} {shape:44s} {r.impl:10s} {'skipped: ' + r.note}")
                continue
            gbps = r.gbytes / (r.time_us * 1e-6)
            frac = f"{100 * gbps / self.peak_gbps:5.1f}%" if self.peak_gbps else "   n/a"
            tf = ""
            if r.tflops:
                tfs = r.tflops / (r.time_us * 1e-6)
                tf = f"{tfs:8.2f} TFLOP/s"
                if self.peak_tflops:
                    tf += f" ({100 * tfs / self.peak_tflops:4.1f}%)"
            speed = f"x{base / r.time_us:6.2f}" if base and r.impl != "reference" else "       "
            print(
                f"{op:10s} {shape:44s} {r.impl:10s} {r.time_us:11.1f} us {gbps:9.1f} GB/s {frac} {speed} {tf}"
            )


def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _paged(
    lengths: list[int],
    kv_heads: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KV pool holding the requests in shuffled pages, and its req_to_token table."""
    pages = [math.ceil(n / page) for n in lengths]
    num_pages = sum(pages) + 1
    k_pool = torch.randn(num_pages * page, kv_heads, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    order = torch.randperm(num_pages, device=device)
    table = torch.zeros(len(lengths), max(lengths), dtype=torch.int32, device=device)
    offset = 0
    within = torch.arange(page, device=device)
    for b, n in enumerate(lengths):
        mine = order[offset : offset + pages[b]]
        offset += pages[b]
        table[b, :n] = (mine[:, None] * page + within[None, :]).flatten()[:n].int()
    return k_pool, v_pool, table


def _dense_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded contiguous K/V [batch, kv_heads, max_len, d] for the SDPA peer (not timed)."""
    slots = table.long()
    k = k_pool[slots].transpose(1, 2).contiguous()
    v = v_pool[slots].transpose(1, 2).contiguous()
    pos = torch.arange(table.shape[1], device=table.device)
    mask = pos[None, :] < torch.tensor(lengths, device=table.device)[:, None]
    return k, v, mask


def bench_decode(b: Bench, cases: list[tuple[str, int, int]]) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for model, batch, ctx in cases:
        heads, kv_heads, d = MODELS[model][:3]
        lengths = [ctx] * batch
        k_pool, v_pool, table = _paged(lengths, kv_heads, d, 16, b.dtype, b.device)
        q = torch.randn(batch, heads, d, device=b.device, dtype=b.dtype)
        seq_lens = torch.tensor(lengths, device=b.device, dtype=torch.int32)
        e = _elem(b.dtype)
        kv_bytes = 2 * batch * ctx * kv_heads * d * e
        nbytes = kv_bytes + batch * ctx * 4 + 2 * q.numel() * e
        flops = 4.0 * batch * heads * ctx * d

        run_kernel = partial(rk.decode_attention, q, k_pool, v_pool, table, seq_lens)
        impls: dict[str, Callable[[], object] | str] = {"triton": run_kernel}
        peer_bytes = 4 * kv_bytes + batch * heads * ctx * 4
        if peer_bytes > PEER_BYTES_LIMIT:
            impls["reference"] = impls["sdpa"] = f"needs ~{peer_bytes / 2**30:.0f} GiB"
        else:
            impls["reference"] = run_kernel
            k, v, mask = _dense_kv(k_pool, v_pool, table, lengths)
            impls["sdpa"] = partial(
                sdpa, q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], enable_gqa=True
            )
        b.run("decode", f"{model} b={batch} ctx={ctx}", impls, nbytes, flops)


def bench_extend(b: Bench, cases: list[tuple[str, int, int, int]]) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for model, batch, prefix, new in cases:
        heads, kv_heads, d = MODELS[model][:3]
        lengths = [prefix + new] * batch
        k_pool, v_pool, table = _paged(lengths, kv_heads, d, 16, b.dtype, b.device)
        q = torch.randn(batch * new, heads, d, device=b.device, dtype=b.dtype)
        prefix_lens = torch.full((batch,), prefix, device=b.device, dtype=torch.int32)
        extend_lens = torch.full((batch,), new, device=b.device, dtype=torch.int32)
        e = _elem(b.dtype)
        total = prefix + new
        nbytes = 2 * batch * total * kv_heads * d * e + 2 * q.numel() * e
        attended = batch * (new * prefix + new * (new + 1) / 2)
        flops = 4.0 * heads * d * attended

        run_kernel = partial(
            rk.extend_attention,
            q,
            k_pool,
            v_pool,
            table,
            prefix_lens,
            extend_lens,
            max_extend_len=new,
        )
        impls: dict[str, Callable[[], object] | str] = {"triton": run_kernel}
        peer_bytes = 2 * batch * heads * new * total * 4 + 4 * nbytes
        if peer_bytes > PEER_BYTES_LIMIT:
            impls["reference"] = impls["sdpa"] = f"needs ~{peer_bytes / 2**30:.0f} GiB"
        else:
            impls["reference"] = run_kernel
            k, v, _ = _dense_kv(k_pool, v_pool, table, lengths)
            qd = q.view(batch, new, heads, d).transpose(1, 2)
            q_pos = torch.arange(prefix, total, device=b.device)[:, None]
            mask = torch.arange(total, device=b.device)[None, :] <= q_pos
            impls["sdpa"] = partial(sdpa, qd, k, v, attn_mask=mask, enable_gqa=True)
        b.run("extend", f"{model} b={batch} prefix={prefix} new={new}", impls, nbytes, flops)


def bench_store_kv(b: Bench, cases: list[tuple[str, int]]) -> None:
    for model, tokens in cases:
        _, kv_heads, d = MODELS[model][:3]
        k = torch.randn(tokens, kv_heads, d, device=b.device, dtype=b.dtype)
        v = torch.randn_like(k)
        k_pool = torch.zeros(4 * tokens, kv_heads, d, device=b.device, dtype=b.dtype)
        v_pool = torch.zeros_like(k_pool)
        slots = torch.randperm(4 * tokens, device=b.device)[:tokens]

        nbytes = 4 * k.numel() * _elem(b.dtype) + slots.numel() * 8
        run = partial(rk.store_kv, k, v, k_pool, v_pool, slots)
        b.run("store_kv", f"{model} tokens={tokens}", _same(run), nbytes)


def bench_rowwise(b: Bench, cases: list[tuple[str, int]]) -> None:
    e = _elem(b.dtype)
    for model, tokens in cases:
        heads, kv_heads, d, hidden, inter, _ = MODELS[model]
        x = torch.randn(tokens, hidden, device=b.device, dtype=b.dtype)
        r = torch.randn_like(x)
        w = torch.rand(hidden, device=b.device, dtype=b.dtype)
        shape = f"{model} tokens={tokens}"
        b.run("rms_norm", shape, _same(partial(rk.rms_norm, x, w)), 2 * x.numel() * e)
        b.run(
            "add_rms",
            shape,
            _same(partial(rk.fused_add_rms_norm, x, r, w)),
            4 * x.numel() * e,
        )
        g = torch.randn(tokens, 2 * inter, device=b.device, dtype=b.dtype)
        b.run(
            "silu_mul",
            f"{model} tokens={tokens}",
            _same(partial(rk.silu_and_mul, g)),
            1.5 * g.numel() * e,
        )
        q = torch.randn(tokens, heads, d, device=b.device, dtype=b.dtype)
        k = torch.randn(tokens, kv_heads, d, device=b.device, dtype=b.dtype)
        angles = torch.arange(8192, device=b.device).float()[:, None] * torch.rand(
            d // 2, device=b.device
        )
        cos, sin = angles.cos(), angles.sin()
        pos = torch.randint(0, 8192, (tokens,), device=b.device)
        nbytes = 2 * (q.numel() + k.numel()) * e + tokens * d * 4
        b.run("rope", shape, _same(partial(rk.rotary_embedding, q, k, cos, sin, pos)), nbytes)


def bench_logits(b: Bench, cases: list[tuple[str, int]]) -> None:
    for model, batch in cases:
        vocab = MODELS[model][5]
        logits = torch.randn(batch, vocab, device=b.device)
        bitmask = torch.randint(
            -(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), device=b.device
        ).int()
        shape = f"{model} batch={batch} vocab={vocab}"
        b.run(
            "bitmask",
            shape,
            _same(partial(rk.apply_token_bitmask_inplace, logits, bitmask)),
            2 * logits.numel() * 4 + bitmask.numel() * 4,
        )
        probs = torch.softmax(torch.randn(batch, vocab, device=b.device) * 3, dim=-1)
        top_k = torch.full((batch,), 50, device=b.device)
        top_p = torch.full((batch,), 0.9, device=b.device)
        min_p = torch.full((batch,), 0.05, device=b.device)
        u = torch.rand(batch, device=b.device)
        b.run(
            "sample",
            shape,
            _same(partial(rk.sample_from_probs, probs, top_k, top_p, min_p, u)),
            probs.numel() * 4,  # one read of the probabilities
        )


def _quantized(
    fmt: str, w: torch.Tensor, dtype: torch.dtype
) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor | int, ...], torch.Tensor, float]:
    """The public linear of a format, its weight arguments, the dequantized weight in ``dtype``
    (for the F.linear peer) and the bytes the quantized weight and its scales occupy."""
    n, k = w.shape
    if fmt == "int8":
        q8, s8 = rk.quantize_int8(w)
        return rk.int8_linear, (q8, s8), rk.dequantize_int8(q8, s8).to(dtype), n * k + 4 * n
    if fmt == "int4":
        qw, sc, z = rk.quantize_int4(w.to(dtype), INT4_GROUP)
        deq = rk.dequantize_int4(qw, sc, z, INT4_GROUP).to(dtype)
        nbytes = n * k / 2 + 2 * sc.numel() * _elem(dtype)  # codes, scales and zeros
        return rk.int4_linear, (qw, sc, z, INT4_GROUP), deq, nbytes
    f8, s = rk.quantize_fp8(w, per_channel=True)
    return rk.fp8_linear, (f8, s), rk.dequantize_fp8(f8, s).to(dtype), n * k + 4 * n


def bench_quant(b: Bench, cases: list[tuple[str, int, int, int]]) -> None:
    """Weight-only int8 / int4 / fp8 linears (Triton, and the reference that dequantizes in
    fp32 on every call) against F.linear with the weight already dequantized to b.dtype."""
    e = _elem(b.dtype)
    for label, m, k, n in cases:
        w = torch.randn(n, k, device=b.device) / math.sqrt(k)
        x = torch.randn(m, k, device=b.device, dtype=b.dtype)
        shape = f"{label} M={m} K={k} N={n}"
        for fmt in ("int8", "int4", "fp8"):
            fn, weights, dense, weight_bytes = _quantized(fmt, w, b.dtype)
            run = partial(fn, x, *weights)
            impls: dict[str, Callable[[], object] | str] = _same(run)
            impls["F.linear"] = partial(torch.nn.functional.linear, x, dense)
            nbytes = weight_bytes + (m * k + m * n) * e
            b.run(f"{fmt}_lin", shape, impls, nbytes, 2.0 * m * n * k)


def _same(fn: Callable[[], object]) -> dict[str, Callable[[], object] | str]:
    """The public function under each backend (Bench.run sets the backend per implementation)."""
    return {"triton": fn, "reference": fn}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes (the default without CUDA)"
    )
    parser.add_argument(
        "--ops",
        nargs="*",
        default=["decode", "extend", "store_kv", "rowwise", "logits", "quant"],
        choices=["decode", "extend", "store_kv", "rowwise", "logits", "quant"],
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument(
        "--peak-gbps", type=float, default=None, help="override the device's HBM peak"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    tiny = args.tiny or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    peak_gbps, peak_tflops = next((p for key, p in PEAKS.items() if key in name), (None, None))
    if args.peak_gbps:
        peak_gbps = args.peak_gbps
    iters = args.iters or (2 if tiny and not cuda else 20)
    bench = Bench(
        device, getattr(torch, args.dtype), iters, 1 if tiny else 5, peak_gbps, peak_tflops, []
    )
    mode = "interpreter (figures meaningless)" if rk.interpreter_enabled() else "compiled"
    print(f"device: {name}; Triton: {mode}; dtype: {args.dtype}; iters: {iters}")
    print(
        f"peak: {peak_gbps or 'n/a'} GB/s, {peak_tflops or 'n/a'} TFLOP/s; torch {torch.__version__}"
    )
    print(
        f"{'op':10s} {'shape':44s} {'impl':10s} {'time':>14s} {'bandwidth':>14s} {'%peak':>6s} {'vs ref':>7s}"
    )

    models = ["llama3-8b"] if tiny else list(MODELS)
    if "decode" in args.ops:
        decode_grid = [(1, 64), (3, 40)] if tiny else [
            (1, 512), (1, 4096), (1, 32768), (16, 4096), (16, 32768),
            (64, 2048), (64, 8192), (256, 512), (256, 2048), (256, 4096),
        ]  # fmt: skip
        bench_decode(bench, [(m, bs, ctx) for m in models for bs, ctx in decode_grid])
    if "extend" in args.ops:
        extend_grid = (
            [(2, 8, 16)]
            if tiny
            else [(1, 0, 512), (1, 0, 4096), (4, 2048, 2048), (8, 8192, 512), (1, 0, 16384)]
        )
        bench_extend(bench, [(m, bs, p, n) for m in models for bs, p, n in extend_grid])
    if "store_kv" in args.ops:
        bench_store_kv(bench, [(m, t) for m in models for t in ([8] if tiny else [1, 256, 8192])])
    if "rowwise" in args.ops:
        bench_rowwise(
            bench, [(m, t) for m in models for t in ([4] if tiny else [1, 256, 4096, 16384])]
        )
    if "logits" in args.ops:
        batches = [2] if tiny else [1, 64, 256]
        if tiny:  # a tiny vocabulary keeps the interpreted sampler to seconds
            MODELS["tiny-vocab"] = (*MODELS["llama3-8b"][:5], 1000)
            bench_logits(bench, [("tiny-vocab", bs) for bs in batches])
        else:
            bench_logits(bench, [(m, bs) for m in models for bs in batches])
    if "quant" in args.ops:
        if tiny:  # one small projection keeps the interpreted GEMMs to seconds
            quant_grid = [("tiny", m, 256, 96) for m in (1, 16)]
        else:
            quant_grid = [
                (f"llama3.1-8b {proj}", m, k, n)
                for proj, (k, n) in LLAMA_PROJECTIONS.items()
                for m in (1, 16, 256)
            ]
        bench_quant(bench, quant_grid)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in bench.rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
