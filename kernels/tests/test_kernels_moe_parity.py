"""Mixture-of-experts ops: moe_align, grouped_matmul and fused_moe on both backends against
per-token float64 oracles (Triton in the interpreter on CPU), fused_moe against the
transformers-style per-expert loop, and the argument checks."""

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
# fp32 products are compared at about 1e-4 relative; half types after one rounding of the result.
TOL = {**TOLERANCES, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}
HIDDEN, INTER = 40, 24  # H and I, neither a multiple of 16


@dataclass(frozen=True)
class Routing:
    """T tokens, k distinct experts each out of E; experts 1 and E - 1 never chosen, and
    about one choice in five on another rank (-1)."""

    tokens: int
    k: int
    experts: int

    def ids(self, device: torch.device | str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 * self.tokens + 10 * self.k + self.experts)
        chosen = torch.tensor([e for e in range(self.experts) if e not in (1, self.experts - 1)])
        rows = [
            chosen[torch.randperm(len(chosen), generator=gen)[: self.k]] for _ in range(self.tokens)
        ]
        ids = torch.stack(rows) if rows else torch.empty(0, self.k, dtype=torch.int64)
        ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1
        return ids.to(device=device, dtype=dtype)


ROUTINGS = {
    f"T={r.tokens} k={r.k} E={r.experts}": r
    for r in [
        Routing(1, 1, 4),
        Routing(1, 2, 8),
        Routing(5, 2, 4),
        Routing(5, 1, 8),
        Routing(33, 1, 4),
        Routing(33, 2, 8),
    ]
}


def _oracle_align(ids: torch.Tensor, experts: int) -> tuple[list[int], list[int]]:
    flat = ids.reshape(-1).tolist()
    order = [p for e in range(experts) for p, i in enumerate(flat) if i == e]
    offsets = [0]
    for e in range(experts):
        offsets.append(offsets[-1] + flat.count(e))
    return order, offsets


def _oracle_grouped(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Row by row in float64, each row with the expert that owns it, rounded to x's dtype."""
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float64)
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    for row, e in enumerate(experts):
        out[row] = weights[e].cpu().double() @ x[row].cpu().double()
    return out.to(x.dtype)


def _oracle_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Token by token, choice by choice, in float64, rounded to hidden's dtype."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        for c in range(topk_ids.shape[1]):
            e = int(topk_ids[t, c])
            if e < 0:
                continue
            gate_up = w13[e].cpu().double() @ hidden[t].cpu().double()
            gate, up = gate_up[:inter], gate_up[inter:]
            act = gate / (1.0 + torch.exp(-gate)) * up
            out[t] += float(topk_weights[t, c]) * (w2[e].cpu().double() @ act)
    return out.to(hidden.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), **TOL[want.dtype])


def _weights(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Random weights scaled so that products stay near unit size."""
    return (torch.randn(*shape) / math.sqrt(shape[-1])).to(device=device, dtype=dtype)


def _moe_inputs(
    routing: Routing, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    e, t, k = routing.experts, routing.tokens, routing.k
    hidden = torch.randn(t, HIDDEN).to(device=device, dtype=dtype)
    w13 = _weights(e, 2 * INTER, HIDDEN, dtype=dtype, device=device)
    w2 = _weights(e, HIDDEN, INTER, dtype=dtype, device=device)
    topk_weights = torch.softmax(torch.randn(t, k), dim=-1).to(device)
    return hidden, w13, w2, topk_weights, routing.ids(device)


def _offsets(counts: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=device)


def _run(
    backend: rk.BackendName, fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
) -> torch.Tensor:
    with rk.use_backend(backend):
        return fn(*args, **kwargs)


def _needs_triton(backend: rk.BackendName) -> None:
    if backend == "triton":
        pytest.importorskip("triton")


# --- moe_align -----------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_align_groups_pairs_by_expert_in_order_leaving_out_other_ranks(
    device: torch.device, routing: str, dtype: torch.dtype
) -> None:
    r = ROUTINGS[routing]
    ids = r.ids(device, dtype)
    order, offsets = rk.moe_align(ids, r.experts)
    want_order, want_offsets = _oracle_align(ids.cpu(), r.experts)
    assert order.dtype == offsets.dtype == torch.int64
    assert order.tolist() == want_order and offsets.tolist() == want_offsets


def test_align_of_a_batch_on_another_rank_is_empty() -> None:
    order, offsets = rk.moe_align(torch.full((3, 2), -1), 4)
    assert order.shape == (0,) and offsets.tolist() == [0] * 5


def test_align_of_no_tokens_is_empty() -> None:
    order, offsets = rk.moe_align(torch.empty(0, 2, dtype=torch.int32), 4)
    assert order.shape == (0,) and offsets.tolist() == [0] * 5


@pytest.mark.parametrize("bad", [-2, 4])
def test_align_rejects_ids_outside_the_experts(bad: int) -> None:
    ids = torch.tensor([[0, 3], [bad, -1]])
    with pytest.raises(
        ValueError, match=rf"moe_align: topk_ids must be -1 .* in 0\.\.3, got {bad}"
    ):
        rk.moe_align(ids, 4)


# --- grouped_matmul ------------------------------------------------------------------------------

# Rows per expert: empty experts, one-row experts, experts longer than one 16-row tile.
COUNTS = {
    "mixed": [5, 0, 17, 1, 0, 3, 20, 0],
    "one row": [0, 0, 1, 0],
    "one expert": [0, 33, 0, 0],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(COUNTS))
def test_grouped_matmul_multiplies_each_experts_rows_by_its_weight(
    device: torch.device, backend: rk.BackendName, case: str
) -> None:
    _needs_triton(backend)
    counts = COUNTS[case]
    x = torch.randn(sum(counts), HIDDEN, device=device)
    weights = _weights(len(counts), 2 * INTER, HIDDEN, dtype=torch.float32, device=device)
    got = _run(backend, rk.grouped_matmul, x, weights, _offsets(counts, device))
    _close(got, _oracle_grouped(x, weights, counts))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grouped_matmul_in_half_precision(
    device: torch.device, backend: rk.BackendName, dtype: torch.dtype
) -> None:
    _needs_triton(backend)
    counts = COUNTS["mixed"]
    x = torch.randn(sum(counts), INTER).to(device=device, dtype=dtype)
    weights = _weights(len(counts), HIDDEN, INTER, dtype=dtype, device=device)
    offsets = _offsets(counts, device).int()
    _close(
        _run(backend, rk.grouped_matmul, x, weights, offsets), _oracle_grouped(x, weights, counts)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_matmul_reads_operands_through_their_strides(
    device: torch.device, backend: rk.BackendName
) -> None:
    _needs_triton(backend)
    counts = COUNTS["mixed"]
    x = torch.randn(sum(counts), HIDDEN + 9, device=device)[:, 3 : 3 + HIDDEN]
    weights = _weights(len(counts), HIDDEN, INTER, dtype=torch.float32, device=device)
    weights = weights.transpose(1, 2)  # [E, N, K] with a unit stride on N
    got = _run(backend, rk.grouped_matmul, x, weights, _offsets(counts, device))
    _close(got, _oracle_grouped(x, weights, counts))


@pytest.mark.parametrize("hint", [1, 20, 1000])
def test_max_rows_per_expert_only_changes_the_tiles(device: torch.device, hint: int) -> None:
    _needs_triton("triton")
    counts = COUNTS["mixed"]
    x = torch.randn(sum(counts), HIDDEN, device=device)
    weights = _weights(len(counts), INTER, HIDDEN, dtype=torch.float32, device=device)
    offsets = _offsets(counts, device)
    got = _run("triton", rk.grouped_matmul, x, weights, offsets, max_rows_per_expert=hint)
    _close(got, _oracle_grouped(x, weights, counts))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_matmul_of_no_rows_is_empty(device: torch.device, backend: rk.BackendName) -> None:
    _needs_triton(backend)
    weights = _weights(4, INTER, HIDDEN, dtype=torch.float32, device=device)
    x = torch.empty(0, HIDDEN, device=device)
    got = _run(backend, rk.grouped_matmul, x, weights, _offsets([0] * 4, device))
    assert got.shape == (0, INTER)


# --- fused_moe -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_fused_moe_sums_each_tokens_weighted_experts(
    device: torch.device, backend: rk.BackendName, routing: str
) -> None:
    _needs_triton(backend)
    inputs = _moe_inputs(ROUTINGS[routing], torch.float32, device)
    _close(_run(backend, rk.fused_moe, *inputs), _oracle_moe(*inputs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_in_half_precision(
    device: torch.device, backend: rk.BackendName, dtype: torch.dtype
) -> None:
    _needs_triton(backend)
    inputs = _moe_inputs(ROUTINGS["T=33 k=2 E=8"], dtype, device)
    _close(_run(backend, rk.fused_moe, *inputs), _oracle_moe(*inputs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_equals_the_per_expert_loop(
    device: torch.device, backend: rk.BackendName, dtype: torch.dtype
) -> None:
    _needs_triton(backend)
    inputs = _moe_inputs(ROUTINGS["T=33 k=2 E=8"], dtype, device)
    want = rk.reference.moe_per_expert_loop(*inputs)
    _close(_run(backend, rk.fused_moe, *inputs), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_with_every_choice_on_another_rank_get_zeros(
    device: torch.device, backend: rk.BackendName
) -> None:
    _needs_triton(backend)
    hidden, w13, w2, topk_weights, topk_ids = _moe_inputs(
        ROUTINGS["T=5 k=2 E=4"], torch.float32, device
    )
    topk_ids[1] = -1
    topk_ids[3] = -1
    got = _run(backend, rk.fused_moe, hidden, w13, w2, topk_weights, topk_ids)
    assert (got[1] == 0).all() and (got[3] == 0).all()
    _close(got, _oracle_moe(hidden, w13, w2, topk_weights, topk_ids))
    topk_ids.fill_(-1)
    assert (_run(backend, rk.fused_moe, hidden, w13, w2, topk_weights, topk_ids) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_given_plan_gives_the_same_result(device: torch.device, backend: rk.BackendName) -> None:
    _needs_triton(backend)
    r = ROUTINGS["T=33 k=2 E=8"]
    inputs = _moe_inputs(r, torch.float32, device)
    plan = rk.moe_align(inputs[-1], r.experts)
    got = _run(backend, rk.fused_moe, *inputs, plan=plan)
    torch.testing.assert_close(got, _run(backend, rk.fused_moe, *inputs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_of_no_tokens_is_empty(device: torch.device, backend: rk.BackendName) -> None:
    _needs_triton(backend)
    inputs = _moe_inputs(Routing(0, 2, 4), torch.float32, device)
    assert _run(backend, rk.fused_moe, *inputs).shape == (0, HIDDEN)


def test_cpu_tensors_run_the_reference_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = rk.reference.fused_moe

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("reference")
        return real(*args, **kwargs)

    monkeypatch.setattr(rk.reference, "fused_moe", spy)
    with rk.use_backend("auto"):
        rk.fused_moe(*_moe_inputs(ROUTINGS["T=5 k=2 E=4"], torch.float32, "cpu"))
    assert calls == ["reference"]


# --- the reference: the CPU path -----------------------------------------------------------------


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


def test_reference_runs_one_matmul_per_expert_with_rows_not_per_token() -> None:
    counts = COUNTS["mixed"]  # 5 experts with rows, 46 rows
    x = torch.randn(sum(counts), HIDDEN)
    weights = _weights(len(counts), INTER, HIDDEN, dtype=torch.float32, device="cpu")
    with _CountMatmuls() as counted:
        got = rk.reference.grouped_matmul(x, weights, _offsets(counts, "cpu"))
    assert counted.count == 5
    _close(got, _oracle_grouped(x, weights, counts))


@pytest.mark.parametrize(
    "offsets", [[0, 3, 2, 7], [1, 3, 5, 7], [0, 3, 5, 6]], ids=["decreasing", "late", "short"]
)
def test_reference_rejects_offsets_that_do_not_cover_the_rows(offsets: list[int]) -> None:
    weights = torch.randn(3, 8, 16)
    with pytest.raises(
        ValueError, match=r"expert_offsets must be non-decreasing from 0 to .* M = 7"
    ):
        rk.reference.grouped_matmul(torch.randn(7, 16), weights, torch.tensor(offsets))


# --- bad arguments -------------------------------------------------------------------------------


def _matmul_args(**change: Any) -> dict[str, Any]:
    args = {"x": torch.randn(5, 16), "weights": torch.randn(3, 8, 16)}
    return {**args, "expert_offsets": torch.tensor([0, 2, 2, 5]), **change}


def _moe_args(**change: Any) -> dict[str, Any]:
    args = {
        "hidden": torch.randn(4, 16),
        "w13": torch.randn(3, 2 * 8, 16),
        "w2": torch.randn(3, 16, 8),
        "topk_weights": torch.rand(4, 2),
        "topk_ids": torch.tensor([[0, 1], [2, -1], [1, 0], [2, 1]]),
    }
    return {**args, **change}


_PLAN = (torch.arange(7), torch.tensor([0, 2, 5, 7]))

BAD_ARGUMENTS: dict[str, tuple[Callable[..., Any], dict[str, Any], str]] = {
    "align 1-D ids": (rk.moe_align, {"topk_ids": torch.tensor([0, 1]), "num_experts": 4}, r"moe_align: topk_ids must be \[T, k\]"),
    "align float ids": (rk.moe_align, {"topk_ids": torch.zeros(2, 2), "num_experts": 4}, r"topk_ids must be int32 or int64"),
    "align no experts": (rk.moe_align, {"topk_ids": torch.zeros(2, 2, dtype=torch.int32), "num_experts": 0}, r"num_experts must be an int >= 1, got 0"),
    "matmul 3-D x": (rk.grouped_matmul, _matmul_args(x=torch.randn(1, 5, 16)), r"grouped_matmul: x must be \[M, K\]"),
    "matmul int x": (rk.grouped_matmul, _matmul_args(x=torch.ones(5, 16, dtype=torch.int32)), r"x must be float32, float16 or bfloat16"),
    "matmul 2-D weights": (rk.grouped_matmul, _matmul_args(weights=torch.randn(8, 16)), r"weights must be \[E, N, K\]"),
    "matmul half weights": (rk.grouped_matmul, _matmul_args(weights=torch.randn(3, 8, 16).half()), r"weights must have x's dtype torch\.float32, got torch\.float16"),
    "matmul wrong K": (rk.grouped_matmul, _matmul_args(weights=torch.randn(3, 8, 12)), r"weights must have shape \[E, N, K\] with E >= 1 and K = 16"),
    "matmul no experts": (rk.grouped_matmul, _matmul_args(weights=torch.randn(0, 8, 16), expert_offsets=torch.tensor([0])), r"with E >= 1"),
    "matmul offsets for 2 experts": (rk.grouped_matmul, _matmul_args(expert_offsets=torch.tensor([0, 2, 5])), r"expert_offsets must have shape \[E \+ 1\] = \[4\] \(E = weights\.shape\[0\]\), got \(3,\)"),
    "matmul float offsets": (rk.grouped_matmul, _matmul_args(expert_offsets=torch.tensor([0.0, 2.0, 2.0, 5.0])), r"expert_offsets must be int32 or int64"),
    "matmul negative hint": (rk.grouped_matmul, _matmul_args(max_rows_per_expert=-1), r"max_rows_per_expert must be >= 0"),
    "matmul two devices": (rk.grouped_matmul, _matmul_args(x=torch.randn(5, 16, device="meta")), r"one device.*x on meta"),
    "moe 1-D hidden": (rk.fused_moe, _moe_args(hidden=torch.randn(16)), r"fused_moe: hidden must be \[T, H\]"),
    "moe int hidden": (rk.fused_moe, _moe_args(hidden=torch.ones(4, 16, dtype=torch.int64)), r"hidden must be float32"),
    "moe w13 of another dtype": (rk.fused_moe, _moe_args(w13=torch.randn(3, 16, 16).bfloat16()), r"w13 must have hidden's dtype torch\.float32, got torch\.bfloat16"),
    "moe w2 of another dtype": (rk.fused_moe, _moe_args(w2=torch.randn(3, 16, 8).half()), r"w2 must have hidden's dtype"),
    "moe 2-D w13": (rk.fused_moe, _moe_args(w13=torch.randn(16, 16)), r"w13 must be \[E, 2 \* I, H\]"),
    "moe odd w13": (rk.fused_moe, _moe_args(w13=torch.randn(3, 15, 16)), r"w13 must have shape \[E, 2 \* I, H\] with E >= 1, an even 2 \* I and H = 16"),
    "moe w13 of another H": (rk.fused_moe, _moe_args(w13=torch.randn(3, 16, 12)), r"H = 16 \(hidden\.shape\[1\]\), got \(3, 16, 12\)"),
    "moe w2 of another I": (rk.fused_moe, _moe_args(w2=torch.randn(3, 16, 4)), r"w2 must have shape \[E, H, I\] = \[3, 16, 8\]"),
    "moe w2 of other experts": (rk.fused_moe, _moe_args(w2=torch.randn(4, 16, 8)), r"w2 must have shape \[E, H, I\] = \[3, 16, 8\]"),
    "moe float ids": (rk.fused_moe, _moe_args(topk_ids=torch.zeros(4, 2)), r"topk_ids must be int32 or int64"),
    "moe ids of other tokens": (rk.fused_moe, _moe_args(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), r"topk_ids must have T = 4 rows \(hidden\.shape\[0\]\), got 3"),
    "moe int weights": (rk.fused_moe, _moe_args(topk_weights=torch.ones(4, 2, dtype=torch.int32)), r"topk_weights must be float32"),
    "moe weights of another k": (rk.fused_moe, _moe_args(topk_weights=torch.rand(4, 1)), r"topk_weights must have topk_ids' shape \(4, 2\), got \(4, 1\)"),
    "moe ids out of range": (rk.fused_moe, _moe_args(topk_ids=torch.tensor([[0, 1], [2, 3], [1, 0], [2, 1]])), r"fused_moe: topk_ids must be -1 .* in 0\.\.2, got 3"),
    "moe plan not a pair": (rk.fused_moe, _moe_args(plan=torch.arange(7)), r"plan must be the \(order, expert_offsets\) pair that moe_align returns"),
    "moe plan too long": (rk.fused_moe, _moe_args(plan=(torch.arange(9), _PLAN[1])), r"plan's order must have shape \[P\] with P <= T \* k = 8"),
    "moe plan of other experts": (rk.fused_moe, _moe_args(plan=(_PLAN[0], torch.tensor([0, 7]))), r"plan's expert_offsets must have shape \[E \+ 1\] = \[4\] \(E = w13\.shape\[0\]\)"),
    "moe ids on another device": (rk.fused_moe, _moe_args(topk_ids=torch.zeros(4, 2, dtype=torch.int64, device="meta")), r"one device.*topk_ids on meta"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_moe_ops_reject_bad_arguments_naming_them(case: str) -> None:
    fn, kwargs, message = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=message):
        fn(**kwargs)


# --- GPU: serving shapes -------------------------------------------------------------------------

# (E, k, H, I) of each family's experts.
MOE_MODELS = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen2-57b-a14b": (64, 8, 3584, 2560),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("model", list(MOE_MODELS))
@pytest.mark.parametrize("tokens", [1, 64, 1500])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_at_serving_shapes(model: str, tokens: int, dtype: torch.dtype) -> None:
    experts, k, hidden_size, inter = MOE_MODELS[model]
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=dtype)
    w13 = _weights(experts, 2 * inter, hidden_size, dtype=dtype, device="cuda")
    w2 = _weights(experts, hidden_size, inter, dtype=dtype, device="cuda")
    logits = torch.randn(tokens, experts, device="cuda")
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    topk_ids[topk_ids % 5 == 4] = -1  # some experts on another rank
    plan = rk.moe_align(topk_ids, experts)
    outs = [
        _run(b, rk.fused_moe, hidden, w13, w2, topk_weights, topk_ids, plan=plan) for b in BACKENDS
    ]
    _close(outs[1], outs[0])
    x = hidden.index_select(0, plan[0] // k)
    mats = [
        _run(b, rk.grouped_matmul, x, w13, plan[1], max_rows_per_expert=tokens) for b in BACKENDS
    ]
    _close(mats[1], mats[0])
