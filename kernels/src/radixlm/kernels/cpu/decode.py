"""A decode step through every decoder layer of a Llama-like model in one C call (`decode.c`).

The model's weights are described once (`DecoderShape`, one `DecoderLayerWeights` per layer,
their projections as `LinearWeights` in the int4 or int8 layouts of `int4_linear` and
`int8_linear`, or float32 as `f32_linear` or, in panels, `f32_panel_linear` takes them), then
`DecodeLayers(...)(hidden, ...)` runs a step of up to `max_rows` new tokens (a decode's
one per request, a verify step's several, or a prefill chunk's, each a row with its own
length): the residual stream `hidden` is updated in place and each new token's K/V is
written into the layers' float32 pools. The arithmetic is that of the per-layer torch path
with these kernels' products, so the two agree to float32 rounding.

Attention (AVX-512, head dims 64 and 128): a request's rows attend together, each key read
once for all of them. Many rows of one request (a prefill chunk), and the rows of
consecutive requests whose tables begin with the same slots (a prefix the radix cache
shares: the shared keys are then read once for all of those requests), take a wide form,
the query vectors across the lanes so that scores need no horizontal sums; its sums run in
another order. Built ``invariant=True`` (batch-invariant inference) the layers keep to the
one form whose results for a row are the same bits whatever rows share its call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from radixlm.kernels import cpu

_INT4, _INT8, _F32, _F32_PANELS = 1, 2, 3, 4


@dataclass(frozen=True)
class LinearWeights:
    """One projection, ``y = x @ W.T (+ bias)``, as `int4_linear` (``kind="int4"``: ``weight``
    the packed uint8 codes [N, K / 2], ``scales`` and ``zeros`` [N, K / group_size]),
    `int8_linear` (``kind="int8"``: int8 ``weight`` [N, K], ``scales`` [N] or [N, K / g]) or
    `f32_linear` (``kind="float32"``: ``weight`` [N, K], no scales) or `f32_panel_linear`
    (``kind="float32_panels"``: ``weight`` as `pack_f32_panels` lays out [N, K], ``rows`` N)
    takes it; every tensor float32 except the codes, contiguous, on the CPU."""

    kind: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group_size: int = 0
    bias: torch.Tensor | None = None
    #: N of a weight in panels (its panels hold N rounded up to `cpu.PANEL`).
    rows: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind == "float32_panels":
            return self.rows, self.weight.shape[1]
        rows, columns = self.weight.shape
        return rows, columns * 2 if self.kind == "int4" else columns


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_norm_eps: float
    scaling: float


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer: its norms' weights (float32; ``q_norm``/``k_norm`` per head, or
    None), its four projections (q/k/v merged in that order, gate/up merged), its K/V pools
    (float32 [slots, kv_heads, head_dim], written at the new tokens' slots) and its sliding
    window (keys attended per token; None: all)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearWeights
    o: LinearWeights
    gate_up: LinearWeights
    down: LinearWeights
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int | None = None


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("zeros", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_pool", ctypes.c_void_p),
        ("v_pool", ctypes.c_void_p),
        ("window", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("layers", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
        ("invariant", ctypes.c_int32),
    ]


def _pointer(tensor: torch.Tensor | None, what: str, dtype: torch.dtype, size: int) -> int | None:
    if tensor is None:
        return None
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{what} must be a contiguous {dtype} CPU tensor")
    if tensor.numel() != size:
        raise ValueError(f"{what} has {tensor.numel()} values; the layer needs {size}")
    ptr: int = tensor.data_ptr()
    return ptr


def _linear(weights: LinearWeights, n: int, k: int, what: str) -> _Linear:
    if weights.shape != (n, k):
        raise ValueError(f"{what} is {weights.shape[0]} x {weights.shape[1]}; expected {n} x {k}")
    if weights.kind == "float32":
        weight = _pointer(weights.weight, f"{what} weight", torch.float32, n * k)
        bias = _pointer(weights.bias, f"{what} bias", torch.float32, n)
        return _Linear(_F32, n, k, 0, weight, None, None, bias)
    if weights.kind == "float32_panels":
        size = -(-n // cpu.PANEL) * cpu.PANEL * k
        weight = _pointer(weights.weight, f"{what} panels", torch.float32, size)
        if weight is None or weight % 64 or weights.weight.shape[2:] != (cpu.PANEL,):
            raise ValueError(f"{what}: its panels are not {cpu.PANEL} wide and 64-byte aligned")
        bias = _pointer(weights.bias, f"{what} bias", torch.float32, n)
        return _Linear(_F32_PANELS, n, k, 0, weight, None, None, bias)
    if k % cpu.BLOCK:
        raise ValueError(f"{what}: its input width {k} is not a multiple of {cpu.BLOCK}")
    if weights.scales is None:
        raise ValueError(f"{what}: {weights.kind} weights need scales")
    if weights.kind == "int4":
        group = weights.group_size
        if group % cpu.BLOCK or k % group:
            raise ValueError(f"{what}: int4 groups of {group} do not divide {k} in blocks")
        code, groups = _INT4, k // group
        weight = _pointer(weights.weight, f"{what} codes", torch.uint8, n * k // 2)
        zeros = _pointer(weights.zeros, f"{what} zeros", torch.float32, n * groups)
        if zeros is None:
            raise ValueError(f"{what}: int4 weights need zero points")
    elif weights.kind == "int8":
        groups = 1 if weights.scales.dim() == 1 else weights.scales.shape[1]
        group = k // groups
        if groups * group != k or group % cpu.BLOCK:
            raise ValueError(f"{what}: int8 scales {tuple(weights.scales.shape)} do not fit {k}")
        code, zeros = _INT8, None
        weight = _pointer(weights.weight, f"{what} weight", torch.int8, n * k)
    else:
        raise ValueError(
            f"{what}: kind {weights.kind!r} is not int4, int8, float32 or float32_panels"
        )
    scales = _pointer(weights.scales, f"{what} scales", torch.float32, n * groups)
    bias = _pointer(weights.bias, f"{what} bias", torch.float32, n)
    return _Linear(code, n, k, group, weight, scales, zeros, bias)


class DecodeLayers:
    """The decoder layers of one model, described once (their tensors are held, not copied:
    they must keep their storage, which loading weights in place does)."""

    def __init__(
        self, shape: DecoderShape, layers: list[DecoderLayerWeights], invariant: bool = False
    ) -> None:
        """`invariant`: a row's results the same bits whatever rows share its call (the wide
        attention, whose sums run in another order, is then not used; see the module)."""
        if not layers:
            raise ValueError("a decoder needs at least one layer")
        if shape.heads % shape.kv_heads:
            raise ValueError(f"{shape.heads} heads do not split over {shape.kv_heads} KV heads")
        self.shape = shape
        self._layers = layers  # keeps every tensor the structures point to alive
        kinds = {
            weights.kind
            for layer in layers
            for weights in (layer.qkv, layer.o, layer.gate_up, layer.down)
        }
        #: Whether every projection is float32 in panels: a call then takes a whole prefill.
        self.panels_only = kinds == {"float32_panels"}
        # max_rows, the most rows a call takes: all of a chunk in panels, F32_MAX_ROWS when
        # every product is float32, else MAX_ROWS.
        if self.panels_only:
            self.max_rows = cpu.PANELS_MAX_ROWS
        elif kinds <= {"float32", "float32_panels"}:
            self.max_rows = cpu.F32_MAX_ROWS
        else:
            self.max_rows = cpu.MAX_ROWS
        h, d = shape.hidden, shape.head_dim
        q, kv, inter = shape.heads * d, shape.kv_heads * d, shape.intermediate
        self._slots = layers[0].k_pool.shape[0]
        self._c_layers = (_Layer * len(layers))()
        for index, layer in enumerate(layers):
            what = f"layer {index}"
            pool = self._slots * kv
            for name in ("k_pool", "v_pool"):
                if getattr(layer, name).shape[0] != self._slots:
                    raise ValueError(f"{what}: the K/V pools of the layers differ in slots")
            self._c_layers[index] = _Layer(
                _pointer(layer.input_norm, f"{what} input norm", torch.float32, h),
                _pointer(layer.post_norm, f"{what} post-attention norm", torch.float32, h),
                _pointer(layer.q_norm, f"{what} q norm", torch.float32, d),
                _pointer(layer.k_norm, f"{what} k norm", torch.float32, d),
                _linear(layer.qkv, q + 2 * kv, h, f"{what} qkv"),
                _linear(layer.o, h, q, f"{what} o"),
                _linear(layer.gate_up, 2 * inter, h, f"{what} gate_up"),
                _linear(layer.down, h, inter, f"{what} down"),
                _pointer(layer.k_pool, f"{what} K pool", torch.float32, pool),
                _pointer(layer.v_pool, f"{what} V pool", torch.float32, pool),
                layer.window or 0,
                0,
            )
        self._c_shape = _Shape(
            h, shape.heads, shape.kv_heads, d, inter, len(layers), shape.rms_norm_eps,
            shape.scaling, int(invariant),
        )  # fmt: skip
        library = cpu._loaded()
        function = library.radixlm_decode_layers
        function.restype = ctypes.c_int
        pointer = ctypes.c_void_p
        function.argtypes = [pointer, pointer, ctypes.c_int, *[pointer] * 5, ctypes.c_int64,
                             pointer, pointer]  # fmt: skip
        self._function = function

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        table: torch.Tensor,
        rows: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """Run every layer over ``hidden`` [M, hidden] (float32, M <= `max_rows`; updated in
        place). ``cos``/``sin`` [M, head_dim] float32 in `apply_rotary`'s form (signed sin);
        ``out_slots`` [M] int64 the new tokens' pool slots; request m's keys are the slots
        ``table[rows[m], :lengths[m]]`` (``table`` int32 [requests, context], its new token's
        slot included). Mutates ``hidden`` and the K/V pools; raises RuntimeError on shapes
        the kernels refuse (nothing is written then only if the first layer refused)."""
        count = hidden.shape[0]
        if not 1 <= count <= self.max_rows or hidden.shape[1] != self.shape.hidden:
            raise RuntimeError(
                f"decode_layers takes 1..{self.max_rows} rows of {self.shape.hidden}; got "
                f"{tuple(hidden.shape)}"
            )
        d = self.shape.head_dim
        cpu._check(
            "decode_layers",
            (
                ("hidden", hidden, torch.float32),
                ("cos", cos, torch.float32),
                ("sin", sin, torch.float32),
                ("out_slots", out_slots, torch.int64),
                ("table", table, torch.int32),
                ("rows", rows, torch.int64),
                ("lengths", lengths, torch.int64),
            ),
        )
        if cos.numel() != count * d or sin.numel() != count * d:
            raise RuntimeError(f"decode_layers: cos and sin need {count} x {d} values")
        if out_slots.numel() != count or rows.numel() != count or lengths.numel() != count:
            raise RuntimeError(f"decode_layers: out_slots, rows and lengths need {count} values")
        cpu._loaded()  # the kernels' thread count in line with torch's now
        code = self._function(
            ctypes.byref(self._c_shape),
            self._c_layers,
            count,
            hidden.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            out_slots.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            rows.data_ptr(),
            lengths.data_ptr(),
        )
        if code != 0:
            raise RuntimeError(f"decode_layers: the kernel failed ({code})")
