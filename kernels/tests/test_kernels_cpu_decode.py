"""`radixlm.kernels.cpu.decode.DecodeLayers` against the same decoder layers written in torch
(the products through `int4_linear` / `int8_linear` or torch's float32 matmul, everything else
in float32 torch): the residual stream and the K/V written, for int4, int8 and float32 weights, GQA, biases, per-head q/k
norms, a sliding window, and requests of different lengths in scattered slots; and the shapes
it refuses."""

from __future__ import annotations

import pytest
import torch

import radixlm.kernels as rk
from radixlm.kernels import cpu
from radixlm.kernels.cpu.decode import (
    DecodeLayers,
    DecoderLayerWeights,
    DecoderShape,
    LinearWeights,
)

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler here")

SLOTS = 160


def _linear(
    kind: str, n: int, k: int, group: int, bias: bool, gen: torch.Generator
) -> LinearWeights:
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) * 0.1 if bias else None
    if kind == "float32":
        return LinearWeights("float32", w, bias=b)
    if kind == "int4":
        q, s, z = rk.quantize_int4(w, group, fit=True)
        return LinearWeights("int4", q, s.float().contiguous(), z.float().contiguous(), group, b)
    if group == k:
        q, s = rk.quantize_int8(w)
        return LinearWeights("int8", q, s.float().contiguous(), bias=b)
    q, s = rk.quantize_int8_grouped(w, group)
    return LinearWeights("int8", q, s.float().contiguous(), bias=b)


def _apply(weights: LinearWeights, x: torch.Tensor) -> torch.Tensor:
    if weights.kind == "float32":
        y = x @ weights.weight.T  # torch's own product: the C one must equal it to rounding
    elif weights.kind == "int4":
        assert weights.zeros is not None
        y = cpu.int4_linear(x, weights.weight, weights.scales, weights.zeros, weights.group_size)
    else:
        assert weights.scales is not None
        y = cpu.int8_linear(x, weights.weight, weights.scales)
    return y if weights.bias is None else y + weights.bias


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def _reference(shape: DecoderShape, layers: list[DecoderLayerWeights], hidden: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, out_slots: torch.Tensor,
               table: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
               inputs: list[tuple[LinearWeights, torch.Tensor]] | None = None) -> None:  # fmt: skip
    """The layers in torch (the products through `_apply`); `inputs` gets the o and down
    products' weights and inputs (the products whose outputs add to the hidden state)."""
    d, heads, kv_heads = shape.head_dim, shape.heads, shape.kv_heads
    count = hidden.shape[0]
    for layer in layers:
        qkv = _apply(layer.qkv, _norm(hidden, layer.input_norm, shape.rms_norm_eps))
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k, v = (
            q.reshape(count, heads, d),
            k.reshape(count, kv_heads, d),
            v.reshape(count, kv_heads, d),
        )
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = (
                _norm(q, layer.q_norm, shape.rms_norm_eps),
                _norm(k, layer.k_norm, shape.rms_norm_eps),
            )
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        layer.k_pool[out_slots] = k
        layer.v_pool[out_slots] = v
        attended = torch.empty(count, heads, d)
        for m in range(count):
            length = int(lengths[m])
            first = max(0, length - layer.window) if layer.window else 0
            slots = table[rows[m], first:length].long()
            keys = layer.k_pool[slots].repeat_interleave(heads // kv_heads, dim=1)
            values = layer.v_pool[slots].repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[m], keys) * shape.scaling
            attended[m] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        hidden += _apply(layer.o, attended.reshape(count, -1))
        if inputs is not None:
            inputs.append((layer.o, attended.reshape(count, -1)))
        gate, up = _apply(layer.gate_up, _norm(hidden, layer.post_norm, shape.rms_norm_eps)).chunk(
            2, -1
        )
        hidden += _apply(layer.down, torch.nn.functional.silu(gate) * up)
        if inputs is not None:
            inputs.append((layer.down, torch.nn.functional.silu(gate) * up))


def _model(kind: str, group: int, *, qk_norm: bool, bias: bool, window: int | None,
           heads: int = 4, kv_heads: int = 2, head_dim: int = 32, layers: int = 2,
           slots: int = SLOTS) -> tuple[DecoderShape, list[DecoderLayerWeights]]:  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 64, 96
    shape = DecoderShape(hidden, heads, kv_heads, head_dim, inter, 1e-5, head_dim**-0.5)
    q, kv = heads * head_dim, kv_heads * head_dim
    out = []
    for _ in range(layers):
        norm = lambda n: (1 + 0.1 * torch.randn(n, generator=gen)).contiguous()  # noqa: E731
        out.append(
            DecoderLayerWeights(
                input_norm=norm(hidden),
                post_norm=norm(hidden),
                qkv=_linear(kind, q + 2 * kv, hidden, min(group, hidden), bias, gen),
                o=_linear(kind, hidden, q, min(group, q), False, gen),
                gate_up=_linear(kind, 2 * inter, hidden, min(group, hidden), False, gen),
                down=_linear(kind, hidden, inter, 32 if inter % group else group, False, gen),
                k_pool=torch.randn(slots, kv_heads, head_dim, generator=gen),
                v_pool=torch.randn(slots, kv_heads, head_dim, generator=gen),
                q_norm=norm(head_dim) if qk_norm else None,
                k_norm=norm(head_dim) if qk_norm else None,
                window=window,
            )
        )
    return shape, out


def _largest_weight(weights: LinearWeights) -> float:
    """The largest |weight| of a product, as it multiplies (dequantized)."""
    if weights.kind == "float32":
        return float(weights.weight.abs().max())
    assert weights.scales is not None
    if weights.kind == "int4":
        assert weights.zeros is not None
        w = rk.dequantize_int4(weights.weight, weights.scales, weights.zeros, weights.group_size)
    elif weights.scales.ndim == 1:
        w = rk.dequantize_int8(weights.weight, weights.scales)
    else:
        group = weights.weight.shape[1] // weights.scales.shape[1]
        w = rk.dequantize_int8_grouped(weights.weight, weights.scales, group)
    return float(w.abs().max())


def _rounding_slack(inputs: list[tuple[LinearWeights, torch.Tensor]]) -> torch.Tensor:
    """Per row, what rounding an activation to int8 one code the other way moves the layer's
    output by, at most, summed over the o and down products (twice over: a flip there adds
    to the output directly; one in the qkv or gate_up products' inputs passes through a
    product after it): the row's rounding step (its largest input / 127) x the product's
    largest weight. The C path and the reference compute the products' inputs in float32
    in different orders (norms' and softmaxes' sums, exp's polynomial): an input within
    ~1e-7 of a rounding boundary rounds one way in one and the other way in the other. On a
    64-wide model one such code moves an output by ~0.01-0.03, and which inputs land there
    changes with the build (AVX2 or AVX-512)."""
    slack = torch.zeros(inputs[0][1].shape[0])
    for weights, x in inputs:
        if weights.kind != "float32":
            slack += 2 * x.abs().amax(-1) / 127 * _largest_weight(weights)
    return slack


def _step(lengths: list[int], head_dim: int) -> tuple[torch.Tensor, ...]:
    """cos, sin, out_slots, table, rows, lengths of a step whose requests hold `lengths`
    tokens each (their new one last), in a shuffled slot order."""
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(SLOTS, generator=gen)
    table = torch.zeros(len(lengths) + 2, 40, dtype=torch.int32)
    rows = torch.arange(len(lengths), dtype=torch.int64) + 1  # not row 0
    start = 0
    for row, length in zip(rows.tolist(), lengths, strict=True):
        table[row, :length] = order[start : start + length].to(torch.int32)
        start += length
    out_slots = torch.tensor(
        [int(table[r, n - 1]) for r, n in zip(rows.tolist(), lengths, strict=True)]
    )
    angles = torch.rand(len(lengths), head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    return (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1), out_slots, table, rows,
            torch.tensor(lengths, dtype=torch.int64))  # fmt: skip


def _run_both(shape: DecoderShape, layers: list[DecoderLayerWeights], hidden: torch.Tensor,
              step: tuple[torch.Tensor, ...],
              inputs: list[tuple[LinearWeights, torch.Tensor]] | None = None,
              ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(C's hidden, the reference's), and the pools each wrote (as [k, v, k, v, ...]);
    `inputs` as `_reference`'s."""
    pools = [(layer.k_pool.clone(), layer.v_pool.clone()) for layer in layers]
    got = hidden.clone()
    DecodeLayers(shape, layers)(got, *step)
    written = [t.clone() for layer in layers for t in (layer.k_pool, layer.v_pool)]
    for layer, (k, v) in zip(layers, pools, strict=True):
        layer.k_pool.copy_(k)
        layer.v_pool.copy_(v)
    want = hidden.clone()
    _reference(shape, layers, want, *step, inputs=inputs)
    return got, want, *written


CASES = [(False, False, None), (True, False, None), (False, True, 5)]


@pytest.mark.parametrize(
    "kind,group", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", 10**9), ("float32", 32)]
)
@pytest.mark.parametrize("qk_norm,bias,window", CASES)
def test_decode_layers_equal_the_torch_layers_one_by_one(
    kind: str, group: int, qk_norm: bool, bias: bool, window: int | None
) -> None:
    """Layer by layer from the same input. (The quantized products round activations to
    int8: a float32 rounding difference upstream that moves one activation across a
    rounding boundary changes the layer's output by up to `_rounding_slack`, and such
    changes compound through layers: hence one layer at a time, each row within 2e-3 plus
    its slack: 0 in float32.)"""
    shape, layers = _model(kind, group, qk_norm=qk_norm, bias=bias, window=window, layers=3)
    step = _step([9, 1, 17, 4], shape.head_dim)
    hidden = torch.randn(4, shape.hidden, generator=torch.Generator().manual_seed(2))
    for layer in layers:
        inputs: list[tuple[LinearWeights, torch.Tensor]] = []
        got, want, k, v = _run_both(shape, [layer], hidden, step, inputs)
        # assert_close's atol=2e-3, rtol=1e-3, each row's atol raised by its slack
        off = ((got - want).abs() - 1e-3 * want.abs()).amax(-1)
        assert (off <= 2e-3 + _rounding_slack(inputs)).all(), (off, _rounding_slack(inputs))
        torch.testing.assert_close(k, layer.k_pool, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, layer.v_pool, atol=1e-4, rtol=1e-4)
        hidden = want


def test_several_layers_in_one_call_equal_one_call_per_layer() -> None:
    shape, layers = _model("int4", 32, qk_norm=True, bias=True, window=None, layers=3)
    step = _step([9, 1, 17, 4], shape.head_dim)
    hidden = torch.randn(4, shape.hidden, generator=torch.Generator().manual_seed(2))
    pools = [(layer.k_pool.clone(), layer.v_pool.clone()) for layer in layers]
    together = hidden.clone()
    DecodeLayers(shape, layers)(together, *step)
    for layer, (k, v) in zip(layers, pools, strict=True):
        layer.k_pool.copy_(k)
        layer.v_pool.copy_(v)
    apart = hidden.clone()
    for layer in layers:
        DecodeLayers(shape, [layer])(apart, *step)
    assert torch.equal(together, apart)


def test_shapes_that_do_not_fit_are_named() -> None:
    shape, layers = _model("int8", 32, qk_norm=False, bias=False, window=None)
    wrong = DecoderShape(shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, 128,
                         shape.rms_norm_eps, shape.scaling)  # fmt: skip
    with pytest.raises(ValueError, match="layer 0 gate_up is 192 x 64; expected 256 x 64"):
        DecodeLayers(wrong, layers)
    bad_norm = [DecoderLayerWeights(**{**layers[0].__dict__, "input_norm": torch.ones(3)})]
    with pytest.raises(ValueError, match="layer 0 input norm has 3 values"):
        DecodeLayers(shape, bad_norm)
    run = DecodeLayers(shape, layers)
    step = _step([3] * 17, shape.head_dim)
    with pytest.raises(RuntimeError, match=r"takes 1\.\.16 rows"):
        run(torch.zeros(17, shape.hidden), *step)


def _verify_step(
    length: int,
    rows_of_first: int,
    other: int,
    head_dim: int,
    width: int = 40,
    slots: int = SLOTS,
) -> tuple[torch.Tensor, ...]:
    """A step whose first request computes `rows_of_first` tokens (a token and its drafts:
    one table row, lengths `length`, `length` + 1, ...) beside a second request's decode."""
    gen = torch.Generator().manual_seed(4)
    order = torch.randperm(slots, generator=gen).to(torch.int32)
    table = torch.zeros(4, width, dtype=torch.int32)
    last = length + rows_of_first - 1
    table[1, :last] = order[:last]
    table[2, :other] = order[last : last + other]
    lengths = [length + j for j in range(rows_of_first)] + [other]
    rows = torch.tensor([1] * rows_of_first + [2], dtype=torch.int64)
    out_slots = torch.tensor(
        [int(table[1, n - 1]) for n in lengths[:-1]] + [int(table[2, other - 1])]
    )
    angles = torch.rand(len(lengths), head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    return (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1), out_slots, table, rows,
            torch.tensor(lengths, dtype=torch.int64))  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 7])
def test_rows_of_one_request_attend_together_as_the_reference_and_as_alone(
    head_dim: int, window: int | None
) -> None:
    """A verify step (one request's token and drafts in one table row, next to another
    request) against the torch layers; and, built batch-invariant, each of its rows bit for
    bit what that row gives computed alone (head dims 64 and 128 take the grouped attention
    on AVX-512, and by default, for four rows of three query heads per KV head, the wide
    one)."""
    shape, layers = _model("int4", 32, qk_norm=False, bias=False, window=window, heads=6,
                           kv_heads=2, head_dim=head_dim, layers=1)  # fmt: skip
    step = _verify_step(20, 4, 25, head_dim)
    hidden = torch.randn(5, shape.hidden, generator=torch.Generator().manual_seed(5))
    got, want, _k, _v = _run_both(shape, layers, hidden, step)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    cos, sin, out_slots, table, rows, lengths = step
    pools = [(layer.k_pool.clone(), layer.v_pool.clone()) for layer in layers]
    invariant = DecodeLayers(shape, layers, invariant=True)
    together = hidden.clone()
    invariant(together, *step)  # every row's K/V in the pool
    torch.testing.assert_close(together, want, atol=2e-3, rtol=1e-3)
    for index in range(5):
        alone = hidden[index : index + 1].clone()
        pick = slice(index, index + 1)
        invariant(alone, cos[pick], sin[pick], out_slots[pick], table, rows[pick], lengths[pick])
        assert torch.equal(alone[0], together[index]), f"row {index}"
    for layer, (k, v) in zip(layers, pools, strict=True):
        layer.k_pool.copy_(k)
        layer.v_pool.copy_(v)


def _both_forms_match_the_reference(shape: DecoderShape, layers: list[DecoderLayerWeights],
                                    hidden: torch.Tensor, step: tuple[torch.Tensor, ...]) -> None:  # fmt: skip
    """The layers by default and built batch-invariant, each against the torch layers."""
    got, want, *_pools = _run_both(shape, layers, hidden, step)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    invariant = hidden.clone()
    DecodeLayers(shape, layers, invariant=True)(invariant, *step)
    torch.testing.assert_close(invariant, want, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads", [6, 14])
def test_a_prefill_chunk_attends_as_the_reference(
    head_dim: int, window: int | None, heads: int
) -> None:
    """A prefill chunk of 60 tokens after 50 cached ones beside a decode, against the torch
    layers, by default (on AVX-512 the wide attention, the chunk's rows in one group, its key
    tiles ending mid-tile) and batch-invariant (groups of 16 rows). Three or seven query
    heads per KV head: 12 or 27 blocks of sixteen query vectors (score tiles of one to three
    blocks: the chunk's last keys only for the blocks of the rows that take them), value
    tiles across rows and part-filled."""
    shape, layers = _model("float32", 32, qk_norm=True, bias=False, window=window, heads=heads,
                           kv_heads=2, head_dim=head_dim, layers=2)  # fmt: skip
    step = _verify_step(51, 60, 30, head_dim, width=128)
    hidden = torch.randn(61, shape.hidden, generator=torch.Generator().manual_seed(6))
    _both_forms_match_the_reference(shape, layers, hidden, step)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 290])
def test_long_contexts_attend_as_the_reference(head_dim: int, window: int | None) -> None:
    """Longer contexts: a request adding 20 tokens to 300 cached ones beside a decode over
    600 keys, by default and batch-invariant (the chunk's rows in groups of 16 there). With
    a window of 290 the chunk's rows begin at different keys."""
    shape, layers = _model("float32", 32, qk_norm=False, bias=False, window=window, heads=6,
                           kv_heads=2, head_dim=head_dim, layers=1, slots=1024)  # fmt: skip
    step = _verify_step(301, 20, 600, head_dim, width=640, slots=1024)
    hidden = torch.randn(21, shape.hidden, generator=torch.Generator().manual_seed(10))
    _both_forms_match_the_reference(shape, layers, hidden, step)


def _shared_prefix_step(head_dim: int) -> tuple[torch.Tensor, ...]:
    """A step whose first three requests share their first 40 keys (as the radix cache
    shares a prefix's slots): two decodes and a request adding three tokens, then a fourth
    request that shares nothing."""
    gen = torch.Generator().manual_seed(7)
    order = torch.randperm(SLOTS, generator=gen).to(torch.int32)
    table = torch.zeros(5, 64, dtype=torch.int32)
    shared, own = order[:40], iter(order[40:].tolist())
    ends = {1: 45, 2: 52, 3: 46, 4: 20}
    for row, end in ends.items():
        first = 40 if row < 4 else 0
        if row < 4:
            table[row, :40] = shared
        table[row, first:end] = torch.tensor([next(own) for _ in range(end - first)])
    rows = torch.tensor([1, 2, 3, 3, 3, 4], dtype=torch.int64)
    lengths = torch.tensor([45, 52, 44, 45, 46, 20], dtype=torch.int64)
    out_slots = torch.stack([table[r, n - 1] for r, n in zip(rows, lengths, strict=True)]).long()
    angles = torch.rand(len(rows), head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1), out_slots, table, rows, lengths


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 7])
def test_requests_that_share_a_prefix_attend_as_the_reference(
    head_dim: int, window: int | None
) -> None:
    """Requests whose keys begin with the same slots (on AVX-512 they attend together, the
    shared keys read once for all: not in a layer with a window) against the torch layers,
    by default and batch-invariant."""
    shape, layers = _model("float32", 32, qk_norm=False, bias=True, window=window, heads=6,
                           kv_heads=2, head_dim=head_dim, layers=2)  # fmt: skip
    step = _shared_prefix_step(head_dim)
    hidden = torch.randn(6, shape.hidden, generator=torch.Generator().manual_seed(8))
    _both_forms_match_the_reference(shape, layers, hidden, step)


@pytest.mark.parametrize("step_of", ["verify", "shared"])
def test_the_layers_give_the_same_bits_on_one_thread_and_on_several(step_of: str) -> None:
    """The attention groups split over threads (and the products, when large): the layers on
    three threads equal themselves on one, bit for bit, K/V written included."""
    shape, layers = _model("float32", 32, qk_norm=False, bias=False, window=None, heads=6,
                           kv_heads=2, head_dim=64, layers=2)  # fmt: skip
    if step_of == "verify":
        step, rows = _verify_step(51, 37, 30, 64, width=96), 38
    else:
        step, rows = _shared_prefix_step(64), 6
    hidden = torch.randn(rows, shape.hidden, generator=torch.Generator().manual_seed(9))
    pools = [(layer.k_pool.clone(), layer.v_pool.clone()) for layer in layers]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for layer, (k, v) in zip(layers, pools, strict=True):
                layer.k_pool.copy_(k)
                layer.v_pool.copy_(v)
            got = hidden.clone()
            DecodeLayers(shape, layers)(got, *step)
            results.append([got] + [t.clone() for lay in layers for t in (lay.k_pool, lay.v_pool)])
    finally:
        torch.set_num_threads(before)
    for one, several in zip(*results, strict=True):
        assert torch.equal(one, several)
