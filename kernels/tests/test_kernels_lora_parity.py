"""Segmented multi-adapter LoRA matmuls: both backends against a per-row loop oracle (Triton in
the interpreter on CPU), views of wider tensors, and the argument checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kernels_test_helpers import TOLERANCES
from torch.overrides import TorchFunctionMode

import radixlm.kernels as rk

BACKENDS: list[rk.BackendName] = ["reference", "triton"]
SLOTS = 3  # adapter slots in every pool
# fp32 products are compared at about 1e-4 relative; half types after one rounding of the result.
TOL = {**TOLERANCES, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


@dataclass(frozen=True)
class Segments:
    """Segment lengths (rows in order) and each segment's adapter slot (-1: none)."""

    lengths: list[int]
    slots: list[int]

    @property
    def rows(self) -> int:
        return sum(self.lengths)

    def tensors(
        self, device: torch.device | str, dtype: torch.dtype = torch.int32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        indptr = [0]
        for n in self.lengths:
            indptr.append(indptr[-1] + n)
        return (
            torch.tensor(indptr, dtype=dtype, device=device),
            torch.tensor(self.slots, dtype=dtype, device=device),
        )


CASES = {
    # every adapter, no adapter (-1), an empty segment, one-row segments, a segment longer
    # than one 16-row tile, lengths that are not multiples of 16
    "mixed": Segments([5, 0, 1, 19, 1, 3], [2, 0, -1, 1, 2, 0]),
    "decode": Segments([1] * 6, [0, -1, 1, 1, 2, 0]),
    "one adapter": Segments([17], [1]),
    "no adapter": Segments([3, 0, 4], [-1, 1, -1]),
}


def _oracle_shrink(x: torch.Tensor, weights_a: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Row by row in float64, rounded to x's dtype."""
    y = torch.zeros(x.shape[0], weights_a.shape[1], dtype=torch.float64)
    start = 0
    for n, slot in zip(seg.lengths, seg.slots, strict=True):
        for t in range(start, start + n):
            if slot >= 0:
                y[t] = weights_a[slot].cpu().double() @ x[t].cpu().double()
        start += n
    return y.to(x.dtype)


def _oracle_expand(
    y: torch.Tensor, weights_b: torch.Tensor, seg: Segments, out: torch.Tensor
) -> torch.Tensor:
    """A new tensor: ``out`` plus each row's product, in float64, rounded to out's dtype."""
    result = out.cpu().double()
    start = 0
    for n, slot in zip(seg.lengths, seg.slots, strict=True):
        for t in range(start, start + n):
            if slot >= 0:
                result[t] += weights_b[slot].cpu().double() @ y[t].cpu().double()
        start += n
    return result.to(out.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), **TOL[want.dtype])


def _pool(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Random weights scaled so that products stay near unit size."""
    return (torch.randn(*shape) / math.sqrt(shape[-1])).to(device=device, dtype=dtype)


def _shrink_inputs(
    seg: Segments, k: int, r: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(seg.rows, k).to(device=device, dtype=dtype)
    return x, _pool(SLOTS, r, k, dtype=dtype, device=device)


def _expand_inputs(
    seg: Segments, r: int, n: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = torch.randn(seg.rows, r).to(device=device, dtype=dtype)
    out = torch.randn(seg.rows, n).to(device=device, dtype=dtype)
    return y, _pool(SLOTS, n, r, dtype=dtype, device=device), out


def _run(
    backend: rk.BackendName, fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
) -> torch.Tensor:
    with rk.use_backend(backend):
        return fn(*args, **kwargs)


def _needs_triton(backend: rk.BackendName) -> None:
    if backend == "triton":
        pytest.importorskip("triton")


# --- both backends against the per-row oracle --------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("k", "r"), [(40, 8), (72, 64)])
def test_shrink_multiplies_each_segment_by_its_adapter(
    device: torch.device, backend: rk.BackendName, case: str, k: int, r: int
) -> None:
    _needs_triton(backend)
    seg = CASES[case]
    x, weights_a = _shrink_inputs(seg, k, r, torch.float32, device)
    got = _run(backend, rk.lora_shrink, x, weights_a, *seg.tensors(device))
    _close(got, _oracle_shrink(x, weights_a, seg))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("r", "n"), [(8, 40), (64, 72)])
def test_expand_adds_each_segments_product_in_place(
    device: torch.device, backend: rk.BackendName, case: str, r: int, n: int
) -> None:
    _needs_triton(backend)
    seg = CASES[case]
    y, weights_b, out = _expand_inputs(seg, r, n, torch.float32, device)
    want = _oracle_expand(y, weights_b, seg, out)
    got = _run(backend, rk.lora_expand, y, weights_b, *seg.tensors(device), out)
    assert got is out
    _close(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_shrink_then_expand(
    device: torch.device, backend: rk.BackendName, dtype: torch.dtype
) -> None:
    _needs_triton(backend)
    seg = CASES["mixed"]
    indptr, slots = seg.tensors(device, torch.int64)
    x, weights_a = _shrink_inputs(seg, 72, 16, dtype, device)
    y = _run(backend, rk.lora_shrink, x, weights_a, indptr, slots)
    _close(y, _oracle_shrink(x, weights_a, seg))
    _, weights_b, out = _expand_inputs(seg, 16, 40, dtype, device)
    want = _oracle_expand(y, weights_b, seg, out)
    _close(_run(backend, rk.lora_expand, y, weights_b, indptr, slots, out), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_an_adapter_get_zeros_from_shrink(
    device: torch.device, backend: rk.BackendName
) -> None:
    _needs_triton(backend)
    seg = CASES["no adapter"]
    x, weights_a = _shrink_inputs(seg, 40, 8, torch.float32, device)
    y = _run(backend, rk.lora_shrink, x, weights_a, *seg.tensors(device))
    assert y.shape == (7, 8) and (y == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_of_wider_tensors_are_read_and_written_through(
    device: torch.device, backend: rk.BackendName
) -> None:
    """A fused QKV layout: x a column slice, one shrink of [T, 2R] whose second half feeds
    the expand of the K block, written into a column slice of qkv; other columns untouched."""
    _needs_triton(backend)
    seg, k, r, n = CASES["mixed"], 40, 8, 24
    indptr, slots = seg.tensors(device)
    x = torch.randn(seg.rows, k + 9, device=device)[:, 3 : 3 + k]
    weights_a = _pool(SLOTS, 2 * r, k, dtype=torch.float32, device=device)
    y_both = _run(backend, rk.lora_shrink, x, weights_a, indptr, slots)
    y = y_both[:, r:]  # row stride 2R
    weights_b = _pool(SLOTS, n + 5, r, dtype=torch.float32, device=device)[:, 5:]
    qkv = torch.randn(seg.rows, 3 * n, device=device)
    before = qkv.clone()
    out = qkv[:, n : 2 * n]
    want = _oracle_expand(y, weights_b, seg, out)
    assert _run(backend, rk.lora_expand, y, weights_b, indptr, slots, out) is out
    _close(qkv[:, n : 2 * n], want)
    assert torch.equal(qkv[:, :n], before[:, :n]) and torch.equal(
        qkv[:, 2 * n :], before[:, 2 * n :]
    )
    _close(y_both, _oracle_shrink(x, weights_a, seg))


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_operands_are_read_and_written_through_their_strides(
    device: torch.device, backend: rk.BackendName
) -> None:
    _needs_triton(backend)
    seg, k, r, n = CASES["mixed"], 40, 8, 24
    indptr, slots = seg.tensors(device)
    x = torch.randn(k, seg.rows, device=device).T
    weights_a = _pool(SLOTS, k, r, dtype=torch.float32, device=device).transpose(1, 2)
    y = _run(backend, rk.lora_shrink, x, weights_a, indptr, slots)
    _close(y, _oracle_shrink(x, weights_a, seg))
    y_by_column = y.T.contiguous().T
    weights_b = _pool(SLOTS, r, n, dtype=torch.float32, device=device).transpose(1, 2)
    out = torch.randn(n, seg.rows, device=device).T
    want = _oracle_expand(y_by_column, weights_b, seg, out)
    _run(backend, rk.lora_expand, y_by_column, weights_b, indptr, slots, out)
    _close(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_given_max_seg_len_gives_the_same_result(
    device: torch.device, backend: rk.BackendName
) -> None:
    _needs_triton(backend)
    seg = CASES["mixed"]
    x, weights_a = _shrink_inputs(seg, 40, 8, torch.float32, device)
    args = (x, weights_a, *seg.tensors(device))
    want = _run(backend, rk.lora_shrink, *args)
    torch.testing.assert_close(_run(backend, rk.lora_shrink, *args, max_seg_len=19), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_batch_gives_an_empty_result(
    device: torch.device, backend: rk.BackendName
) -> None:
    _needs_triton(backend)
    seg = Segments([], [])
    x, weights_a = _shrink_inputs(seg, 40, 8, torch.float32, device)
    y = _run(backend, rk.lora_shrink, x, weights_a, *seg.tensors(device))
    assert y.shape == (0, 8)
    out = torch.empty(0, 24, device=device)
    weights_b = _pool(SLOTS, 24, 8, dtype=torch.float32, device=device)
    assert _run(backend, rk.lora_expand, y, weights_b, *seg.tensors(device), out).shape == (0, 24)


# --- the reference: the CPU path --------------------------------------------------------------


def test_cpu_tensors_run_the_reference_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = rk.reference.lora_shrink

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("reference")
        return real(*args, **kwargs)

    monkeypatch.setattr(rk.reference, "lora_shrink", spy)
    seg = CASES["decode"]
    x, weights_a = _shrink_inputs(seg, 40, 8, torch.float32, "cpu")
    with rk.use_backend("auto"):
        rk.lora_shrink(x, weights_a, *seg.tensors("cpu"))
    assert calls == ["reference"]


class _CountMatmuls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__name__", "") in ("matmul", "__matmul__", "mm", "linear"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_reference_runs_one_matmul_per_adapter_present_not_per_row_or_segment() -> None:
    seg = Segments([1] * 40 + [7, 9], [0, 1, -1, 2] * 10 + [1, 0])
    x, weights_a = _shrink_inputs(seg, 40, 8, torch.float32, "cpu")
    y, weights_b, out = _expand_inputs(seg, 8, 24, torch.float32, "cpu")
    want = _oracle_expand(y, weights_b, seg, out)
    with _CountMatmuls() as counted:
        got = rk.reference.lora_shrink(x, weights_a, *seg.tensors("cpu"))
        rk.reference.lora_expand(y, weights_b, *seg.tensors("cpu"), out)
    assert counted.count == 2 * 3
    _close(got, _oracle_shrink(x, weights_a, seg))
    _close(out, want)


@pytest.mark.parametrize(
    ("lengths", "slots", "message"),
    [
        ([3, 4], [0, 3], r"seg_slots must be -1 \(no adapter\) or a slot in 0\.\.2, got 3"),
        ([3, 4], [-2, 0], r"got -2"),
        ([3, 3], [0, 1], r"seg_indptr must be non-decreasing from 0 to the number of rows T = 7"),
    ],
)
def test_reference_rejects_segments_that_do_not_fit(
    lengths: list[int], slots: list[int], message: str
) -> None:
    x, weights_a = _shrink_inputs(Segments([7], [0]), 40, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        rk.reference.lora_shrink(x, weights_a, *Segments(lengths, slots).tensors("cpu"))


# --- bad arguments ------------------------------------------------------------------------------


def _shrink_args(**change: Any) -> dict[str, Any]:
    indptr, slots = Segments([2, 3], [0, -1]).tensors("cpu")
    args = {"x": torch.randn(5, 32), "weights_a": torch.randn(2, 8, 32)}
    return {**args, "seg_indptr": indptr, "seg_slots": slots, **change}


def _expand_args(**change: Any) -> dict[str, Any]:
    indptr, slots = Segments([2, 3], [0, -1]).tensors("cpu")
    args = {"y": torch.randn(5, 8), "weights_b": torch.randn(2, 24, 8), "out": torch.zeros(5, 24)}
    return {**args, "seg_indptr": indptr, "seg_slots": slots, **change}


BAD_ARGUMENTS: dict[str, tuple[Callable[..., Any], dict[str, Any], str]] = {
    "shrink 3-D x": (rk.lora_shrink, _shrink_args(x=torch.randn(1, 5, 32)), r"lora_shrink: x must be \[T, K\]"),
    "shrink int x": (rk.lora_shrink, _shrink_args(x=torch.ones(5, 32, dtype=torch.int32)), r"x must be float32, float16 or bfloat16"),
    "shrink 2-D weights": (rk.lora_shrink, _shrink_args(weights_a=torch.randn(8, 32)), r"weights_a must be \[S, R, K\]"),
    "shrink half weights": (rk.lora_shrink, _shrink_args(weights_a=torch.randn(2, 8, 32).half()), r"weights_a must have x's dtype torch\.float32, got torch\.float16"),
    "shrink wrong K": (rk.lora_shrink, _shrink_args(weights_a=torch.randn(2, 8, 30)), r"weights_a must have shape \[S, R, K\] with K = 32"),
    "shrink rank 512": (rk.lora_shrink, _shrink_args(weights_a=torch.randn(1, 512, 32)), r"rank R = 512 \(weights_a\.shape\[1\]\) must be at most 256"),
    "shrink float indptr": (rk.lora_shrink, _shrink_args(seg_indptr=torch.tensor([0.0, 2.0, 5.0])), r"seg_indptr must be int32 or int64"),
    "shrink int16 slots": (rk.lora_shrink, _shrink_args(seg_slots=torch.tensor([0, -1], dtype=torch.int16)), r"seg_slots must be int32 or int64"),
    "shrink 2-D indptr": (rk.lora_shrink, _shrink_args(seg_indptr=torch.zeros(1, 3, dtype=torch.int32)), r"seg_indptr must have shape \[G \+ 1\]"),
    "shrink empty indptr": (rk.lora_shrink, _shrink_args(seg_indptr=torch.zeros(0, dtype=torch.int32)), r"seg_indptr must have shape \[G \+ 1\] \(G >= 0\), got \(0,\)"),
    "shrink one slot for two segments": (rk.lora_shrink, _shrink_args(seg_slots=torch.tensor([0], dtype=torch.int32)), r"seg_slots must have shape \[G\] = \[2\]"),
    "shrink negative max_seg_len": (rk.lora_shrink, _shrink_args(max_seg_len=-1), r"max_seg_len must be >= 0"),
    "shrink two devices": (rk.lora_shrink, _shrink_args(x=torch.randn(5, 32, device="meta")), r"one device.*x on meta"),
    "expand 1-D y": (rk.lora_expand, _expand_args(y=torch.randn(8)), r"lora_expand: y must be \[T, R\]"),
    "expand weights of another dtype": (rk.lora_expand, _expand_args(weights_b=torch.randn(2, 24, 8).bfloat16()), r"weights_b must have y's dtype"),
    "expand wrong R": (rk.lora_expand, _expand_args(weights_b=torch.randn(2, 24, 4)), r"weights_b must have shape \[S, N, R\] with R = 8"),
    "expand out of the wrong width": (rk.lora_expand, _expand_args(out=torch.zeros(5, 23)), r"out must have shape \[T, N\] = \[5, 24\]"),
    "expand out of the wrong length": (rk.lora_expand, _expand_args(out=torch.zeros(4, 24)), r"out must have shape \[T, N\] = \[5, 24\]"),
    "expand int out": (rk.lora_expand, _expand_args(out=torch.zeros(5, 24, dtype=torch.int32)), r"out must be float32"),
    "expand rank 512": (rk.lora_expand, _expand_args(y=torch.randn(5, 512), weights_b=torch.randn(2, 24, 512)), r"rank R = 512 \(y\.shape\[1\]\) must be at most 256"),
    "expand out on another device": (rk.lora_expand, _expand_args(out=torch.zeros(5, 24, device="meta")), r"one device.*out on meta"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_lora_matmuls_reject_bad_arguments_naming_them(case: str) -> None:
    fn, kwargs, message = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=message):
        fn(**kwargs)


# --- GPU: serving shapes --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("r", [8, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lora_matmuls_at_serving_shapes(case: str, r: int, dtype: torch.dtype) -> None:
    """Llama-3-8B-like widths (K = 4096, a fused QKV of 6144 columns inside a wider output)."""
    seg = (
        Segments([1] * 64, [i % 9 - 1 for i in range(64)])
        if case == "decode"
        else Segments([700, 1, 0, 300, 1047], [0, 3, 1, -1, 7])
    )
    indptr, slots = seg.tensors("cuda")
    x = torch.randn(seg.rows, 4096, device="cuda", dtype=dtype)
    weights_a = _pool(8, r, 4096, dtype=dtype, device="cuda")
    weights_b = _pool(8, 6144, r, dtype=dtype, device="cuda")
    ys = [_run(b, rk.lora_shrink, x, weights_a, indptr, slots) for b in BACKENDS]
    _close(ys[1], ys[0])
    qkv = torch.randn(seg.rows, 6144 + 2048, device="cuda", dtype=dtype)
    outs = [qkv.clone()[:, 1024 : 1024 + 6144] for _ in BACKENDS]
    for backend, out in zip(BACKENDS, outs, strict=True):
        _run(backend, rk.lora_expand, ys[0], weights_b, indptr, slots, out)
    _close(outs[1], outs[0])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_with_a_plan_equals_the_oracle(case: str, dtype: torch.dtype) -> None:
    # One plan per batch, reused by every call (what the runtime does once per step).
    seg = CASES[case]
    indptr, slots = seg.tensors("cpu")
    plan = rk.lora_plan(indptr, slots, seg.rows)
    torch.manual_seed(3)
    x, weights_a = _shrink_inputs(seg, 40, 8, dtype, "cpu")
    with rk.use_backend("reference"):
        y = rk.lora_shrink(x, weights_a, indptr, slots, plan=plan)
        _close(y, _oracle_shrink(x, weights_a, seg))
        _, weights_b, out = _expand_inputs(seg, 8, 24, dtype, "cpu")
        want = _oracle_expand(y, weights_b, seg, out)
        _close(rk.lora_expand(y, weights_b, indptr, slots, out, plan=plan), want)


def test_a_plan_for_another_batch_is_refused() -> None:
    seg = CASES["mixed"]
    indptr, slots = seg.tensors("cpu")
    plan = rk.lora_plan(indptr[:3], slots[:2], 5)
    x, weights_a = _shrink_inputs(seg, 16, 8, torch.float32, "cpu")
    with rk.use_backend("reference"), pytest.raises(ValueError, match="plan is for 5 rows"):
        rk.lora_shrink(x, weights_a, indptr, slots, plan=plan)
